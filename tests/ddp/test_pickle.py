"""Copies of a model in the middle of training (issue 21): ``copy.deepcopy`` and
``torch.save``/``torch.load`` of tandem's wrappers, next to torch's.

A case trains a few steps, copies the wrapped model (and its optimizer, in the
same copy or through ``state_dict``), then trains the original and the copy on
the same batches: the copy must end where the original does, and both where
torch's DDP, copied the same way, ends (Note [copying a DDP model] in
tandem/ddp/module.py). What torch refuses, or lets through broken, is recorded
next to what tandem does (``test_side_by_side_with_torch``). A grid of cases runs in
one spawned group per world size.
"""

from __future__ import annotations

import copy
import io
import pickle
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem
from tandem.comm.group import GroupComm
from tandem.testing import as_dtensor, max_abs_diff, run_distributed
from tandem.testing.models import IN, OUT, make_model

TOL = 1e-6
BATCH = 4
BEFORE, AFTER = 2, 3  # steps before the copy (past bucket rebuilding, a learned static graph), after


@dataclass(frozen=True)
class Case:
    model: str = "mlp"
    ddp: dict = field(default_factory=dict)
    opt: str = "sgd"                  # "sgd" (with momentum) or "adam"
    how: str = "deepcopy"             # or "save": torch.save and torch.load through a buffer
    opt_copy: str = "together"        # in the same copy as the model, or "state_dict": a new one loads it
    zero: bool = False                # tandem.ZeroOptimizer over ddp zero_stage (torch: a plain optimizer)
    hook: str | None = None           # a communication hook: "fp16", "powersgd" or "own comm" (allreduce)
    fuse: bool = False                # the optimizer fused into tandem's backward
    sync_bn: bool = False             # BatchNorm converted to tandem.SyncBatchNorm (tandem only)
    bf16: bool = False                # parameters in bf16 (ZeRO's masters are wider)
    torch_ref: bool = True            # also compare with torch's DDP copied the same way
    torch_copy: bool = True           # torch's copy is right (not with static_graph: test_side_by_side_with_torch)

    @property
    def name(self) -> str:
        kw = ",".join(f"{k}={v}" for k, v in sorted(self.ddp.items()))
        extras = [x for x, on in (("zero", self.zero), (f"hook={self.hook}", self.hook), ("fused", self.fuse),
                                  ("syncbn", self.sync_bn), ("bf16", self.bf16)) if on]
        return f"{self.model}/{self.opt}/{self.how}/{self.opt_copy}/{kw}/{'/'.join(extras)}"


def _batch(step: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(BATCH, IN, generator=g).to(dtype), torch.randn(BATCH, OUT, generator=g).to(dtype)


def _copy(obj: Any, how: str) -> Any:
    if how == "deepcopy":
        return copy.deepcopy(obj)
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _opt_args(case: Case) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    if case.opt == "sgd":
        return torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}
    return torch.optim.Adam, {"lr": 0.01}


def _optimizer(model: nn.Module, case: Case, ours: bool) -> torch.optim.Optimizer:
    cls, kwargs = _opt_args(case)
    if case.zero and ours:
        return tandem.ZeroOptimizer(model, cls, **kwargs)
    opt = cls(model.parameters(), **kwargs)
    if case.fuse and ours:
        model.fuse_optimizer(opt)  # type: ignore[operator]
    return opt


def _hook(model: nn.Module, case: Case) -> None:
    if case.hook == "fp16":
        model.register_comm_hook(None, tandem.comm_hooks.fp16_compress_hook)  # type: ignore[operator]
    elif case.hook == "own comm":  # the hook's state is the DDP's own GroupComm
        model.register_comm_hook(model.comm, tandem.comm_hooks.allreduce_hook)  # type: ignore[operator]
    elif case.hook == "powersgd":
        state = tandem.comm_hooks.PowerSGDState(tandem.comm_hooks.PowerSGDConfig(start_iter=1))
        model.register_comm_hook(state, tandem.comm_hooks.powersgd_hook)  # type: ignore[operator]


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, dtype: torch.dtype) -> None:
    opt.zero_grad(set_to_none=True)
    x, y = _batch(step, rank, dtype)
    nn.functional.mse_loss(model(x, step), y).backward()
    opt.step()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.module.state_dict().items()}  # type: ignore[union-attr]


