"""The GPU lane: tandem on CUDA, equal to torch on the same GPU.

CI has no GPU: every test here skips there. On a machine with one GPU, run the
lane with ``python -m pytest tests/gpu/test_cuda.py`` (docs/development.md):

* a world of one on NCCL: DDP (one bucket and many), ZeRO-1 and ZeRO-2, and
  fully_shard (fp32 and bf16 parameters) each equal to torch's DDP,
  ZeroRedundancyOptimizer and FSDP2 on the same model and batches; bf16
  autocast and fp16 with a GradScaler equal to torch's DDP under the same;
* no host synchronisation in a DDP, ZeRO-1/2 or fully_shard step
  (``torch.cuda.set_sync_debug_mode``: every synchronisation after warm-up is
  recorded with its stack, and there must be none), and a missing gradient
  still reported, at the end of the next backward (Note [late flag] in tandem/ddp/late_flag.py);
* two and four ranks sharing the GPU over gloo with CUDA tensors: DDP equal to
  torch's DDP there; ZeRO-2 and fully_shard equal to one process on the global
  batch (gloo takes CUDA tensors for every collective they issue; torch 2.11's
  DTensor.full_tensor() over gloo on CUDA crashed the process, so the shards
  are gathered with all_gather_object);
* DataParallel on the GPU, equal to the bare module;
* the main job under ``tandem run --nproc-per-node gpu``.

Cases run in one spawned group per world size (tandem.testing.run_cases).
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem
from tandem.testing import Case, grad_of, run_cases, run_distributed
from tandem.testing.models import TinyLM

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

TOL = 1e-6       # as the CPU tests of DDP and ZeRO
FSDP_TOL = 1e-5  # as tests/fsdp/test_fsdp.py
AMP_TOL = 1e-5   # mixed precision: the same kernels, compared in fp32
D, V, SEQ, BATCH = 32, 53, 8, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Net(TinyLM):
    def __init__(self, depth: int = 3) -> None:
        super().__init__(V, D, [Block() for _ in range(depth)])


class WithUnused(Net):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(D, D)


def _cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _net(device: torch.device | None = None) -> Net:
    torch.manual_seed(0)
    return Net().to(device or _cuda())


def _batch(step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s slice of step ``step``'s global batch, on the GPU."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, V, (BATCH * world_size, SEQ), generator=g)
    target = torch.randint(0, V, (BATCH * world_size, SEQ), generator=g)
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    return tokens[rows].to(_cuda()), target[rows].to(_cuda())


def _loss(model: nn.Module, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).float().reshape(-1, V), target.reshape(-1))


def _train(model: nn.Module, opt: Any, steps: int = 3, rank: int = 0, world_size: int = 1,
           autocast: torch.dtype | None = None, scaler: Any = None) -> list[float]:
    losses = []
    for step in range(steps):
        tokens, target = _batch(step, rank, world_size)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
            loss = _loss(model, tokens, target)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        losses.append(loss.item())
    return losses


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.removeprefix("module.")] = full.detach().float().cpu()
    return out


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ------------------------------------------------------------- a world of one on NCCL
def _reducing(ddp: Any) -> Any:
    """``ddp`` with its gradient reducer even in a world of one, which needs none
    (tandem's DDP is then the bare module): the reducer's CUDA path, with its
    NCCL all-reduce of one rank, is what a GPU machine with one GPU can check."""
    ddp._make_reducer()
    return ddp


def _ddp_vs_torch(rank: int, world_size: int, cap_mb: float) -> dict[str, Any]:
    ref = TorchDDP(_net(), device_ids=[0], bucket_cap_mb=cap_mb)
    ref_losses = _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9))
    ours = _reducing(tandem.DistributedDataParallel(_net(), device_ids=[0], bucket_cap_mb=cap_mb))
    losses = _train(ours, torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9))
    return {"diff": _diff(_params(ref), _params(ours)), "losses": (ref_losses, losses),
            "buckets": len(ours.reducer.buckets), "backend": torch.distributed.get_backend()}


class WithLarge(Net):
    """Net with a 36 MiB weight: a solo bucket on CUDA too (Note [solo buckets] in tandem/ddp/plan.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.large = nn.Linear(D, 3000 * 3000 // D, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) + 1e-3 * self.large.weight.pow(2).sum()


def _solo_vs_torch(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = TorchDDP(WithLarge().to(_cuda()), device_ids=[0])
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9))
    torch.manual_seed(0)
    ours = _reducing(tandem.DistributedDataParallel(WithLarge().to(_cuda()), device_ids=[0]))
    _train(ours, torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9))
    return {"diff": _diff(_params(ref), _params(ours)),
            "solo": [b.names for b in ours.reducer.buckets if b.spec.solo]}


def _divided_by_the_collective(rank: int, world_size: int) -> dict[str, Any]:
    """A step armed to average over 4 ranks (as join does with a divisor): on NCCL
    the factor rides in the all-reduce (Note [scaled by the collective] in
    tandem/ddp/reduction.py); each gradient must be the local one / 4, in the
    solo bucket and in the shared ones, and the flag bucket still reads clean."""
    from tandem.ddp.reduction import AllReduce

    torch.manual_seed(0)
    plain = WithLarge().to(_cuda())
    ddp = _reducing(tandem.DistributedDataParallel(copy.deepcopy(plain), device_ids=[0]))
    tokens, target = _batch(0)
    _loss(plain, tokens, target).backward()
    reducer = ddp.reducer
    grads = []
    for _ in range(2):  # the second step: buckets rebuilt in arrival order
        ddp.zero_grad(set_to_none=True)
        reducer.before_forward()
        out = ddp.module(tokens)
        reducer.arm(out, divisor=4)
        nn.functional.cross_entropy(out.float().reshape(-1, V), target.reshape(-1)).backward()
        grads.append(max((grad_of(p) - grad_of(q) / 4).abs().max().item()
                         for p, q in zip(ddp.module.parameters(), plain.parameters())))
    reduction = reducer.group.reduction
    return {"diff": max(grads), "premul": isinstance(reduction, AllReduce) and reduction._premul is not None,
            "solo": sum(b.spec.solo for b in reducer.buckets)}
def _zero_vs_torch(rank: int, world_size: int, stage: int) -> float:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from tandem.zero import ZeroOptimizer

    ref = TorchDDP(_net(), device_ids=[0])
    _train(ref, ZeroRedundancyOptimizer(ref.parameters(), optimizer_class=torch.optim.Adam, lr=0.01))
    ddp = tandem.DistributedDataParallel(_net(), device_ids=[0], zero_stage=stage, bucket_cap_mb=0.01)
    _train(ddp, ZeroOptimizer(ddp, torch.optim.Adam, lr=0.01))
    return _diff(_params(ref), _params(ddp))


def _fsdp_model(impl: str, bf16: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    import torch.distributed.fsdp as torch_fsdp

    import tandem.fsdp as tandem_fsdp

    # The two take the same arguments but for the mesh and the unit size.
    fsdp: Any = torch_fsdp if impl == "torch" else tandem_fsdp
    fully_shard = fsdp.fully_shard
    if impl == "torch":
        kwargs: dict[str, Any] = {"mesh": init_device_mesh("cuda", (torch.distributed.get_world_size(),))}
    else:
        kwargs = {"min_unit_bytes": 0}
    if bf16:
        kwargs["mp_policy"] = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _net()
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _fsdp_vs_torch(rank: int, world_size: int, bf16: bool) -> dict[str, Any]:
    out = {}
    for impl in ("torch", "tandem"):
        model = _fsdp_model(impl, bf16)
        losses = _train(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        out[impl] = (losses, _params(model))
    return {"diff": _diff(out["torch"][1], out["tandem"][1]), "losses": (out["torch"][0], out["tandem"][0])}


def _amp_vs_torch(rank: int, world_size: int, dtype: torch.dtype) -> dict[str, Any]:
    out = {}
    for impl in ("torch", "tandem"):
        wrap = TorchDDP if impl == "torch" else tandem.DistributedDataParallel
        model = wrap(_net(), device_ids=[0])
        if impl == "tandem":
            _reducing(model)
        scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
        losses = _train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), steps=4,
                        autocast=dtype, scaler=scaler)
        out[impl] = (losses, _params(model), None if scaler is None else scaler.get_scale())
    return {"diff": _diff(out["torch"][1], out["tandem"][1]),
            "losses": (out["torch"][0], out["tandem"][0]), "scales": (out["torch"][2], out["tandem"][2])}


def _syncs_in_steps(step: Any, warmup: int = 3, steps: int = 3) -> list[str]:
    """The stacks of every host synchronisation CUDA reports in ``steps`` calls
    of ``step`` after ``warmup`` (the first steps rebuild buckets: torch's DDP
    reads their order once too)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    seen: list[str] = []

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
               line: Any = None) -> None:
        if "synchroniz" in str(message):
            seen.append(f"{message}\n" + "".join(traceback.format_stack(limit=14)[:-1]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return seen


def _stepper(model: nn.Module, opt: Any) -> Any:
    tokens, target = _batch(0)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        _loss(model, tokens, target).backward()
        opt.step()
    return step


def _sync_free(rank: int, world_size: int) -> dict[str, list[str]]:
    from tandem.zero import ZeroOptimizer

    found: dict[str, list[str]] = {}
    torch_ddp = TorchDDP(_net(), device_ids=[0])
    found["torch-ddp"] = _syncs_in_steps(_stepper(torch_ddp, torch.optim.SGD(torch_ddp.parameters(), lr=0.1)))
    ddp = _reducing(tandem.DistributedDataParallel(_net(), device_ids=[0], bucket_cap_mb=0.01))
    found["ddp"] = _syncs_in_steps(_stepper(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)))
    for stage in (1, 2):
        z = tandem.DistributedDataParallel(_net(), device_ids=[0], zero_stage=stage, bucket_cap_mb=0.01)
        found[f"zero{stage}"] = _syncs_in_steps(_stepper(z, ZeroOptimizer(z, torch.optim.SGD, lr=0.1)))
    for impl in ("torch", "tandem"):
        m = _fsdp_model(impl, bf16=False)
        found[f"{impl}-fsdp"] = _syncs_in_steps(_stepper(m, torch.optim.SGD(m.parameters(), lr=0.1)))
    return found


def _missing_gradient_later(rank: int, world_size: int) -> tuple[int, str]:
    torch.manual_seed(0)
    ddp = _reducing(tandem.DistributedDataParallel(WithUnused().to(_cuda()), device_ids=[0]))
    step = _stepper(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    for k in range(2):
        try:
            step()
        except RuntimeError as e:
            return k, str(e)
    return -1, "no error"


WORLD_OF_ONE = {
    "ddp": Case(_ddp_vs_torch, args=(25.0,)),
    "ddp_many_buckets": Case(_ddp_vs_torch, args=(0.01,)),
    "ddp_solo": Case(_solo_vs_torch),
    "divided_by_the_collective": Case(_divided_by_the_collective),
    "zero1": Case(_zero_vs_torch, args=(1,)),
    "zero2": Case(_zero_vs_torch, args=(2,)),
    "fsdp": Case(_fsdp_vs_torch, args=(False,)),
    "fsdp_bf16": Case(_fsdp_vs_torch, args=(True,)),
    "bf16_autocast": Case(_amp_vs_torch, args=(torch.bfloat16,)),
    "fp16_scaler": Case(_amp_vs_torch, args=(torch.float16,)),
    "sync_free": Case(_sync_free),
    "missing_gradient": Case(_missing_gradient_later),
}


@pytest.fixture(scope="module")
def nccl1() -> Any:
    return run_cases(WORLD_OF_ONE, world_size=1, backend="nccl")


@needs_cuda
@pytest.mark.parametrize("case", ["ddp", "ddp_many_buckets"])
def test_ddp_on_nccl_equals_torch(nccl1: Any, case: str) -> None:
    (out,) = nccl1[case]
    assert out["backend"] == "nccl"
    assert out["buckets"] > 1 if case == "ddp_many_buckets" else out["buckets"] >= 1
    assert out["diff"] <= TOL, out


@needs_cuda
def test_a_parameter_over_the_cap_is_reduced_in_place_on_cuda(nccl1: Any) -> None:
    (out,) = nccl1["ddp_solo"]
    assert out["solo"] == [["large.weight"]], out
    assert out["diff"] <= TOL, out


@needs_cuda
def test_the_average_is_scaled_by_the_collective_on_nccl(nccl1: Any) -> None:
    (out,) = nccl1["divided_by_the_collective"]
    assert out["premul"] and out["solo"] == 1, out
    assert out["diff"] <= 1e-7, out


@needs_cuda
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_on_nccl_equals_torch_zero_redundancy_optimizer(nccl1: Any, stage: int) -> None:
    assert nccl1[f"zero{stage}"][0] <= TOL


@needs_cuda
@pytest.mark.parametrize("case", ["fsdp", "fsdp_bf16"])
def test_fully_shard_on_nccl_equals_fsdp2(nccl1: Any, case: str) -> None:
    (out,) = nccl1[case]
    assert out["diff"] <= FSDP_TOL, out


@needs_cuda
@pytest.mark.parametrize("case", ["bf16_autocast", "fp16_scaler"])
def test_mixed_precision_equals_torch_ddp(nccl1: Any, case: str) -> None:
    (out,) = nccl1[case]
    assert out["diff"] <= AMP_TOL, out
    assert out["scales"][0] == out["scales"][1], out


@needs_cuda
@pytest.mark.parametrize("impl", ["ddp", "zero1", "zero2", "tandem-fsdp"])
def test_no_host_synchronisation_in_a_step(nccl1: Any, impl: str) -> None:
    (found,) = nccl1["sync_free"]
    assert found[impl] == [], "\n\n".join(found[impl])


@needs_cuda
def test_a_missing_gradient_is_still_reported_on_cuda(nccl1: Any) -> None:
    ((step, message),) = nccl1["missing_gradient"]
    # Note [late flag]: the first step's flag is read at the end of the second backward.
    assert step == 1, (step, message)
    assert "previous backward" in message and "'unused.weight'" in message, message
    assert "find_unused_parameters=True" in message, message


# ------------------------------------------------ several ranks on the one GPU, over gloo
def _gloo_cuda(rank: int, world_size: int, what: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from tandem.fsdp import fully_shard
    from tandem.zero import ZeroOptimizer

    torch.cuda.set_device(0)
    try:
        if what == "ddp":
            ref = TorchDDP(_net(), device_ids=[0])
            _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), rank=rank,
                   world_size=world_size)
            ours = tandem.DistributedDataParallel(_net(), device_ids=[0], bucket_cap_mb=0.01)
            _train(ours, torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9), rank=rank,
                   world_size=world_size)
            return {"diff": _diff(_params(ref), _params(ours))}
        if what == "zero2":
            ddp = tandem.DistributedDataParallel(_net(), device_ids=[0], zero_stage=2, bucket_cap_mb=0.01)
            _train(ddp, ZeroOptimizer(ddp, torch.optim.SGD, lr=0.1, momentum=0.9), rank=rank,
                   world_size=world_size)
            return {"params": _params(ddp)}
        model = _net()
        mesh = init_device_mesh("cuda", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, min_unit_bytes=0)
        fully_shard(model, mesh=mesh)
        _train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), rank=rank,
               world_size=world_size)
        return {"params": _gathered(model)}
    except RuntimeError as e:
        return {"error": str(e)}


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters of a sharded model, gathered on the CPU with c10d's
    all_gather_object (DTensor.full_tensor goes through functional collectives)."""
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            out[name] = p.detach().float().cpu()
            continue
        pieces: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(pieces, p.to_local().detach().float().cpu())
        placement = p.placements[0]
        assert isinstance(placement, Shard)
        out[name] = torch.cat(pieces, dim=placement.dim)
    return out


def _one_process(world_size: int) -> dict[str, torch.Tensor]:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        g = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, V, (BATCH * world_size, SEQ), generator=g).to(_cuda())
        target = torch.randint(0, V, (BATCH * world_size, SEQ), generator=g).to(_cuda())
        opt.zero_grad()
        losses = [_loss(model, tokens[r * BATCH:(r + 1) * BATCH], target[r * BATCH:(r + 1) * BATCH])
                  for r in range(world_size)]
        torch.stack(losses).mean().backward()
        opt.step()
    return _params(model)


