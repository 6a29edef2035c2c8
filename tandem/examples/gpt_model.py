"""The model of the GPT example (tandem/examples/gpt.py): a small decoder-only
transformer in nanoGPT's shape, with the two things a sharded model needs from
its own code: an ``init_weights()`` that gives values to parameters created on
the meta device, and activation checkpointing per block.

# Note [initial values at any world size]
The model is built on the meta device, sharded, given memory with
``to_empty`` and only then initialised, so its initialisation must write into
parameters that are DTensors, each rank holding a slice of every parameter.
Drawing each rank's slice from its own random generator would make the
initial model depend on the number of ranks (DTensor's random ops keep slices
of one draw apart on CUDA only). ``init_weights`` therefore draws every
parameter's full value on the CPU, one parameter at a time, from one seeded
generator in the order of ``named_parameters()`` (which ``fully_shard`` does
not change), and each rank keeps its own slice of it: the initial model is the
same at every world size, sharded or not. The full tensor of the largest
parameter is the only extra memory; a model whose single parameters do not fit
on one host would initialise slices with a counter-based generator instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tandem._compat import dtensor_api

__all__ = ["GPT", "GPTConfig", "generate"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The shape of a :class:`GPT`."""

    vocab_size: int
    """Distinct tokens (characters, here)."""
    block_size: int = 128
    """The longest context the model sees (learned position embeddings)."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout after attention, the MLP and the embeddings (0: none)."""
    activation_checkpointing: bool = True
    """Keep only each block's input in training and recompute the rest in backward."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm attention and MLP. With activation checkpointing, training keeps
    only the block's input: the block's backward first runs its forward again.
    The checkpoint sits inside ``forward``, so ``fully_shard(block)`` gathers
    the parameters once for forward, and the recomputation in backward finds
    them gathered again by the unit's pre-backward gather (as with torchtitan's
    ``checkpoint_wrapper`` applied before ``fully_shard``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.checkpointed = cfg.activation_checkpointing
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed and self.training and torch.is_grad_enabled():
            # Non-reentrant: works with inputs that need no grad, keeps the RNG
            # state (dropout) and the autocast state for the recomputation.
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks, a final norm and a
    linear head (not tied to the embedding: each stays in the root unit).
    ``forward(idx)`` maps token ids ``(B, T)`` to logits ``(B, T, vocab_size)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"a sequence of {T} tokens is longer than block_size={self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Give every parameter its initial value, also after ``to_empty`` on a
        sharded model, the same at every world size (Note [initial values at
        any world size]): nanoGPT's scheme, normal(0, 0.02) weights, residual
        projections scaled down by sqrt(2 * n_layer), zero biases, unit norms."""
        generator = torch.Generator().manual_seed(seed)
        for module_name, module in self.named_modules():  # named_parameters()' order
            for leaf, param in module.named_parameters(recurse=False):
                value = self._initial_value(module_name, module, leaf, param.shape, generator)
                param_assign(param, value)

    def _initial_value(self, module_name: str, module: nn.Module, leaf: str, shape: torch.Size,
                       generator: torch.Generator) -> torch.Tensor:
        if isinstance(module, nn.LayerNorm):
            return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
        if leaf == "bias":
            return torch.zeros(shape)
        std = 0.02
        if module_name.endswith(".proj"):  # the writes into the residual stream
            std /= math.sqrt(2 * self.cfg.n_layer)
        return torch.empty(shape).normal_(0.0, std, generator=generator)


def param_assign(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` into ``param``; a DTensor ``param`` keeps only its own slice."""
    DTensor, _, _ = dtensor_api()
    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        from torch.distributed.tensor import distribute_tensor
        # src_data_rank=None: every rank holds ``full`` already; cut, do not scatter.
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, new_tokens: int, *, block_size: int,
             temperature: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Extend ``prompt`` ``(1, T)`` by ``new_tokens`` tokens, each drawn from the
    model's next-token distribution at ``temperature``. On a sharded model it is
    a collective: every rank calls it (the forward gathers parameters), with a
    generator seeded alike, and every rank draws the same text."""
    was_training = model.training
    model.eval()
    idx = prompt
    for _ in range(new_tokens):
        logits = model(idx[:, -block_size:])[:, -1, :].float()
        probs = F.softmax(logits / temperature, dim=-1)
        nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)
        idx = torch.cat([idx, nxt], dim=1)
    model.train(was_training)
    return idx
