"""fully_shard's precision, bit for bit against torch's FSDP2: where gradients
are computed, accumulated and reduced under every ``MixedPrecisionPolicy``.

torch's ``MixedPrecisionPolicy`` says that while gradient sync is off
(``set_requires_gradient_sync(False)``: micro-batches, a chunked loss), FSDP
accumulates the unsharded gradients in ``reduce_dtype``, not in
``param_dtype``. Accumulating bf16 gradients in bf16 loses about 0.5% of the
sum over 8 micro-batches, silently.

One spawned group of 4 gloo ranks trains every case of the matrix with
tandem's fully_shard and with torch's, on a 1-D mesh of 2 ranks (each row of
a (2, 2) mesh, two independent jobs) or on the (2, 2) mesh itself (HSDP);
losses and final parameters must be equal bit for bit. A sum of two values
does not depend on their order, so every reduction of these meshes is exact
to compare. In a shard group of 4, gloo's reduce-scatter adds the first few
elements of a rank's chunk in an order that depends on the chunk's length,
and tandem's chunk is one element per parameter longer than torch's (Note
[gradient flags] in tandem/fsdp/unit.py): the one case that needs 4
ranks in a shard group, ``reshard_after_forward=2``, is compared within
float32 rounding instead. A single
Linear over 8 micro-batches is also compared with a reference computed here
by hand: each micro-batch's bf16 gradient cast to fp32 and summed in fp32
(what the policy promises), which a bf16 sum misses.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from test_fsdp import fully_shard_of
from tandem.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from tandem.testing import as_dtensor, as_fsdp, first_difference, grad_of, max_abs_diff, run_distributed

WORLD, V, D, BATCH, SEQ, STEPS = 4, 23, 16, 8, 8, 2
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """The head is called by the loss (a chunked loss runs it per chunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.layers:
            h = block(h)
        return self.norm(h)


@dataclass(frozen=True)
class Case:
    param: torch.dtype | None = None     # MixedPrecisionPolicy.param_dtype
    reduce: torch.dtype | None = None    # MixedPrecisionPolicy.reduce_dtype
    output: torch.dtype | None = None    # MixedPrecisionPolicy.output_dtype (of the head's unit)
    micro: int = 1                       # micro-batches, gradient sync off on all but the last
    reshard: bool | int = True           # reshard_after_forward
    mesh: str = "pair"                   # "pair": 1-D over 2 ranks; "hsdp": (2, 2); "four": 1-D over 4
    partial: bool = False                # HSDP: set_requires_all_reduce(False) instead of sync off
    offload: bool = False                # CPUOffloadPolicy
    chunks: int = 0                      # a chunked loss: the head per chunk, sync off on all but the last


_POLICIES = {"fp32": (None, None, None), "bf16_fp32": (BF16, FP32, None), "bf16": (BF16, None, None),
             "fp32_bf16": (None, BF16, None), "bf16_fp32_out32": (BF16, FP32, FP32), "fp16_fp32": (FP16, FP32, None)}
CASES = {f"{name}_micro{m}": Case(p, r, o, micro=m) for name, (p, r, o) in _POLICIES.items() for m in (1, 4)}
CASES.update({
    "bf16_fp32_no_reshard": Case(BF16, FP32, micro=4, reshard=False),
    "bf16_fp32_reshard_2": Case(BF16, FP32, micro=4, reshard=2, mesh="four"),
    "bf16_fp32_offload": Case(BF16, FP32, micro=4, offload=True),
    "bf16_fp32_hsdp": Case(BF16, FP32, micro=4, mesh="hsdp"),
    "bf16_fp32_hsdp_partial": Case(BF16, FP32, micro=4, mesh="hsdp", partial=True),
    "bf16_hsdp_partial": Case(BF16, None, micro=4, mesh="hsdp", partial=True),
    "bf16_fp32_chunked": Case(BF16, FP32, chunks=4),
    "bf16_fp32_chunked_micro": Case(BF16, FP32, micro=2, chunks=4, reshard=False),
})


@functools.cache
def _mesh(kind: str) -> Any:
    """One mesh of each kind per rank, shared by the cases: a mesh's process
    groups cost a rendezvous each, and a mesh holds no state of a model."""
    from torch.distributed.device_mesh import init_device_mesh
    if kind == "four":
        return init_device_mesh("cpu", (WORLD,))
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, V, (BATCH, SEQ), generator=g), torch.randint(0, V, (BATCH, SEQ), generator=g)


