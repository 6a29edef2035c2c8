"""Data parallelism over ``mesh["dp"]`` of a model that torch's tensor
parallelism shards over ``mesh["tp"]`` (Note [tensor-parallel parameters] in
tandem/dtensor.py, Note [2-D parameters] in tandem/fsdp/tensor_parallel.py).

One spawned group of 4 ranks as a 2 x 2 mesh (dp, tp) runs every case: a small
transformer whose attention and MLP are Colwise/Rowwise parallel, wrapped in
tandem's DDP or fully_shard over ``mesh["dp"]``, trains for a few steps; every
parameter, reassembled with ``full_tensor()``, is compared with one process
training the same model on the global batch, and the mean of the data-parallel
ranks' losses with the single process's loss. A bf16 mixed-precision policy,
which one fp32 process cannot match, is compared with torch's own fully_shard
on the same 2-D mesh instead.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ContextManager

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_fsdp import fully_shard_of
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tandem
from tandem.testing import as_fsdp, run_distributed
from tandem.testing.models import TinyLM

D, HEADS, VOCAB, STEPS = 16, 4, 32, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(D)
        self.q, self.v, self.o = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        # No key bias: its exact gradient is zero (softmax ignores a constant), so
        # Adam would amplify rounding noise of either run into a full step.
        self.k = nn.Linear(D, D, bias=False)
        self.norm2 = nn.LayerNorm(D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        # Shapes from the projections, not from x: under sequence parallelism x
        # holds this rank's part of the sequence, and each rank HEADS / tp heads.
        q, k, v = (m(h) for m in (self.q, self.k, self.v))
        b, t = q.shape[:2]
        q, k, v = (y.view(b, t, -1, D // HEADS).transpose(1, 2) for y in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Net(TinyLM):
    def __init__(self) -> None:
        super().__init__(VOCAB, D, [Block(), Block()])


def _parallelize(model: Net, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> Net:
    """Attention and MLP column/row-wise over ``tp_mesh``. With
    ``sequence_parallel`` (as torchtitan does it), the residual stream between
    them is split along the sequence, the LayerNorms run on that split (their
    weights' gradients are then partial sums over the sequence shards: Note
    [tensor-parallel parameters]), and the embedding and head are parallel too."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, \
        parallelize_module

    if not sequence_parallel:
        plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
                "up": ColwiseParallel(), "down": RowwiseParallel()}
    else:
        seq = Shard(1)
        plan = {"norm1": SequenceParallel(), "norm2": SequenceParallel(),
                "q": ColwiseParallel(input_layouts=seq), "k": ColwiseParallel(input_layouts=seq),
                "v": ColwiseParallel(input_layouts=seq), "o": RowwiseParallel(output_layouts=seq),
                "up": ColwiseParallel(input_layouts=seq), "down": RowwiseParallel(output_layouts=seq)}
        parallelize_module(model, tp_mesh, {
            "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())})
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)
    return model


def _batch(step: int, n: int = 8, t: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, VOCAB, (n, t + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)  # type: ignore[arg-type]


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():  # DTensor says two gathers are "suboptimal"
        warnings.simplefilter("ignore")
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in model.named_parameters()}


def _fit(model: nn.Module, opt: torch.optim.Optimizer, part: Callable[[torch.Tensor], torch.Tensor],
         accumulate: int, sync: Callable[[bool], ContextManager[object]]) -> list[float]:
    """STEPS optimizer steps on ``part`` of each global batch, in ``accumulate``
    micro-batches (``sync(last)`` around each); the per-step losses."""
    losses = []
    for step in range(STEPS):
        x, y = (part(t) for t in _batch(step))
        total = 0.0
        for k, (xs, ys) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
            with sync(k == accumulate - 1):
                loss = _loss(model, xs, ys) / accumulate
                loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _local(accumulate: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the global batch (in ``accumulate`` micro-batches)."""
    torch.manual_seed(0)
    model = Net()
    losses = _fit(model, _optimizer(model.parameters()), lambda t: t, accumulate,
                  lambda last: contextlib.nullcontext())
    return _full(model), losses


@contextlib.contextmanager
def _solo_bytes(value: int) -> Iterator[None]:
    """Plan solo buckets, reduced in place on param.grad, for these small weights."""
    from tandem.ddp import plan
    saved = plan.SOLO_BYTES
    plan.SOLO_BYTES = value
    try:
        yield
    finally:
        plan.SOLO_BYTES = saved


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (wrapper, options)
    "ddp": ("ddp", {}),
    "ddp_bucket_view": ("ddp", {"gradient_as_bucket_view": True}),
    "ddp_one_param_buckets_in_place": ("ddp", {"bucket_cap_mb": 1e-6, "solo": True}),
    "ddp_fused_optimizer": ("ddp", {"fused": True}),
    "ddp_no_sync_accumulation": ("ddp", {"accumulate": 2}),
    "ddp_check_finite_find_unused": ("ddp", {"check_finite": "raise", "find_unused_parameters": True}),
    "ddp_sequence_parallel": ("ddp", {"sequence_parallel": True}),
    "fully_shard": ("fsdp", {}),
    "fully_shard_unit_per_block": ("fsdp", {"min_unit_bytes": 0}),
    "fully_shard_no_reshard_accumulation": ("fsdp", {"min_unit_bytes": 0, "reshard_after_forward": False,
                                                     "accumulate": 2}),
    "fully_shard_sequence_parallel": ("fsdp", {"min_unit_bytes": 0, "sequence_parallel": True}),
}


def _train(rank: int, mesh: DeviceMesh, wrapper: str, options: dict) -> tuple[dict[str, torch.Tensor], list[float]]:
    options = dict(options)
    accumulate = options.pop("accumulate", 1)
    fused = options.pop("fused", False)
    solo = options.pop("solo", False)
    torch.manual_seed(0)
    model = _parallelize(Net(), mesh["tp"], options.pop("sequence_parallel", False))
    wrapped: nn.Module
    if wrapper == "ddp":
        planning: ContextManager[object] = _solo_bytes(1) if solo else contextlib.nullcontext()
        with planning:
            wrapped = tandem.DistributedDataParallel(model, device_mesh=mesh["dp"], **options)
    else:
        for block in model.blocks:
            tandem.fully_shard(block, mesh=mesh["dp"], **options)
        wrapped = tandem.fully_shard(model, mesh=mesh["dp"], **options)
    opt = _optimizer(wrapped.parameters())
    if fused:
        assert isinstance(wrapped, tandem.DistributedDataParallel)
        wrapped.fuse_optimizer(opt)
    dp = mesh["dp"].get_local_rank()

    def sync(last: bool) -> ContextManager[object]:
        if isinstance(wrapped, tandem.DistributedDataParallel):
            return contextlib.nullcontext() if last else wrapped.no_sync()
        as_fsdp(wrapped).set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    losses = _fit(wrapped, opt, lambda t: t.chunk(2)[dp], accumulate, sync)
    return _full(model), losses


def _train_mixed_precision(mesh: DeviceMesh, impl: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """fully_shard (tandem's or torch's) over ``mesh["dp"]`` with bf16 compute
    and fp32 reduction, a unit per block."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = _parallelize(Net(), mesh["tp"])
    shard = fully_shard_of(impl, min_unit_bytes=0)
    options = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    with warnings.catch_warnings():  # torch's: "returned a view tensor" of the head's output
        warnings.simplefilter("ignore")
        for block in model.blocks:
            shard(block, mesh=mesh["dp"], **options)
        shard(model, mesh=mesh["dp"], **options)
        dp = mesh["dp"].get_local_rank()
        losses = _fit(model, _optimizer(model.parameters()), lambda t: t.chunk(2)[dp], 1,
                      lambda last: contextlib.nullcontext())
    return _full(model), losses


def _errors(rank: int, mesh: DeviceMesh) -> dict[str, str]:
    """What a wrong data-parallel group and ZeRO say, on every rank."""
    out = {}
    model = _parallelize(Net(), mesh["tp"])
    wrong: dict[str, dict[str, Any]] = {"whole_world": {}, "zero": {"device_mesh": mesh["dp"], "zero_stage": 1}}
    for name, kwargs in wrong.items():
        try:
            tandem.DistributedDataParallel(model, **kwargs)
        except ValueError as e:
            out[name] = str(e)
    return out


def _worker(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    results = {name: _train(rank, mesh, wrapper, options) for name, (wrapper, options) in CASES.items()}
    mixed = {impl: _train_mixed_precision(mesh, impl) for impl in ("tandem", "torch")}
    # A full (single-process) state dict loads into the 2-D sharded model.
    torch.manual_seed(1)
    source = Net()
    torch.manual_seed(0)
    model = _parallelize(Net(), mesh["tp"])
    for block in model.blocks:
        tandem.fully_shard(block, mesh=mesh["dp"], min_unit_bytes=0)
    tandem.fully_shard(model, mesh=mesh["dp"])
    tandem.fsdp.load_full_state_dict(model, source.state_dict())
    loaded = _full(model)
    dist.barrier()
    return {"cases": results, "mixed": mixed, "loaded": loaded, "source": _full(source), "errors": _errors(rank, mesh)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, world_size=4, timeout=240)


@pytest.mark.parametrize("case", list(CASES))
def test_equal_to_one_process_on_the_global_batch(results: list[dict], case: str) -> None:
    ref, ref_losses = _local(CASES[case][1].get("accumulate", 1))
    for rank, r in enumerate(results):
        params, _ = r["cases"][case]
        assert params.keys() == ref.keys()
        diff = max((params[k] - ref[k]).abs().max().item() for k in ref)
        assert diff <= 1e-5, f"rank {rank}: {case} differs from one process by {diff}"
    # Ranks 0 and 1 are dp index 0, ranks 2 and 3 dp index 1: their mean is the global loss.
    mean = [(a + b) / 2 for a, b in zip(results[0]["cases"][case][1], results[2]["cases"][case][1])]
    assert mean == pytest.approx(ref_losses, abs=1e-5)
    assert results[0]["cases"][case][1] == results[1]["cases"][case][1]  # tp peers see one loss


def test_a_bf16_policy_equals_torchs_fully_shard_on_the_same_mesh(results: list[dict]) -> None:
    fp32, _ = _local(1)
    for rank, r in enumerate(results):
        (ours, our_losses), (theirs, their_losses) = r["mixed"]["tandem"], r["mixed"]["torch"]
        assert ours.keys() == theirs.keys() == fp32.keys()
        gap_to_torch = max((ours[k] - theirs[k]).abs().max().item() for k in ours)
        gap_to_fp32 = max((ours[k] - fp32[k]).abs().max().item() for k in ours)
        assert gap_to_torch <= 1e-5, f"rank {rank}: {gap_to_torch}"
        assert our_losses == pytest.approx(their_losses, abs=1e-5)
        # The policy took effect: bf16 compute moved the weights away from fp32 training.
        assert gap_to_fp32 > 1e-3, f"rank {rank}: {gap_to_fp32}"
        assert all(v.dtype == torch.float32 for v in ours.values())  # the shards stay fp32


def test_a_full_state_dict_loads_into_the_2d_sharded_model(results: list[dict]) -> None:
    for r in results:
        assert r["loaded"].keys() == r["source"].keys()
        for k, v in r["source"].items():
            assert torch.equal(r["loaded"][k], v), k


def test_wrong_group_and_zero_are_refused_on_every_rank(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        errors = r["errors"]
        assert "sharded by tensor parallelism" in errors["whole_world"]
        assert f"rank {rank}" in errors["whole_world"] and "device_mesh=mesh['dp']" in errors["whole_world"]
        assert "zero_stage=1" in errors["zero"] and "fully_shard" in errors["zero"]
