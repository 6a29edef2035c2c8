"""The optimizer step fused into backward (DistributedDataParallel.fuse_optimizer)
trains to the same parameters and optimizer state as the unfused
``optimizer.step()`` after backward, and as one process on the global batch: SGD
with momentum, Adam and AdamW, two param groups, an LR scheduler, no_sync
accumulation, with and without ZeRO-1/2, at 2 and 3 ranks.

A grid of cases runs inside one spawned group per world size; buckets are tiny
so that the small models make many buckets and each bucket steps on its own.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import tandem
from tandem.testing import run_distributed
from tandem.testing.models import IN, OUT, make_model
from tandem.zero import ZeroConfig, ZeroOptimizer

TOL = 1e-6
GLOBAL_BATCH = 12  # divisible by 2 and 3
CAP_MB = 0.0001    # ~26 fp32 elements per bucket


@dataclass(frozen=True)
class Case:
    opt: str = "adamw"          # sgd (momentum, nesterov), adam, adamw
    stage: int = 0
    sched: bool = True          # a LambdaLR that changes the lr every step
    micro: int = 1              # micro-batches per step, all but the last under no_sync
    model: str = "mlp"
    as_view: bool = False
    find_unused: bool = False
    overlap: bool = True        # ZeRO: reductions launched during backward
    overlap_gather: bool = False
    check_finite: bool = False
    steps: int = 4


def _optimizer(case: Case) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    options: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
        "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
        "adam": (torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.9)}),
        "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05})}
    return options[case.opt]


def _groups(model: nn.Module) -> list[dict]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n.endswith("weight")], "lr": 0.02, "weight_decay": 0.1},
            {"params": [p for n, p in named if not n.endswith("weight")], "lr": 0.04, "weight_decay": 0.0}]


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def _shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    n = GLOBAL_BATCH // world_size
    return t[rank * n:(rank + 1) * n]


def _train(model: nn.Module, opt: torch.optim.Optimizer, case: Case, rank: int, world_size: int,
           *, local: bool = False) -> list[float]:
    """The unchanged training loop: zero_grad, backward(s), step, scheduler."""
    sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if case.sched else None)
    lrs = []
    for step in range(case.steps):
        opt.zero_grad()
        for m in range(case.micro):
            x, y = _batch(step, m)
            if not local:
                x, y = _shard(x, rank, world_size), _shard(y, rank, world_size)
            sync = local or m == case.micro - 1
            with contextlib.nullcontext() if sync else _ddp(model).no_sync():
                nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def _ddp(model: nn.Module) -> tandem.DistributedDataParallel:
    """``model``, which a run that does not sync every backward wraps in tandem's DDP."""
    assert isinstance(model, tandem.DistributedDataParallel)
    return model


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(case: Case, rank: int, world_size: int, fused: bool) -> dict:
    model = make_model(case.model, seed=rank)
    ddp = tandem.DistributedDataParallel(
        model, bucket_cap_mb=CAP_MB, zero_stage=case.stage, gradient_as_bucket_view=case.as_view,
        find_unused_parameters=case.find_unused, check_finite=case.check_finite,
        zero_config=ZeroConfig(overlap_grad_reduce=case.overlap, overlap_param_gather=case.overlap_gather)
        if case.stage else None)
    cls, kwargs = _optimizer(case)
    opt = (ZeroOptimizer(ddp, cls, _groups(model), **kwargs) if case.stage
           else cls(_groups(model), **kwargs))
    if fused:
        ddp.fuse_optimizer(opt)
    lrs = _train(ddp, opt, case, rank, world_size)
    if isinstance(opt, ZeroOptimizer):
        opt.finish_param_gather()
    out = {"params": _params(model), "lrs": lrs,
           "grads none": all(p.grad is None for p in model.parameters())}
    if not isinstance(opt, ZeroOptimizer):
        out["state"] = {k: v for k, v in opt.state_dict()["state"].items()}
    else:  # consolidated from the shards, on every rank, per parameter
        state = opt.state_dict(to=None)
        assert state is not None
        out["state"] = state["state"]
    return out