def _build(impl: str, case: Case) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    mesh = _mesh("four" if case.mesh == "four" else "hsdp")
    if case.mesh == "pair":
        mesh = mesh["shard"]
    shard = fully_shard_of(impl, min_unit_bytes=0)
    kwargs: dict[str, Any] = {}
    kwargs.update(mesh=mesh, reshard_after_forward=case.reshard,
                  mp_policy=MixedPrecisionPolicy(param_dtype=case.param, reduce_dtype=case.reduce))
    if case.offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for block in model.layers:
        shard(block, **kwargs)
    # output_dtype on the head only: the logits in fp32 (on a block, the next unit's bf16 norm would refuse them)
    head_policy = MixedPrecisionPolicy(param_dtype=case.param, reduce_dtype=case.reduce, output_dtype=case.output)
    shard([model.norm, model.head] if case.chunks else model.head, **{**kwargs, "mp_policy": head_policy})
    shard(model, **kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _micro_loss(model: Net, case: Case, tokens: torch.Tensor, target: torch.Tensor, last: bool) -> torch.Tensor:
    """Backward of one micro-batch; returns its loss. A chunked loss runs the
    body once, then the head per chunk in its own backward (gradient sync of
    the head off on all but the last), then the body's backward."""
    if not case.chunks:
        loss = F.cross_entropy(model.head(model(tokens)).float().reshape(-1, V), target.reshape(-1)) / case.micro
        loss.backward()
        return loss.detach()
    h = model(tokens)
    hd = h.detach().requires_grad_()
    total = torch.zeros(())
    for i, (hc, yc) in enumerate(zip(hd.chunk(case.chunks, dim=1), target.chunk(case.chunks, dim=1))):
        as_fsdp(model.head).set_requires_gradient_sync(last and i == case.chunks - 1)
        part = F.cross_entropy(model.head(hc).float().reshape(-1, V), yc.reshape(-1), reduction="sum")
        part = part / (target.numel() * case.micro)
        part.backward()
        total += part.detach()
    as_fsdp(model.head).set_requires_gradient_sync(last)
    h.backward(hd.grad)
    return total


def _train(rank: int, impl: str, case: Case) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, opt = _build(impl, case)
    n = BATCH // WORLD
    losses = []
    for step in range(STEPS):
        total = torch.zeros(())
        for m in range(case.micro):
            last = m == case.micro - 1
            if case.partial:
                as_fsdp(model).set_requires_all_reduce(last)
            elif not case.chunks:
                as_fsdp(model).set_requires_gradient_sync(last)
            else:
                for unit_root in (model, *model.layers):
                    unit_root.set_requires_gradient_sync(last, recurse=False)
            tokens, target = _batch(step, m)
            total += _micro_loss(model, case, tokens[rank * n:(rank + 1) * n], target[rank * n:(rank + 1) * n], last)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses, {k: v.full_tensor() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------- one Linear, by hand

MICRO_LINEAR = 8


def _linear_data(rank: int, m: int) -> torch.Tensor:
    return torch.randn(4, 64, generator=torch.Generator().manual_seed(10 * rank + m))


def _one_linear(rank: int) -> dict[str, torch.Tensor]:
    """The gradient of one Linear (bf16 parameters, fp32 reduce) sharded over a
    pair of ranks, after 8 micro-batches with sync off on all but the last, as
    tandem and torch compute it."""
    out = {}
    for impl in ("tandem", "torch"):
        pair = _mesh("hsdp")["shard"]
        torch.manual_seed(0)
        lin = nn.Linear(64, 64, bias=False)
        shard = fully_shard_of(impl, min_unit_bytes=0)
        shard(lin, mesh=pair, mp_policy=MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32))
        for m in range(MICRO_LINEAR):
            as_fsdp(lin).set_requires_gradient_sync(m == MICRO_LINEAR - 1)
            lin(_linear_data(rank, m)).float().pow(2).sum().backward()
        out[impl] = as_dtensor(lin.weight.grad).full_tensor()
    return out


def _linear_references() -> dict[str, torch.Tensor]:
    """By hand, in one process: each rank's bf16 gradients summed in fp32 (the
    policy) or in bf16 (the bug), then averaged over ranks 0 and 1 (rank 0's
    shard group)."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 64, bias=False).to(BF16)   # plain autograd, one micro-batch at a time
    sums: dict[str, list[torch.Tensor]] = {"fp32": [], "bf16": []}
    for rank in range(2):
        acc32, acc16 = torch.zeros(64, 64, dtype=FP32), torch.zeros(64, 64, dtype=BF16)
        for m in range(MICRO_LINEAR):
            lin.weight.grad = None
            lin(_linear_data(rank, m).to(BF16)).float().pow(2).sum().backward()
            acc32 += grad_of(lin.weight).float()
            acc16 += grad_of(lin.weight)
        sums["fp32"].append(acc32)
        sums["bf16"].append(acc16.float())
    return {k: (v[0] + v[1]) / 2 for k, v in sums.items()}


# ---------------------------------------------------------------------- the group

def _worker(rank: int, world_size: int) -> dict:
    out: dict = {"linear": _one_linear(rank), "cases": {}}
    for name, case in CASES.items():
        out["cases"][name] = {impl: _train(rank, impl, case) for impl in ("tandem", "torch")}
    return out if rank == 0 else {}


@functools.cache
def _results() -> dict:
    return run_distributed(_worker, WORLD, timeout=400)[0]


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.mesh != "four"])
def test_equal_to_torchs_fsdp2_bit_for_bit(name: str) -> None:
    (ours, our_params), (theirs, their_params) = (_results()["cases"][name][impl] for impl in ("tandem", "torch"))
    assert ours == theirs, (ours, theirs)
    assert not first_difference(our_params, their_params), first_difference(our_params, their_params)


def test_a_shard_group_of_four_equals_torch_within_rounding() -> None:
    (ours, our_params), (theirs, their_params) = (_results()["cases"]["bf16_fp32_reshard_2"][impl]
                                                  for impl in ("tandem", "torch"))
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-6, (ours, theirs)
    assert max_abs_diff(our_params, their_params) <= 1e-6


def test_unsynced_gradients_accumulate_in_reduce_dtype() -> None:
    got = _results()["linear"]
    ref = _linear_references()
    # The two references differ: the test can tell one accumulation from the other.
    assert (ref["fp32"] - ref["bf16"]).abs().max() > 1e-3 * ref["fp32"].abs().max()
    assert torch.equal(got["torch"], ref["fp32"]), (got["torch"] - ref["fp32"]).abs().max()
    assert torch.equal(got["tandem"], ref["fp32"]), (got["tandem"] - ref["fp32"]).abs().max()


def test_the_matrix_tells_the_accumulation_dtypes_apart() -> None:
    """Not a vacuous matrix: accumulating in bf16 or fp32 gives other parameters."""
    cases = _results()["cases"]
    assert first_difference(cases["bf16_fp32_micro4"]["torch"][1], cases["bf16_micro4"]["torch"][1])
    assert first_difference(cases["bf16_fp32_micro4"]["torch"][1], cases["fp32_micro4"]["torch"][1])