GLOO_CASES = {what: Case(_gloo_cuda, args=(what,)) for what in ("ddp", "zero2", "fsdp")}


@pytest.fixture(scope="module")
def gloo_on_gpu() -> dict[int, Any]:
    return {n: run_cases(GLOO_CASES, world_size=n, backend="gloo") for n in (2, 4)}


@needs_cuda
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("what", ["ddp", "zero2", "fsdp"])
def test_ranks_sharing_the_gpu_over_gloo(gloo_on_gpu: dict[int, Any], world: int, what: str) -> None:
    outs = gloo_on_gpu[world][what]
    assert all("error" not in o for o in outs), outs
    if what == "ddp":
        assert max(o["diff"] for o in outs) <= TOL
        return
    ref = _one_process(world)
    for o in outs:
        assert _diff(ref, o["params"]) <= FSDP_TOL


# --------------------------------------------------------------------- one process
@needs_cuda
def test_data_parallel_on_the_gpu_equals_the_bare_module() -> None:
    bare = _net()
    dp = tandem.DataParallel(copy.deepcopy(bare))
    for model in (bare, dp):
        _train(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert next(dp.parameters()).is_cuda
    assert _diff(_params(bare), _params(dp)) <= TOL


@needs_cuda
def test_world_of_one_on_cuda_picks_nccl_and_binds_the_device() -> None:
    world = tandem.init()
    try:
        assert world.backend == "nccl" and world.device == torch.device("cuda", 0)
    finally:
        tandem.shutdown()


@needs_cuda
def test_main_job_on_the_gpu(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "tandem", "run", "--nproc-per-node", "gpu",
                           "-m", "tandem.examples.digits", "--no-progress"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "over 1 rank(s)" in proc.stdout, proc.stdout[-2000:]
    accuracy = re.findall(r"\[rank 0\] test accuracy ([\d.]+)%", proc.stdout)
    assert len(accuracy) == 1 and float(accuracy[0]) >= 95.0, proc.stdout[-2000:]


def _nccl(rank: int, world_size: int) -> float:
    world = tandem.init()
    try:
        ref = TorchDDP(_net(world.device), device_ids=[rank])
        _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), rank=rank, world_size=world_size)
        ours = tandem.DistributedDataParallel(_net(world.device), device_ids=[rank], bucket_cap_mb=0.001)
        _train(ours, torch.optim.SGD(ours.parameters(), lr=0.1), rank=rank, world_size=world_size)
        return _diff(_params(ref), _params(ours))
    finally:
        tandem.shutdown()


@needs_two_gpus
def test_two_ranks_on_nccl_equal_torch() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}
    diffs = run_distributed(_nccl, 2, init_process_group=False, env=env, timeout=180)
    assert max(diffs) <= TOL