def _train_and_copy(model: nn.Module, case: Case, rank: int, ours: bool) -> dict[str, Any]:
    """BEFORE steps, a copy, then AFTER steps of the original and of the copy."""
    dtype = torch.bfloat16 if case.bf16 else torch.float32
    opt = _optimizer(model, case, ours)
    for step in range(BEFORE):
        _step(model, opt, step, rank, dtype)
    if case.opt_copy == "together":
        twin, twin_opt = _copy((model, opt), case.how)
    else:
        twin = _copy(model, case.how)
        twin_opt = _optimizer(twin, case, ours)
        state = opt.state_dict(to=None) if case.zero and ours else opt.state_dict()  # type: ignore[call-arg]
        twin_opt.load_state_dict(copy.deepcopy(state))  # torch's state_dict holds the live state tensors
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    own = all(p.untyped_storage().data_ptr() not in ptrs for p in twin.parameters())
    for step in range(BEFORE, BEFORE + AFTER):
        _step(model, opt, step, rank, dtype)
        _step(twin, twin_opt, step, rank, dtype)
    for o in (opt, twin_opt):
        if isinstance(o, tandem.ZeroOptimizer):
            o.finish_param_gather()  # overlap_param_gather: the last step's parameters land
    return {"original": _state(model), "copy": _state(twin), "own tensors": own}


# What torch's DDP is given for the reference run (tandem's own options change no arithmetic).
_TORCH_KWARGS = ("find_unused_parameters", "gradient_as_bucket_view", "bucket_cap_mb", "static_graph")


def _models(case: Case, rank: int) -> tuple[nn.Module, nn.Module]:
    """torch's DDP and tandem's, each rank's model seeded differently (the
    broadcast at construction makes them equal)."""
    def build() -> nn.Module:
        m = make_model(case.model, seed=rank)
        return m.to(torch.bfloat16) if case.bf16 else m

    ref = TorchDDP(build(), **{k: v for k, v in case.ddp.items() if k in _TORCH_KWARGS})
    inner = build()
    if case.sync_bn:
        inner = tandem.SyncBatchNorm.convert_sync_batchnorm(inner)
    kwargs = dict(case.ddp)
    if case.zero:
        kwargs.setdefault("zero_stage", 1)
    ours = tandem.DistributedDataParallel(inner, **kwargs)
    _hook(ours, case)
    return ref, ours


def _run_case(rank: int, case: Case) -> dict[str, Any]:
    ref, ours = _models(case, rank)
    mine = _train_and_copy(ours, case, rank, ours=True)
    out: dict[str, Any] = {"copy vs original": max_abs_diff(mine["original"], mine["copy"]),
                           "own tensors": mine["own tensors"]}
    if case.torch_ref:
        theirs = _train_and_copy(ref, case, rank, ours=False)
        out["original vs torch's"] = max_abs_diff(mine["original"], theirs["original"])
        out["copy vs torch's " + ("copy" if case.torch_copy else "original")] = \
            max_abs_diff(mine["copy"], theirs["copy" if case.torch_copy else "original"])
    return out


def _run_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict[str, Any]]:
    return [_run_case(rank, c) for c in cases]


def _check(cases: list[Case], world_size: int) -> None:
    results = run_distributed(_run_cases, world_size, args=(cases,), timeout=300)
    failures = []
    for i, case in enumerate(cases):
        for rank in range(world_size):
            for what, value in results[rank][i].items():
                if what == "own tensors":
                    if not value:
                        failures.append(f"{case.name} rank {rank}: the copy shares parameter storage")
                elif not value <= TOL:
                    failures.append(f"{case.name} rank {rank}: {what}: max abs diff {value:.3g}")
    assert not failures, "\n".join(failures)


