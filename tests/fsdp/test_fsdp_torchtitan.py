"""torchtitan's FSDP recipe, bit for bit against torch's FSDP2: a small Llama
trained for 20 steps the way torchtitan trains one, with tandem's fully_shard
and with torch's.

torchtitan's ``apply_fsdp`` (torchtitan/models/llama3/infra/parallelize.py)
makes one unit of the token embedding, one of each transformer block, one of
the final norm and the output layer together (``fully_shard([model.norm,
model.output])``, which keeps its parameters after forward: its backward
comes at once), then the root; earlier versions kept the last block after
forward too (``reshard_after_forward = layer_id < n_layers - 1``), and so
does this test. Parameters are gathered in bf16 and gradients reduced in fp32
(``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``),
AdamW steps with weight decay after the gradients are clipped by their global
norm.

The loss is chunked, as a large vocabulary makes one: the body runs once,
then the norm and output layer run over 8 chunks of the sequence, each
chunk's loss backward on its own with the output unit's gradient sync off on
all but the last (its gradients accumulate unsharded, in fp32), then the
body's backward with the accumulated gradient of the hidden state. This is
the path where an implementation can go wrong quietly: a unit used in 8
backwards and reduced once, between a forward and a backward of the root.

One spawned group of 2 gloo ranks trains the model with both
implementations, each rank on its half of every global batch. A sum of two
values does not depend on their order, so the per-step losses, the gradient
norms and the final parameters must be equal exactly. The same run reducing
in bf16 ends with other parameters: the comparison can tell.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from test_fsdp import fully_shard_of
from tandem.fsdp import MixedPrecisionPolicy
from tandem.testing import as_dtensor, as_fsdp, first_difference, run_distributed

WORLD, STEPS, CHUNKS = 2, 20, 8
VOCAB, DIM, HEADS, KV_HEADS, HIDDEN, LAYERS = 61, 32, 4, 2, 96, 2
BATCH, SEQ = 4, 16                       # the global batch; each rank trains on BATCH // WORLD sequences
HEAD_DIM = DIM // HEADS


def _rope(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (batch, seq, heads, head_dim), in fp32 as torchtitan's
    (consecutive pairs of features rotated together, its complex multiply)."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = _rotate(self.wq(x).view(b, s, HEADS, HEAD_DIM), cos, sin)
        k = _rotate(self.wk(x).view(b, s, KV_HEADS, HEAD_DIM), cos, sin)
        v = self.wv(x).view(b, s, KV_HEADS, HEAD_DIM)
        # grouped-query attention: each key/value head serves HEADS // KV_HEADS query heads
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """torchtitan's Llama, names included. ``forward`` is the body; the loss
    runs ``head`` (the final norm and the output layer) per chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        cos, sin = _rope(SEQ)
        # not persistent: the state dict holds only the (sharded) parameters
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h, self.rope_cos, self.rope_sin)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(h))


def _build(impl: str, reduce_dtype: torch.dtype | None) -> tuple[Transformer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Transformer()
    # tandem would merge units this small into the root; torch keeps every unit it is given
    shard = fully_shard_of(impl, min_unit_bytes=0)
    config = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)}
    shard(model.tok_embeddings, reshard_after_forward=True, **config)
    for i, block in model.layers.items():
        shard(block, reshard_after_forward=int(i) < LAYERS - 1, **config)
    shard([model.norm, model.output], reshard_after_forward=False, **config)
    shard(model, **config)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


_SUCCESSOR = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of sequences in which each token has one fixed successor
    (something to learn, so that the losses fall and the later steps' gradients
    are not noise); the targets are the next tokens."""
    seq = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=torch.Generator().manual_seed(step))
    for i in range(SEQ):
        seq[:, i + 1] = _SUCCESSOR[seq[:, i]]
    return seq[:, :-1], seq[:, 1:]


def _chunked_loss(model: Transformer, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Backward of the whole local batch; returns its loss (a mean over the
    local tokens, so that FSDP's average over ranks is the global mean)."""
    h = model(tokens)
    hd = h.detach().requires_grad_()
    total = torch.zeros(())
    for i, (hc, yc) in enumerate(zip(hd.chunk(CHUNKS, dim=1), target.chunk(CHUNKS, dim=1))):
        as_fsdp(model.output).set_requires_gradient_sync(i == CHUNKS - 1)
        part = F.cross_entropy(model.head(hc).float().reshape(-1, VOCAB), yc.reshape(-1), reduction="sum")
        part = part / target.numel()
        part.backward()
        total += part.detach()
    h.backward(hd.grad)
    return total


def _train(rank: int, impl: str, reduce_dtype: torch.dtype | None) -> dict:
    model, opt = _build(impl, reduce_dtype)
    n = BATCH // WORLD
    losses, norms = [], []
    for step in range(STEPS):
        tokens, target = _batch(step)
        loss = _chunked_loss(model, tokens[rank * n:(rank + 1) * n], target[rank * n:(rank + 1) * n])
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss)
        losses.append(loss.item() / WORLD)
        norms.append(as_dtensor(norm).full_tensor().item())   # a replicated DTensor: the global norm, on every rank
    params = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "params": params}


def _worker(rank: int, world_size: int) -> dict:
    out = {impl: _train(rank, impl, torch.float32) for impl in ("tandem", "torch")}
    out["torch_bf16_reduce"] = _train(rank, "torch", None)
    return out if rank == 0 else {}


@functools.cache
def _results() -> dict:
    return run_distributed(_worker, WORLD, timeout=240)[0]


def test_losses_equal_torchs_bit_for_bit() -> None:
    ours, theirs = _results()["tandem"]["losses"], _results()["torch"]["losses"]
    assert ours == theirs, [(step, a, b) for step, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    assert theirs[-1] < theirs[0] / 2, theirs   # it learns: 20 steps of equal numbers that mean something


def test_gradient_norms_equal_torchs_bit_for_bit() -> None:
    ours, theirs = _results()["tandem"]["norms"], _results()["torch"]["norms"]
    assert ours == theirs, [(step, a, b) for step, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    assert min(theirs) < 1.0 < max(theirs), theirs   # clipping scaled some steps' gradients, not all


def test_final_parameters_equal_torchs_bit_for_bit() -> None:
    ours, theirs = _results()["tandem"]["params"], _results()["torch"]["params"]
    assert len(theirs) == 3 + 9 * LAYERS, sorted(theirs)
    assert not first_difference(ours, theirs), first_difference(ours, theirs)


def test_a_bf16_reduce_ends_elsewhere() -> None:
    """Not a vacuous comparison: reducing the gradients in bf16 instead of fp32
    changes the final parameters."""
    results = _results()
    assert first_difference(results["torch"]["params"], results["torch_bf16_reduce"]["params"])
