"""Tiny models that exercise DDP's corner cases. Each takes ``(x, step)`` so that
models whose used parameters change from step to step can do so deterministically."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["GPT", "GPTBlock", "MODELS", "TinyLM", "make_model"]

IN, OUT = 8, 4


class MLP(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3, ckpt: str = "none") -> None:
        super().__init__()
        self.ckpt = ckpt
        dims = [IN] + [width] * (depth - 1)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.Tanh())
                                    for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(dims[-1], OUT)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            # The first layer is never checkpointed: reentrant checkpointing needs an
            # input that requires grad, or its parameters get no gradient at all.
            if self.ckpt == "none" or i == 0:
                x = layer(x)
            else:
                x = checkpoint(layer, x, use_reentrant=self.ckpt == "reentrant")
        return self.head(x)


class Tied(nn.Module):
    """Input and output projections share one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, 16, bias=False)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, IN, bias=False)
        self.out.weight = self.proj.weight  # tied: (16, 8) used as (8, 16)^T
        self.head = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        h = torch.tanh(self.proj(x))
        h = torch.tanh(self.mid(h))
        return self.head(h @ self.proj.weight)


class Frozen(MLP):
    def __init__(self) -> None:
        super().__init__()
        for p in self.layers[0].parameters():
            p.requires_grad_(False)


class NeverUsed(MLP):
    """A submodule that forward never calls (needs find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(16, 16)


class Switching(nn.Module):
    """Which branch runs depends on the step (needs find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(IN, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(16, OUT)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        h = torch.tanh(self.a(h) if step % 2 == 0 else self.b(h))
        return self.head(h)


class TwoDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(IN, 16).double()
        self.second = nn.Linear(16, OUT)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x.double())).float())


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(IN, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, OUT)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.fc(x))))


class Encoder(nn.Module):
    """A transformer encoder over a sequence made from the features."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 16)
        layer = nn.TransformerEncoderLayer(16, nhead=2, dim_feedforward=32, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(16, OUT)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        seq = self.embed(x.view(x.shape[0], IN // 2, 2))
        return self.head(self.encoder(seq).mean(dim=1))


class TinyLM(nn.Module):
    """A token embedding, ``blocks`` (residual, each ``(batch, seq, dim) ->`` the
    same), and a head to the vocabulary: the shape of a language model, for the
    tensor-parallel tests, whose blocks differ."""

    def __init__(self, vocab: int, dim: int, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class GPTBlock(nn.Module):
    """A GPT block: causal self-attention and an MLP, each residual after a
    LayerNorm. ``checkpoint_mlp`` recomputes the MLP in backward (torch's
    non-reentrant ``checkpoint`` inside the block's forward). No bias on the
    query/key/value projection: the key bias gets no gradient in exact
    arithmetic, only rounding noise."""

    def __init__(self, dim: int, heads: int, checkpoint_mlp: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.checkpoint_mlp = checkpoint_mlp
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        if self.checkpoint_mlp:
            return x + checkpoint(self.mlp, x, use_reentrant=False)
        return x + self.mlp(x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.ln2(x))))

    def init_weights(self, std: float = 0.02) -> None:
        """torchtitan's scheme: truncated normal weights, zero biases, unit norms."""
        for linear in (self.qkv, self.proj, self.up, self.down):
            nn.init.trunc_normal_(linear.weight, std=std)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.ln1.reset_parameters()
        self.ln2.reset_parameters()


class GPT(TinyLM):
    """:class:`TinyLM` with ``depth`` :class:`GPTBlock` s and ``init_weights()``,
    the initialisation to run after ``to_empty`` on a model built on the meta
    device (torchtitan's recipe)."""

    def __init__(self, vocab: int = 64, dim: int = 32, depth: int = 2, heads: int = 2,
                 checkpoint_mlp: bool = False) -> None:
        super().__init__(vocab, dim, [GPTBlock(dim, heads, checkpoint_mlp) for _ in range(depth)])

    def init_weights(self) -> None:
        nn.init.normal_(self.emb.weight)
        for block in self.blocks:
            block.init_weights()  # type: ignore[operator]
        nn.init.trunc_normal_(self.head.weight, std=self.head.in_features ** -0.5)
        nn.init.zeros_(self.head.bias)


MODELS = {
    "mlp": MLP,
    # Wide enough (160 x 160 = 25600 elements) that DDP copies the middle weight
    # into its bucket on its own, while the small tensors are copied in batches.
    "wide": lambda: MLP(width=160),
    "wide_reentrant": lambda: MLP(width=160, ckpt="reentrant"),
    "wide_nonreentrant": lambda: MLP(width=160, ckpt="nonreentrant"),
    "tied": Tied,
    "frozen": Frozen,
    "never_used": NeverUsed,
    "switching": Switching,
    "two_dtypes": TwoDtypes,
    "batchnorm": WithBatchNorm,
    "encoder": Encoder,
}


def make_model(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()