CASES = [
    Case(),
    Case(opt="adam", how="save"),
    Case(opt="adam", opt_copy="state_dict"),
    Case(how="save", opt_copy="state_dict", ddp=dict(gradient_as_bucket_view=True)),
    Case(model="wide", opt="adam", ddp=dict(static_graph=True, bucket_cap_mb=0.01), torch_copy=False),
    Case(model="switching", how="save", ddp=dict(find_unused_parameters=True)),
    Case(model="tied", opt="adam", ddp=dict(bucket_cap_mb=0.0001)),
    Case(model="two_dtypes", how="save"),
    Case(model="batchnorm", opt="adam"),                         # buffers broadcast before each forward
    Case(ddp=dict(check_finite="skip")),
    Case(fuse=True, opt="adam"),                                 # the copy's optimizer steps unfused
    Case(fuse=True, how="save", opt_copy="state_dict"),
    Case(hook="fp16", torch_ref=False),                          # torch's copy drops the hook
    Case(hook="powersgd", how="save", torch_ref=False),
    Case(hook="own comm", how="save"),                            # bit-identical to no hook
    Case(model="batchnorm", sync_bn=True, how="save", torch_ref=False),
    # ZeRO: compared with torch's DDP and a plain optimizer (torch's ZeroRedundancyOptimizer
    # does not survive a copy: test_side_by_side_with_torch).
    Case(zero=True),
    Case(zero=True, opt="adam", how="save", ddp=dict(zero_stage=2, bucket_cap_mb=0.0002)),
    Case(zero=True, opt="adam", opt_copy="state_dict", ddp=dict(zero_stage=2)),
    Case(zero=True, ddp=dict(zero_config=tandem.zero.ZeroConfig(overlap_param_gather=True),
                             bucket_cap_mb=0.0002)),
    Case(zero=True, fuse=True, how="save", ddp=dict(zero_stage=2)),
    Case(zero=True, opt="adam", bf16=True, torch_ref=False),     # fp32 masters travel with the copy
]


def test_copies_train_on_equal_two_ranks() -> None:
    _check(CASES, 2)


def test_copies_train_on_equal_one_rank() -> None:
    # A world of one has no reducer unless one is needed (ZeRO, check_finite, a fused step).
    _check([Case(), Case(opt="adam", how="save"), Case(model="batchnorm", opt_copy="state_dict"),
            Case(ddp=dict(check_finite=True), how="save"), Case(fuse=True),
            Case(zero=True, opt="adam"), Case(zero=True, how="save", ddp=dict(zero_stage=2))], 1)


# ---------------------------------------------------------------------- side by side with torch