def _local(case: Case) -> dict:
    model = make_model(case.model, seed=0)
    cls, kwargs = _optimizer(case)
    opt = cls(_groups(model), **kwargs)
    _train(model, opt, case, 0, 1, local=True)
    return _params(model)


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    return max(((a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0) for k in a)


def _state_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = 0.0
    for k in a:
        assert a[k].keys() == b[k].keys(), (k, a[k].keys(), b[k].keys())
        for name in a[k]:
            x, y = a[k][name], b[k][name]
            worst = max(worst, (torch.as_tensor(x).double() - torch.as_tensor(y).double()).abs().max().item())
    return worst


CASES = [Case(opt=o) for o in ("sgd", "adam", "adamw")] + [
    Case(opt=o, stage=s) for o in ("sgd", "adamw") for s in (1, 2)] + [
    Case(micro=2), Case(stage=2, micro=2, opt="adam"), Case(stage=1, overlap=False, overlap_gather=True),
    Case(as_view=True, opt="sgd"), Case(model="never_used", find_unused=True),
    Case(check_finite=True), Case(stage=2, check_finite=True, sched=False),
]


def _grid(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    out = {}
    for case in CASES:
        fused = _run(case, rank, world_size, fused=True)
        plain = _run(case, rank, world_size, fused=False)
        local = _local(case)
        if case.find_unused:  # the never-used submodule is not trained in either
            local = {k: v for k, v in local.items() if k in fused["params"]}
        out[repr(case)] = {
            "fused vs unfused": _diff(fused["params"], plain["params"]),
            "fused vs local": _diff(fused["params"], local),
            "state": _state_diff(fused["state"], plain["state"]),
            "lrs": float(fused["lrs"] != plain["lrs"]),
            "grads left": float(not fused["grads none"]),
        }
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_fused_step_equals_unfused_and_local_training(world_size: int) -> None:
    results = run_distributed(_grid, world_size, timeout=300)
    for rank, cases in enumerate(results):
        assert len(cases) == len(CASES)
        bad = {case: diffs for case, diffs in cases.items() if max(diffs.values()) > TOL}
        assert not bad, f"rank {rank}: {bad}"


def _error(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _misuse(rank: int, world_size: int) -> dict[str, object]:
    import warnings

    out: dict[str, object] = {}
    model = make_model("mlp", seed=0)
    ddp = tandem.DistributedDataParallel(model, bucket_cap_mb=CAP_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # created before fusing
    ddp.fuse_optimizer(opt)
    out["twice"] = _error(lambda: ddp.fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1)))
    out["refuse again"] = _error(lambda: tandem.DistributedDataParallel(
        make_model("mlp", seed=0), bucket_cap_mb=CAP_MB).fuse_optimizer(opt))
    post_hook_calls: list[int] = []
    opt.register_step_post_hook(lambda *_: post_hook_calls.append(1))
    x, y = _batch(0, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = _params(model)
        nn.functional.mse_loss(ddp(_shard(x, rank, world_size)), _shard(y, rank, world_size)).backward()
        after_backward = _params(model)
        opt.step()
        sched.step()
    out["stepped in backward"] = _diff(before, after_backward) > 0
    out["step is a no-op"] = _diff(after_backward, _params(model)) == 0
    out["warnings"] = [str(w.message) for w in caught]
    out["lr"] = opt.param_groups[0]["lr"]
    out["post hook calls"] = len(post_hook_calls)  # once per step, not once per bucket
    out["closure"] = _error(lambda: opt.step(lambda: 0.0))
    ddp.unfuse_optimizer()
    nn.functional.mse_loss(ddp(_shard(x, rank, world_size)), _shard(y, rank, world_size)).backward()
    mid = _params(model)
    opt.step()
    out["unfused steps after backward"] = _diff(mid, _params(model)) > 0

    other = nn.Linear(2, 2)
    fresh = make_model("mlp", seed=0)
    out["foreign"] = _error(lambda: tandem.DistributedDataParallel(fresh).fuse_optimizer(
        torch.optim.SGD(list(fresh.parameters()) + list(other.parameters()), lr=0.1)))
    out["lbfgs"] = _error(lambda: tandem.DistributedDataParallel(fresh).fuse_optimizer(
        torch.optim.LBFGS(fresh.parameters())))
    zmodel = make_model("mlp", seed=0)
    zddp = tandem.DistributedDataParallel(zmodel, zero_stage=2)
    out["zero plain"] = _error(lambda: zddp.fuse_optimizer(torch.optim.SGD(zmodel.parameters(), lr=0.1)))

    # Adding a group after fusing is refused at the next synchronised backward, on every rank.
    amodel = make_model("mlp", seed=0)
    addp = tandem.DistributedDataParallel(amodel)
    named = dict(amodel.named_parameters())
    aopt = torch.optim.SGD([p for n, p in named.items() if n != "head.bias"], lr=0.1)
    addp.fuse_optimizer(aopt)
    aopt.add_param_group({"params": [named["head.bias"]]})
    out["added group"] = _error(lambda: nn.functional.mse_loss(
        addp(_shard(x, rank, world_size)), _shard(y, rank, world_size)).backward())
    return out


def test_fused_step_misuse_fails_clearly_and_schedulers_stay_quiet() -> None:
    for out in run_distributed(_misuse, 2, timeout=120):
        assert out["twice"].startswith("RuntimeError: an optimizer (SGD) is already fused"), out["twice"]
        assert out["refuse again"].startswith("RuntimeError: this SGD is already fused"), out["refuse again"]
        assert out["stepped in backward"] and out["step is a no-op"], out
        assert out["warnings"] == [] and out["lr"] == 0.05, out
        assert out["post hook calls"] == 1, out
        assert "takes no closure" in out["closure"], out["closure"]
        assert out["unfused steps after backward"]
        assert out["foreign"].startswith("ValueError: fuse_optimizer: param group 0 of the SGD holds at position 6 "
                                         "a tensor of shape (2, 2) that is not a trainable parameter"), out["foreign"]
        assert out["lbfgs"].startswith("ValueError: fuse_optimizer cannot fuse LBFGS"), out["lbfgs"]
        assert out["zero plain"].startswith("ValueError: fuse_optimizer under zero_stage=2 needs the "
                                            "tandem.ZeroOptimizer"), out["zero plain"]
        assert "a param group was added to the optimizer after it was fused" in out["added group"], out


def _world_of_one(rank: int, world_size: int) -> float:
    case = Case(opt="adam")
    fused = _run(case, rank, world_size, fused=True)
    return _diff(fused["params"], _local(case))


def test_fused_step_in_a_world_of_one() -> None:
    assert run_distributed(_world_of_one, 1, timeout=60) == [pytest.approx(0.0, abs=TOL)]
