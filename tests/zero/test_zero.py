"""ZeRO stages 1 and 2 (tandem.ZeroOptimizer over DistributedDataParallel(zero_stage=...))
train to the same parameters as plain tandem DDP with the same torch optimizer, and
as torch's ZeroRedundancyOptimizer; checkpoints round-trip across world sizes.

Every multi-rank case of the module runs in one spawned group per world size
(tandem.testing.run_cases, a module fixture): the grid of optimizer cases, and
the single checks, each reported under its own name; buckets are tiny so that
the small model makes many buckets and shards cut across parameters.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem
from tandem.ddp.plan import ParamInfo, plan_buckets
from tandem.testing import Case as Run
from tandem.testing import run_cases
from tandem.testing.models import IN, OUT, make_model
from tandem.zero import ZeroConfig, ZeroOptimizer
from tandem.zero.layout import plan_runs

TOL = 1e-6
GLOBAL_BATCH = 16
CAP_MB = 0.0001  # ~26 fp32 elements: the 484-parameter MLP makes 3 buckets


@dataclass(frozen=True)
class Case:
    stage: int = 1
    groups: bool = False        # two param groups, different lr and weight decay
    clip: float | None = None   # clip by global norm
    sched: bool = False         # StepLR on the optimizer
    micro: int = 1              # micro-batches per step, all but the last under no_sync
    overlap_grad: bool = True
    overlap_gather: bool = False
    steps: int = 4


def _batch(step: int, micro: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s part of a global batch that does not depend on the world size."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x, y = torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)
    n = GLOBAL_BATCH // world_size
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _param_groups(model: nn.Module, case: Case) -> list[dict]:
    if not case.groups:
        return [{"params": list(model.parameters())}]
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "lr": 0.01, "weight_decay": 0.1},
            {"params": [p for n, p in named if not n.endswith("weight")], "lr": 0.03,
             "weight_decay": 0.0}]


def _train(model: tandem.DistributedDataParallel | TorchDDP, opt: torch.optim.Optimizer, case: Case, rank: int,
           world_size: int, clip: Callable[[float], object] | None, first_step: int = 0) -> None:
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if case.sched else None
    for step in range(first_step, case.steps):
        opt.zero_grad()
        for m in range(case.micro):
            last = m == case.micro - 1
            with contextlib.nullcontext() if last else model.no_sync():
                x, y = _batch(step, m, rank, world_size)
                nn.functional.mse_loss(model(x), y).backward()
        if case.clip is not None:
            assert clip is not None
            clip(case.clip)
        opt.step()
        if sched is not None:
            sched.step()


def _reference(rank: int, world_size: int, case: Case) -> dict[str, torch.Tensor]:
    model = make_model("mlp", seed=rank)
    ddp = tandem.DistributedDataParallel(model, bucket_cap_mb=CAP_MB)
    opt = torch.optim.Adam(_param_groups(model, case), lr=0.01)
    _train(ddp, opt, case, rank, world_size,
           lambda max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _zero(rank: int, world_size: int, case: Case) -> dict[str, torch.Tensor]:
    model = make_model("mlp", seed=rank)
    config = ZeroConfig(overlap_grad_reduce=case.overlap_grad, overlap_param_gather=case.overlap_gather)
    ddp = tandem.DistributedDataParallel(model, bucket_cap_mb=CAP_MB, zero_stage=case.stage,
                                         zero_config=config)
    opt = ZeroOptimizer(ddp, torch.optim.Adam, _param_groups(model, case), lr=0.01)
    _train(ddp, opt, case, rank, world_size, opt.clip_grad_norm_)
    opt.finish_param_gather()
    if case.stage == 2:
        assert all(p.grad is None for p in model.parameters()), "stage 2 releases param.grad"
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


CASES = [
    Case(stage=1), Case(stage=2),
    Case(stage=1, groups=True, sched=True), Case(stage=2, groups=True, sched=True),
    Case(stage=1, clip=0.05), Case(stage=2, clip=0.05, groups=True),
    Case(stage=1, micro=2), Case(stage=2, micro=2),
    Case(stage=1, overlap_grad=False), Case(stage=2, overlap_grad=False, overlap_gather=True),
    Case(stage=2, overlap_gather=True, groups=True, clip=0.05, sched=True),
]


def _grid(rank: int, world_size: int) -> dict[str, float]:
    out = {}
    refs: dict[tuple, dict] = {}
    for case in CASES:
        key = (case.groups, case.clip, case.sched, case.micro)
        if key not in refs:
            refs[key] = _reference(rank, world_size, case)
        # The reference is stage-agnostic: plain DDP with the same optimizer.
        out[repr(case)] = _max_diff(refs[key], _zero(rank, world_size, case))
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])  # 3: shards end in padding
def test_zero_matches_plain_ddp_with_adam(world_size: int, groups) -> None:
    results = groups[world_size]["grid"]
    for rank, diffs in enumerate(results):
        bad = {k: v for k, v in diffs.items() if v > TOL}
        assert not bad, f"rank {rank}: {bad}"


def _against_torch_zero(rank: int, world_size: int) -> float:
    case = Case(stage=1)
    model = make_model("mlp", seed=rank)
    ref = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    _train(TorchDDP(model), ref, case, rank, world_size, clip=None)
    ours = _zero(rank, world_size, case)
    return _max_diff({n: p.detach() for n, p in model.named_parameters()}, ours)


def test_stage1_matches_torch_zero_redundancy_optimizer(groups) -> None:
    assert max(groups[2]["against_torch_zero"]) <= TOL


def _world_of_one(rank: int, world_size: int) -> float:
    case = Case(stage=2, groups=True, clip=0.05)
    return _max_diff(_reference(rank, world_size, case), _zero(rank, world_size, case))


def test_world_of_one(groups) -> None:
    assert groups[1]["world_of_one"][0] <= TOL


def _bf16(rank: int, world_size: int) -> list[torch.Tensor]:
    model = make_model("mlp", seed=rank).to(torch.bfloat16)
    ddp = tandem.DistributedDataParallel(model, bucket_cap_mb=CAP_MB, zero_stage=2)
    opt = ZeroOptimizer(ddp, torch.optim.Adam, lr=0.01)
    assert all(p.dtype == torch.float32 for g in opt.optim.param_groups for p in g["params"])
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(3):
        opt.zero_grad()
        x, y = _batch(step, 0, rank, world_size)
        nn.functional.mse_loss(ddp(x.bfloat16()), y.bfloat16()).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return [p.detach().float() for p in model.parameters()]


def test_bf16_parameters_step_with_fp32_master_shards_and_stay_identical(groups) -> None:
    a, b = groups[2]["bf16"]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------- collectives
def _record(rank: int, world_size: int, stage: int, overlap: bool) -> dict:
    model = make_model("mlp", seed=rank)
    ddp = tandem.DistributedDataParallel(model, bucket_cap_mb=CAP_MB, zero_stage=stage,
                                         zero_config=ZeroConfig(overlap_grad_reduce=overlap))
    opt = ZeroOptimizer(ddp, torch.optim.Adam, lr=0.01)
    events: list[tuple[str, str]] = []
    ddp.comm.observers.append(lambda e: events.append((e.op, e.tag)))
    # The first layer's weight gets its gradient last in backward.
    first = next(iter(model.parameters()))
    first.register_post_accumulate_grad_hook(lambda p: events.append(("marker", "last gradient")))
    per_step = []
    for step in range(3):
        events.clear()
        opt.zero_grad()
        x, y = _batch(step, 0, rank, world_size)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        per_step.append(list(events))
    assert ddp.reducer is not None
    return {"events": per_step, "buckets": len(ddp.reducer.buckets)}


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_reduce_scatters_each_bucket_and_gathers_parameters(stage: int, groups) -> None:
    for result in groups[2][f"record_stage{stage}"]:
        n = result["buckets"]
        assert n >= 3
        for events in result["events"]:
            ops = [(op, tag) for op, tag in events if op != "marker"]
            assert [t for op, t in ops if op == "reduce_scatter"] == [f"bucket {b}" for b in range(n)]
            assert [t for op, t in ops if op == "all_gather_into"] == [f"params {b}" for b in range(n)]
            assert [t for op, t in ops if op == "all_reduce"] == ["missing gradients flag"]
            assert len(ops) == 2 * n + 1, ops
            # Overlap: the first bucket is on the wire before backward reaches the first layer.
            assert events.index(("reduce_scatter", "bucket 0")) < events.index(("marker", "last gradient"))


def test_without_overlap_reductions_start_at_the_end_of_backward(groups) -> None:
    for result in groups[2]["record_stage2_no_overlap"]:
        for events in result["events"]:
            assert events.index(("marker", "last gradient")) < events.index(("reduce_scatter", "bucket 0"))


def _deferred_gather(rank: int, world_size: int) -> list[int]:
    model = make_model("mlp", seed=rank)
    ddp = tandem.DistributedDataParallel(model, bucket_cap_mb=CAP_MB, zero_stage=1,
                                         zero_config=ZeroConfig(overlap_param_gather=True))
    opt = ZeroOptimizer(ddp, torch.optim.Adam, lr=0.01)
    x, y = _batch(0, 0, rank, world_size)
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    counts = [opt.gathers_in_flight]
    model.get_submodule("head")(torch.zeros(1, 16))  # the head's forward waits for the head's bucket only
    counts.append(opt.gathers_in_flight)
    ddp(x)
    counts.append(opt.gathers_in_flight)
    return counts


def test_overlap_param_gather_waits_per_bucket_in_forward(groups) -> None:
    for counts in groups[2]["deferred_gather"]:
        assert counts == [3, 2, 0], counts


# ---------------------------------------------------------------- memory
def _holdings(rank: int, world_size: int) -> dict:
    out = {}
    for stage in (1, 2):
        model = make_model("mlp", seed=rank)
        ddp = tandem.DistributedDataParallel(model, bucket_cap_mb=CAP_MB, zero_stage=stage)
        opt = ZeroOptimizer(ddp, torch.optim.Adam, lr=0.01)
        for step in range(2):
            opt.zero_grad()
            x, y = _batch(step, 0, rank, world_size)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        state = [t for s in opt.optim.state.values() for t in s.values() if t.dim()]
        reducer = ddp.reducer
        assert reducer is not None
        param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        out[stage] = {
            "state_numel": sum(t.numel() for t in state),
            "owned": opt.owned_numel,
            "shard_numel": sum(g.numel() for g in reducer.grad_shards),
            "param_numel": sum(p.numel() for p in model.parameters()),
            "param_grads": [p.grad for p in model.parameters() if p.grad is not None],
            "buffer_released": reducer.buffer.released,
            # fp32 parameters are stepped where they live: no master copy of the shard
            "masters_elsewhere": [m.numel() for m in opt.shards.masters
                                  if m.untyped_storage().data_ptr() not in param_storages],
            "masters_numel": sum(m.numel() for m in opt.shards.masters)}
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_holds_only_its_shards_between_steps(stage: int, groups) -> None:
    results = [r[stage] for r in groups[4]["holdings"]]
    total = results[0]["param_numel"]
    assert sum(r["owned"] for r in results) == total  # every element stepped exactly once
    for r in results:
        assert r["state_numel"] == 2 * r["owned"]     # Adam's two moments, for the shard only
        assert r["shard_numel"] * 4 < total + 4 * 3 * 4  # 1/N of the buckets, plus padding
        assert r["param_grads"] == [] and r["buffer_released"]
        assert r["masters_elsewhere"] == [] and r["masters_numel"] == r["owned"]


def _rebound_and_kept(rank: int, world_size: int) -> dict:
    """``param.data`` set between steps, and a ``.grad`` kept from inside backward:
    ZeRO (whose parameters live in flat buffers and whose gradients are born in
    the buckets) trains as plain DDP does, and the kept gradient is never freed
    or overwritten by later steps."""
    out = {}
    for stage in (0, 1, 2):
        model = make_model("mlp", seed=rank)
        first = next(iter(model.parameters()))
        kept: list[torch.Tensor] = []
        # before DDP's own hook, which may launch the bucket and release .grad
        handle = first.register_post_accumulate_grad_hook(lambda p, kept=kept: kept.append(p.grad))
        ddp = tandem.DistributedDataParallel(model, bucket_cap_mb=CAP_MB, zero_stage=stage)
        opt = (ZeroOptimizer(ddp, torch.optim.Adam, lr=0.01) if stage
               else torch.optim.Adam(model.parameters(), lr=0.01))
        snapshots = []
        for step in range(4):
            opt.zero_grad()
            x, y = _batch(step, 0, rank, world_size)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            if step == 0:
                handle.remove()
                snapshots.append(kept[0].clone())
            if step == 1:
                with torch.no_grad():
                    first.data = first.detach() * 0.5  # a new tensor: ZeRO copies it back in
        snapshots.append(kept[0].clone())  # three steps later
        out[stage] = {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                      "kept": snapshots}
    return out


def test_set_data_and_a_kept_gradient_train_as_plain_ddp(groups) -> None:
    for result in groups[2]["rebound_and_kept"]:
        for stage in (1, 2):
            assert _max_diff(result[0]["params"], result[stage]["params"]) < TOL, stage
            after_step, later = result[stage]["kept"]
            assert torch.equal(after_step, later), stage  # its memory stayed the user's


# ---------------------------------------------------------------- checkpoints
CKPT_CASE = Case(stage=2, groups=True, sched=True, clip=0.05, steps=4)
SAVE_AT = 2


def _save(rank: int, world_size: int, directory: str) -> None:
    case = replace(CKPT_CASE, steps=SAVE_AT)
    model = make_model("mlp", seed=rank)
    ddp = tandem.DistributedDataParallel(model, bucket_cap_mb=CAP_MB, zero_stage=case.stage)
    opt = ZeroOptimizer(ddp, torch.optim.Adam, _param_groups(model, case), lr=0.01)
    _train(ddp, opt, case, rank, world_size, opt.clip_grad_norm_)
    full = opt.state_dict()
    opt.save_sharded(f"{directory}/sharded", step=SAVE_AT)  # a committed step directory
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": full}, f"{directory}/full.pt")
    else:
        assert full is None


def _resume(rank: int, world_size: int, directory: str, source: str) -> dict[str, torch.Tensor]:
    ckpt = torch.load(f"{directory}/full.pt", weights_only=False)
    model = make_model("mlp", seed=rank)
    model.load_state_dict(ckpt["model"])
    ddp = tandem.DistributedDataParallel(model, bucket_cap_mb=CAP_MB, zero_stage=CKPT_CASE.stage)
    opt = ZeroOptimizer(ddp, torch.optim.Adam, _param_groups(model, CKPT_CASE), lr=0.01)
    if source == "sharded":
        assert opt.load_sharded(f"{directory}/sharded") == SAVE_AT  # saved on 4 ranks, loaded on 2
    elif source == "torch":  # plain DDP's torch.optim.Adam state dict: the same format
        opt.load_state_dict(torch.load(f"{directory}/torch.pt", weights_only=False))
    else:
        opt.load_state_dict(ckpt["optim"])
    # The learning rates come back from the state dict (StepLR halved them at
    # SAVE_AT, and would not change them again before the end).
    _train(ddp, opt, replace(CKPT_CASE, sched=False), rank, world_size, opt.clip_grad_norm_,
           first_step=SAVE_AT)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _uninterrupted(rank: int, world_size: int, directory: str) -> dict:
    model = make_model("mlp", seed=rank)
    ddp = tandem.DistributedDataParallel(model, bucket_cap_mb=CAP_MB)
    opt = torch.optim.Adam(_param_groups(model, CKPT_CASE), lr=0.01)
    short = replace(CKPT_CASE, steps=SAVE_AT)
    clip = lambda max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # noqa: E731
    _train(ddp, opt, short, rank, world_size, clip)
    torch_state = copy.deepcopy(opt.state_dict())  # its tensors are the live state
    if rank == 0:  # for _resume(source="torch"), run after this case
        torch.save(torch_state, f"{directory}/torch.pt")
    _train(ddp, opt, replace(CKPT_CASE, sched=False), rank, world_size, clip, first_step=SAVE_AT)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "torch_state": torch_state}


def test_checkpoint_saved_at_4_ranks_resumes_at_2(groups) -> None:
    groups[4]["save"]
    expected = groups[2]["uninterrupted"][0]
    # The consolidated state dict has torch's format and values.
    ours = torch.load(groups.directory / "full.pt", weights_only=False)["optim"]
    theirs = expected["torch_state"]
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for idx, state in theirs["state"].items():
        assert state.keys() == ours["state"][idx].keys()
        for key, value in state.items():
            assert ours["state"][idx][key].shape == value.shape, (idx, key)
            assert (ours["state"][idx][key].double() - value.double()).abs().max() <= TOL, (idx, key)
    assert torch.load(groups.directory / "torch.pt", weights_only=False)["param_groups"] == theirs["param_groups"]
    for source in ("full", "sharded", "torch"):
        for params in groups[2][f"resume_{source}"]:
            assert _max_diff(params, expected["params"]) <= TOL, source


# ---------------------------------------------------------------- pure layout
def test_runs_split_shards_by_param_group_and_cover_every_element() -> None:
    sizes = [7, 5, 12, 3, 9, 1]
    infos = [ParamInfo(f"p{i}", n, torch.float32, torch.device("cpu")) for i, n in enumerate(sizes)]
    for world in (1, 2, 3, 4):
        plan = plan_buckets(infos, list(reversed(range(len(sizes)))), [40], pad_to=world)
        group_of = {i: i % 2 for i in range(len(sizes)) if i != 3}  # p3 not optimized
        covered = {i: [0] * n for i, n in enumerate(sizes)}
        for rank in range(world):
            for run in plan_runs(plan.buckets, world, rank, group_of):
                assert run.length == sum(p.length for p in run.pieces)
                for piece in run.pieces:
                    assert group_of[piece.param] == run.group
                    for e in range(piece.param_start, piece.param_start + piece.length):
                        covered[piece.param][e] += 1
        for i, counts in covered.items():
            assert counts == ([0] * sizes[i] if i == 3 else [1] * sizes[i]), (world, i)


# ---------------------------------------------------------------- errors
def _errors(rank: int, world_size: int) -> None:
    model = make_model("mlp", seed=rank)
    with pytest.raises(ValueError, match="zero_stage must be 0, 1 or 2"):
        tandem.DistributedDataParallel(model, zero_stage=3)
    with pytest.raises(ValueError, match="zero_stage=1 or 2"):
        ZeroOptimizer(tandem.DistributedDataParallel(model), torch.optim.Adam)
    with pytest.raises(NotImplementedError, match="find_unused_parameters"):
        tandem.DistributedDataParallel(model, zero_stage=1, find_unused_parameters=True)
    with pytest.raises(ValueError, match="gradient_as_bucket_view"):
        tandem.DistributedDataParallel(model, zero_stage=2, gradient_as_bucket_view=True)
    ddp = tandem.DistributedDataParallel(model, zero_stage=1)
    with pytest.raises(ValueError, match="not a trainable parameter"):
        ZeroOptimizer(ddp, torch.optim.Adam, [torch.zeros(3, requires_grad=True)])
    with pytest.raises(NotImplementedError, match="register_comm_hook"):
        ddp.register_comm_hook(None, lambda s, b: None)
    with pytest.raises(NotImplementedError, match="join"):
        ddp.join_hook()
    opt = ZeroOptimizer(ddp, torch.optim.SGD, lr=0.1)
    with pytest.raises(NotImplementedError, match="param groups"):
        opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)]})
    # A shard of another world cut to this rank's rows (Note [elastic ZeRO]): of another model, or short.
    saved = opt.sharded_state_dict()
    other = {**saved["shapes"], 0: (1,)}
    with pytest.raises(ValueError, match=rf"rank {rank}: old rank 3's shard: parameter '.+' \(index 0\) has shape "
                                         r"\(1,\) there, .+ here: every rank must build the same model"):
        opt.load_rank_state([], saved["param_groups"], other, "old rank 3's shard")
    with pytest.raises(ValueError, match=rf"rank {rank}: the shards: state for 1 elements of parameter '.+' "
                                         r"\(index 0\), where this rank's rows hold \d+"):
        opt.load_rank_state([(0, 0, 1, {"momentum_buffer": torch.zeros(1)})], saved["param_groups"],
                            saved["shapes"], "the shards")


def test_bad_zero_arguments_fail_clearly(groups) -> None:
    groups[2]["errors"]


# ---------------------------------------------------------------- the groups
class Groups(dict):
    """World size -> tandem.testing.CaseResults; ``directory`` holds the checkpoints."""

    directory: Path


@pytest.fixture(scope="module")
def groups(tmp_path_factory) -> Groups:
    directory = tmp_path_factory.mktemp("zero")
    d = str(directory)
    out = Groups()
    out.directory = directory
    out[1] = run_cases({"world_of_one": Run(_world_of_one)}, 1)
    out[3] = run_cases({"grid": Run(_grid, timeout=300)}, 3)
    # The checkpoint is saved at 4 ranks before the 2-rank group resumes from it.
    out[4] = run_cases({"grid": Run(_grid, timeout=300), "holdings": Run(_holdings),
                        "save": Run(_save, args=(d,))}, 4)
    out[2] = run_cases({
        "grid": Run(_grid, timeout=300),
        "against_torch_zero": Run(_against_torch_zero),
        "bf16": Run(_bf16),
        "record_stage1": Run(_record, args=(1, True)),
        "record_stage2": Run(_record, args=(2, True)),
        "record_stage2_no_overlap": Run(_record, args=(2, False)),
        "deferred_gather": Run(_deferred_gather),
        "rebound_and_kept": Run(_rebound_and_kept),
        "errors": Run(_errors),
        "uninterrupted": Run(_uninterrupted, args=(d,)),  # writes torch.pt, which resume_torch loads
        **{f"resume_{source}": Run(_resume, args=(d, source)) for source in ("full", "sharded", "torch")},
    }, 2)
    return out