def _attempt(fn: Any) -> str:
    """What ``fn()`` did: "ok", or the exception's type and message."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the behaviour is what is recorded
        return f"{type(e).__name__}: {e}"
    return "ok"


def _sharded_mlp(shard: Any, **kwargs: Any) -> nn.Module:
    model = make_model("mlp", seed=0)
    for layer in model.layers:  # type: ignore[union-attr]
        shard(layer, **kwargs)
    shard(model, **kwargs)
    return model


def _side_by_side(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    out: dict[str, Any] = {}
    dtype = torch.float32
    # A DDP over a group that is not the default one (here: every rank, but another group).
    group = dist.new_group(list(range(world_size)))
    out["torch ddp subgroup"] = _attempt(lambda: copy.deepcopy(TorchDDP(make_model("mlp", 0), process_group=group)))
    sub = tandem.DistributedDataParallel(make_model("mlp", 0), process_group=group)
    out["tandem ddp subgroup"] = _attempt(lambda: copy.deepcopy(sub))
    out["tandem ddp subgroup save"] = _attempt(lambda: torch.save(sub, io.BytesIO()))

    # A hook whose state is another GroupComm: refused, saying what holds the group and what to do.
    hooked = tandem.DistributedDataParallel(make_model("mlp", 0))
    hooked.register_comm_hook(GroupComm(group), tandem.comm_hooks.allreduce_hook)  # type: ignore[operator]
    out["tandem ddp foreign comm hook deepcopy"] = _attempt(lambda: copy.deepcopy(hooked))
    out["tandem ddp foreign comm hook save"] = _attempt(lambda: torch.save(hooked, io.BytesIO()))

    # torch's ZeroRedundancyOptimizer copies, but the copy cannot step.
    ddp = TorchDDP(make_model("mlp", 0))
    zro = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    _step(ddp, zro, 0, rank, dtype)
    ddp2, zro2 = copy.deepcopy((ddp, zro))
    out["torch zero copy step"] = _attempt(lambda: _step(ddp2, zro2, 1, rank, dtype))

    # fully_shard: torch refuses both; so does tandem, naming the fix, which works.
    mesh = init_device_mesh("cpu", (world_size,))
    theirs = _sharded_mlp(torch_fully_shard, mesh=mesh)
    out["torch fully_shard deepcopy"] = _attempt(lambda: copy.deepcopy(theirs))
    out["torch fully_shard save"] = _attempt(lambda: torch.save(theirs, io.BytesIO()))
    ours = _sharded_mlp(tandem.fully_shard)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    _step(ours, opt, 0, rank, dtype)
    out["tandem fully_shard deepcopy"] = _attempt(lambda: copy.deepcopy(ours))
    out["tandem fully_shard save"] = _attempt(lambda: torch.save(ours, io.BytesIO()))
    out["tandem fully_shard parent deepcopy"] = _attempt(lambda: copy.deepcopy(nn.Sequential(ours)))
    out["tandem fully_shard copy.copy"] = type(copy.copy(ours)) is type(ours)
    twin = _sharded_mlp(tandem.fully_shard)  # the error's fix: the same model, sharded the same way
    twin.load_state_dict(ours.state_dict())
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for step in range(1, 3):
        _step(ours, opt, step, rank, dtype)
        _step(twin, twin_opt, step, rank, dtype)
    out["fully_shard twin vs original"] = max(
        (as_dtensor(a).full_tensor() - as_dtensor(b).full_tensor()).abs().max().item()
        for a, b in zip(ours.parameters(), twin.parameters()))

    # A ZeroOptimizer holds this rank's shard: loading another rank's pickle is refused.
    zddp = tandem.DistributedDataParallel(make_model("mlp", 0), zero_stage=1)
    zopt = tandem.ZeroOptimizer(zddp, torch.optim.Adam, lr=0.01)
    _step(zddp, zopt, 0, rank, dtype)
    buf = io.BytesIO()
    torch.save((zddp, zopt), buf)
    pickles: list[Any] = [None] * world_size
    dist.all_gather_object(pickles, buf.getvalue())
    other = pickles[(rank + 1) % world_size]
    out["tandem zero other rank's pickle"] = _attempt(lambda: torch.load(io.BytesIO(other), weights_only=False))

    # torch's copy of a static-graph DDP skips the all-reduce of its first step (the
    # copied _static_graph_delay_allreduce_enqueued tells the new reducer that its
    # first iteration is over): the replicas part. tandem's copy re-learns the graph.
    out["torch static_graph copy, replicas apart"] = _replicas_apart_after_copy(TorchDDP, rank)
    out["tandem static_graph copy, replicas apart"] = _replicas_apart_after_copy(
        tandem.DistributedDataParallel, rank)

    # torch's copy drops a communication hook and all-reduces; tandem's keeps it (a no-op
    # hook here: the copy's gradients stay each rank's own).
    out["torch copy, noop hook, grads apart"] = _grads_apart_after_copy(TorchDDP, rank)
    out["tandem copy, noop hook, grads apart"] = _grads_apart_after_copy(tandem.DistributedDataParallel, rank)

    # One rank alone copies and evaluates (an EMA or evaluation copy): no collective, no hang.
    model = tandem.DistributedDataParallel(make_model("mlp", 0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0, rank, dtype)
    x, _ = _batch(99, rank, dtype)
    if rank == 0:
        ema = copy.deepcopy(model)
        with torch.no_grad():
            out["rank-0 copy output"] = (ema(x) - model(x)).abs().max().item()
    _step(model, opt, 1, rank, dtype)

    # What a process without a process group makes of the pickles (test_load_without_process_group).
    out["pickles"] = {"torch": _saved(TorchDDP(make_model("mlp", 0))),
                      "tandem": _saved(tandem.DistributedDataParallel(make_model("mlp", 0)))}
    return out


def _replicas_apart_after_copy(ddp_class: Any, rank: int) -> float:
    model = ddp_class(make_model("wide", seed=rank), static_graph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(BEFORE):
        _step(model, opt, step, rank, torch.float32)
    twin, twin_opt = copy.deepcopy((model, opt))
    _step(twin, twin_opt, BEFORE, rank, torch.float32)
    states: list[Any] = [None, None]
    dist.all_gather_object(states, _state(twin))
    return max_abs_diff(states[0], states[1])


def _grads_apart_after_copy(ddp_class: Any, rank: int) -> float:
    model = ddp_class(make_model("mlp", seed=0))
    model.register_comm_hook(None, tandem.comm_hooks.noop_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0, rank, torch.float32)
    twin = copy.deepcopy(model)
    x, y = _batch(1, rank, torch.float32)
    nn.functional.mse_loss(twin(x), y).backward()
    grads: list[Any] = [None, None]
    dist.all_gather_object(grads, {n: p.grad for n, p in twin.module.named_parameters()})
    return max_abs_diff(grads[0], grads[1])


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def side_by_side() -> list[dict[str, Any]]:
    return run_distributed(_side_by_side, 2, timeout=240)


def test_side_by_side_with_torch(side_by_side: list[dict[str, Any]]) -> None:
    """What torch does with a copy, and what tandem does instead: refusals with
    errors that name the fix, and the copies torch makes wrong."""
    for rank, out in enumerate(side_by_side):
        # DDP over another group: torch refuses, tandem too, naming the fix.
        assert out["torch ddp subgroup"].startswith("RuntimeError: DDP Pickling/Unpickling are only supported")
        for key in ("tandem ddp subgroup", "tandem ddp subgroup save"):
            assert out[key].startswith(f"RuntimeError: rank {rank}: a DistributedDataParallel over a process "
                                       "group other than the default one"), out[key]
            assert "copy.deepcopy(ddp.module)" in out[key]
        # A comm hook whose state is a GroupComm other than the model's own.
        for key in ("tandem ddp foreign comm hook deepcopy", "tandem ddp foreign comm hook save"):
            assert out[key].startswith(f"TypeError: rank {rank}: a GroupComm over process group "), out[key]
            assert "(ranks [0, 1]) cannot be pickled or deep-copied" in out[key], out[key]
            assert "register the hook on the copy" in out[key], out[key]
        # torch's ZeroRedundancyOptimizer: the copy is made, and breaks at its first step;
        # tandem's ZeroOptimizer copies train on (test_copies_train_on_equal_*).
        assert out["torch zero copy step"].startswith("AttributeError"), out["torch zero copy step"]
        # fully_shard: torch refuses deepcopy and pickling; tandem too, with the fix.
        assert out["torch fully_shard deepcopy"].startswith("AssertionError: FSDP does not support deepcopy")
        assert out["torch fully_shard save"].startswith(("PicklingError", "AttributeError")), \
            out["torch fully_shard save"]
        for key, how in (("tandem fully_shard deepcopy", "deep-copied"),
                         ("tandem fully_shard save", "pickled"),
                         ("tandem fully_shard parent deepcopy", "deep-copied")):
            assert out[key].startswith(f"TypeError: rank {rank}: a FSDPMLP sharded by tandem.fully_shard "
                                       f"cannot be {how}"), out[key]
            assert "load_state_dict(model.state_dict())" in out[key]
        assert out["tandem fully_shard copy.copy"]
        assert out["fully_shard twin vs original"] <= TOL
        assert out["tandem zero other rank's pickle"].startswith(
            f"RuntimeError: rank {rank} of 2: this ZeroOptimizer was copied or pickled at rank {1 - rank} of 2"), \
            out["tandem zero other rank's pickle"]
        assert out["torch static_graph copy, replicas apart"] > 1e-3
        assert out["tandem static_graph copy, replicas apart"] == 0.0
        assert out["torch copy, noop hook, grads apart"] == 0.0
        assert out["tandem copy, noop hook, grads apart"] > 1e-3
    assert side_by_side[0]["rank-0 copy output"] == 0.0


def test_load_without_process_group(side_by_side: list[dict[str, Any]]) -> None:
    """Loading rebuilds the reducer over the default group: without one, torch
    and tandem both refuse; tandem says what to do."""
    assert not dist.is_initialized()
    pickles = side_by_side[0]["pickles"]
    with pytest.raises((RuntimeError, ValueError), match="not been initialized"):
        torch.load(io.BytesIO(pickles["torch"]), weights_only=False)
    with pytest.raises(RuntimeError, match=r"initialised: call tandem.init\(\).*instead of the wrapper"):
        torch.load(io.BytesIO(pickles["tandem"]), weights_only=False)


def test_sync_batchnorm_copies_without_its_comm() -> None:
    """tandem.SyncBatchNorm caches a GroupComm (bound to this process) at first use;
    a copy drops it and builds its own, as torch's layer holds only the group."""
    bn = tandem.SyncBatchNorm(4)
    bn._comm = object()  # type: ignore[assignment]  # stands for the cached GroupComm
    assert copy.deepcopy(bn)._comm is None
    assert pickle.loads(pickle.dumps(bn))._comm is None
    assert bn._comm is not None
