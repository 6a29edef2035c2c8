"""HSDP: tandem.fully_shard over a 2-D mesh (replicate, shard), against torch's
fully_shard on the same mesh and against one process training on the global
batch (Note [hybrid sharding] in tandem/fsdp/unit.py).

One spawned group of 4 gloo ranks runs every case: the 2 x 2 mesh of
``init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))``
trains test_fsdp's small transformer-like model (AdamW and clipping by the
global norm, or plain SGD; a bf16 policy) with tandem and with torch; a distributed
checkpoint saved under HSDP 2 x 2 is loaded at two other mesh shapes (a 1-D
world of 4, and 4 x 1) and training continues there; bad meshes are refused
on every rank.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_fsdp import Case, Net, fully_shard_of, local_training, max_diff, tandem_units, train_step
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tandem.fsdp import fully_shard
from tandem.fsdp.regroup import check_regroupable
from tandem.testing import as_dtensor, as_fsdp, raised_by, run_distributed

WORLD = 4
TOL = 1e-5


@dataclass(frozen=True)
class Hsdp:
    impl: str = "tandem"                 # "tandem" or "torch"
    shape: tuple[int, ...] = (2, 2)      # (replicate, shard); one number: a 1-D mesh
    sgd: bool = False                    # plain SGD, one param group, no clipping
    micro: int = 1                       # micro-batches, all but the last without gradient sync
    partial: bool = False                # ... without the all-reduce only (set_requires_all_reduce)
    reshard: bool | None = None
    min_unit_bytes: int = 0
    branchy: bool = False                # odd ranks use Block.alt, nobody Block.unused
    bf16: bool = False                   # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)

    def case(self, steps: int = 3) -> Case:
        return Case(micro=self.micro, branchy=self.branchy, steps=steps, clip=1e9 if self.sgd else 0.3,
                    groups=not self.sgd)


CASES = {
    "adamw": Hsdp(),
    "torch_adamw": Hsdp(impl="torch"),
    "sgd": Hsdp(sgd=True),
    "torch_sgd": Hsdp(impl="torch", sgd=True),
    "accumulate": Hsdp(micro=2),
    "all_reduce_once": Hsdp(micro=2, partial=True),
    "torch_all_reduce_once": Hsdp(impl="torch", micro=2, partial=True),
    "no_reshard": Hsdp(reshard=False),
    "merged": Hsdp(min_unit_bytes=1 << 20),
    # SGD: one element of layers.0.fc2.weight has a gradient of 4e-8, near Adam's
    # eps, where Adam turns the summation order's rounding into 2e-5 of update
    "branchy": Hsdp(branchy=True, sgd=True),
    "bf16": Hsdp(bf16=True),
    "torch_bf16": Hsdp(impl="torch", bf16=True),
    "replicate_4": Hsdp(shape=(4, 1)),
    "shard_4": Hsdp(shape=(1, 4)),
}


def _mesh(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    if len(shape) == 1:
        return init_device_mesh("cpu", shape)
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _build(h: Hsdp, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    mesh = _mesh(h.shape)
    shard = fully_shard_of(h.impl, min_unit_bytes=h.min_unit_bytes)
    kwargs: dict[str, Any] = {}
    if h.reshard is not None:
        kwargs["reshard_after_forward"] = h.reshard
    if h.bf16:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        shard(block, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    if h.sgd:
        return model, torch.optim.SGD(model.parameters(), lr=0.1)
    from test_fsdp import _optimizer
    return model, _optimizer(model, Case())


@dataclass
class Outcome:
    losses: list[float]
    params: dict[str, torch.Tensor]
    placements: dict[str, str] = field(default_factory=dict)
    events: list[tuple[str, str, int, str]] = field(default_factory=list)   # (op, tag, numel, group)
    shard_numels: list[int] = field(default_factory=list)
    units: int = 0
    states: set[str] = field(default_factory=set)


def _train(rank: int, h: Hsdp) -> Outcome:
    model, opt = _build(h)
    case = h.case()
    units = tandem_units(model)
    out = Outcome([], {}, units=len(units))
    out.placements = {n: str(tuple(as_dtensor(p).placements)) for n, p in model.named_parameters()}
    log: list[tuple[str, str, int, str]] = []
    for step in range(case.steps):
        if step == 1:
            comms = [c for u in units for c in (u.comm, u.reduce_comm, u.replicate_comm) if c is not None]
            for comm in {id(c): c for c in comms}.values():
                kind = "replicate" if any(comm is u.replicate_comm for u in units) else "shard"
                comm.observers.append(lambda e, kind=kind: log.append((e.op, e.tag, e.numel, kind)))
        out.losses.append(_step(model, opt, h, case, rank, step))
        if step == 1:
            out.events = list(log)
    out.params = {k: v.full_tensor() for k, v in model.state_dict().items()}
    out.shard_numels = [u.params.layout.shard_numel + len(u.params.managed) for u in units]
    out.states = {f"{u.state.name}/{u.reduce_state.name}" for u in units}
    return out


def _step(model: nn.Module, opt: torch.optim.Optimizer, h: Hsdp, case: Case, rank: int, step: int) -> float:
    """test_fsdp's train_step; with ``h.partial`` the micro-batches before the
    last skip only the all-reduce across replicas, not the reduce-scatter."""
    if not h.partial:
        return train_step(model, opt, case, rank, WORLD, step)
    from test_fsdp import GLOBAL_BATCH, _batch, _loss
    n = GLOBAL_BATCH // WORLD
    total = torch.zeros(())
    for m in range(case.micro):
        as_fsdp(model).set_requires_all_reduce(m == case.micro - 1)
        tokens, target = _batch(step, m)
        loss = _loss(model, tokens[rank * n:(rank + 1) * n], target[rank * n:(rank + 1) * n], 0)
        (loss / case.micro).backward()
        total += loss.detach() / case.micro
    torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
    opt.step()
    opt.zero_grad()
    dist.all_reduce(total)
    return total.item() / WORLD


# ---------------------------------------------------------------------- checkpoint across mesh shapes

SAVED_STEPS, STEPS = 2, 4


def _save(rank: int, path: str) -> list[float]:
    model, opt = _build(Hsdp())
    case = Hsdp().case(STEPS)
    losses = [_step(model, opt, Hsdp(), case, rank, step) for step in range(SAVED_STEPS)]
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return losses


def _resume(rank: int, path: str, shape: tuple[int, ...]) -> tuple[list[float], dict[str, torch.Tensor], str]:
    h = Hsdp(shape=shape)
    model, opt = _build(h, seed=123)   # another init: everything must come from the checkpoint
    model_sd, optim_sd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    # Block.alt and Block.unused get no gradient, so AdamW saved no state for them.
    dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    case = h.case(STEPS)
    losses = [_step(model, opt, h, case, rank, step) for step in range(SAVED_STEPS, STEPS)]
    placement = str(tuple(as_dtensor(model.get_parameter("layers.0.fc1.weight")).placements))
    return losses, {k: v.full_tensor() for k, v in model.state_dict().items()}, placement


# ---------------------------------------------------------------------- refusals

def _errors(rank: int) -> dict[str, tuple[str, str] | None]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor import Shard as DShard

    hsdp = _mesh((2, 2))
    tp_layer = nn.Linear(4, 4)
    tp_layer.weight = nn.Parameter(distribute_tensor(tp_layer.weight.detach(), hsdp["shard"], [DShard(0)]))
    calls = {
        "three_d": lambda: fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (2, 1, 2))),
        "unnamed": lambda: fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (2, 2))),
        "hsdp_of_tp": lambda: fully_shard(tp_layer, mesh=hsdp),
        "reshard_over_shards": lambda: fully_shard(nn.Linear(2, 2), mesh=hsdp, reshard_after_forward=4),
        # What an elastic Trainer cannot lay out again over a new world (Note [regrouped units]).
        "elastic_hsdp": lambda: check_regroupable(fully_shard(nn.Linear(2, 2), mesh=hsdp), rank),
        "elastic_subgroup": lambda: check_regroupable(fully_shard(nn.Linear(2, 2), mesh=hsdp["shard"]), rank),
        "elastic_reshard_k": lambda: check_regroupable(fully_shard(nn.Linear(2, 2), reshard_after_forward=2),
                                                       rank),
        "elastic_default": lambda: check_regroupable(fully_shard(nn.Linear(2, 2)), rank),
    }
    return raised_by(calls)


# ---------------------------------------------------------------------- tandem plan --hsdp, measured

def _plan() -> Any:
    from test_fsdp_memory import BLOCKS
    from test_fsdp_memory import Net as PlanNet

    from tandem.tools.plan import plan_report
    torch.manual_seed(0)
    return plan_report(PlanNet(), world_size=WORLD, hsdp=2, fsdp_units=BLOCKS, min_unit_bytes=0)


@dataclass
class Held:
    units: list[tuple[str, int]]
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    events: list[tuple[str, int, int, str]] = field(default_factory=list)   # (op, numel, itemsize, group)


def _held(rank: int) -> Held:
    """What each rank of HSDP 2 x 2 holds after two AdamW steps, and the
    collectives of the second step, for the plan's HSDP row."""
    from test_fsdp import _distinct_bytes
    from test_fsdp_memory import BLOCKS
    from test_fsdp_memory import Net as PlanNet

    torch.manual_seed(0)
    model = PlanNet()
    mesh = _mesh((2, 2))
    for name in BLOCKS:
        fully_shard(model.get_submodule(name), mesh=mesh, min_unit_bytes=0)
    fully_shard(model, mesh=mesh, min_unit_bytes=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    units = tandem_units(model)
    held = Held([])
    for step in range(2):
        if step == 1:
            comms = {id(c): (c, "replicate" if c is u.replicate_comm else "shard")
                     for u in units for c in (u.comm, u.reduce_comm, u.replicate_comm) if c is not None}
            for comm, kind in comms.values():
                comm.observers.append(lambda e, kind=kind: held.events.append(
                    (e.op, e.numel, e.dtype.itemsize, kind)))
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(step * WORLD + rank))
        model(x).square().mean().backward()
        opt.step()
        if step == 0:   # the second step's gradients stay, as a step leaves them
            opt.zero_grad()
    # named at forward
    held.units = [("" if u.name == "<root>" else u.name, u.params.layout.shard_numel) for u in units]
    held.params = _distinct_bytes(as_dtensor(p).to_local() for p in model.parameters())
    held.grads = _distinct_bytes(as_dtensor(p.grad).to_local() for p in model.parameters() if p.grad is not None)
    held.optimizer = _distinct_bytes(v.to_local() for s in opt.state.values() for k, v in s.items() if k != "step")
    return held


def _worker(rank: int, world_size: int, path: str) -> dict:
    assert world_size == WORLD
    out: dict = {"cases": {name: _train(rank, h) for name, h in CASES.items()}}
    out["held"] = _held(rank)
    out["saved"] = _save(rank, path)
    dist.barrier()
    out["resumed"] = {shape: _resume(rank, path, shape) for shape in [(4,), (4, 1)]}
    out["errors"] = _errors(rank)
    return out


@functools.cache
def _results() -> list[dict]:
    path = tempfile.mkdtemp(prefix="tandem-hsdp-")
    try:
        return run_distributed(_worker, WORLD, args=(f"{path}/ckpt",), timeout=300)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@functools.cache
def _local(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    h = CASES[name]
    if h.sgd:  # local_training's optimizer is AdamW: train the SGD reference here
        return _local_sgd(h.case())
    return local_training(h.case(), WORLD)


def _local_sgd(case: Case) -> tuple[list[float], dict[str, torch.Tensor]]:
    from test_fsdp import GLOBAL_BATCH, _batch, _loss
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n = GLOBAL_BATCH // WORLD
    losses = []
    for step in range(case.steps):
        tokens, target = _batch(step, 0)
        loss = torch.stack([_loss(model, tokens[r * n:(r + 1) * n], target[r * n:(r + 1) * n],
                                  r % 2 if case.branchy else 0) for r in range(WORLD)]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------- the tests

@pytest.mark.parametrize("name", [n for n, h in CASES.items() if h.impl == "tandem" and not h.bf16])
def test_hsdp_equals_one_process_on_the_global_batch(name: str) -> None:
    losses, params = _local(name)
    for rank, r in enumerate(_results()):
        got: Outcome = r["cases"][name]
        assert max(abs(a - b) for a, b in zip(got.losses, losses)) <= TOL, (rank, got.losses, losses)
        assert max_diff(got.params, params) <= TOL, rank
        assert got.states == {"SHARDED/IDLE"}, (rank, got.states)


@pytest.mark.parametrize("name,reference", [("adamw", "torch_adamw"), ("sgd", "torch_sgd"),
                                            ("all_reduce_once", "torch_all_reduce_once")])
def test_hsdp_equals_torchs_fully_shard_on_the_same_mesh(name: str, reference: str) -> None:
    for rank, r in enumerate(_results()):
        ours, theirs = r["cases"][name], r["cases"][reference]
        assert max(abs(a - b) for a, b in zip(ours.losses, theirs.losses)) <= TOL, rank
        assert max_diff(ours.params, theirs.params) <= TOL, rank
        # the same DTensor layout: (Replicate(), Shard(0)) over the 2-D mesh
        assert ours.placements == theirs.placements, rank
        assert set(ours.placements.values()) == {"(Replicate(), Shard(dim=0))"}


def test_gradients_are_reduce_scattered_in_the_shard_group_then_all_reduced_across_replicas() -> None:
    for rank, r in enumerate(_results()):
        got: Outcome = r["cases"]["adamw"]
        by_kind = {(op, kind): [n for o, _, n, k in got.events if (o, k) == (op, kind)]
                   for op in ("reduce_scatter", "all_reduce", "all_gather_into") for kind in ("shard", "replicate")}
        # one reduce-scatter per unit over the 2 ranks of a shard group (2 blocks of
        # shard + flags), then one all-reduce of the reduced shard over the replicas
        assert sorted(by_kind[("reduce_scatter", "shard")]) == sorted(2 * n for n in got.shard_numels), rank
        assert sorted(by_kind[("all_reduce", "replicate")]) == sorted(got.shard_numels), rank
        assert not by_kind[("all_reduce", "shard")] and not by_kind[("reduce_scatter", "replicate")]
        assert not by_kind[("all_gather_into", "replicate")] and len(by_kind[("all_gather_into", "shard")]) > 0
        # the all-reduce of a unit follows its reduce-scatter, and the first one
        # starts while backward still reduce-scatters, not all at its end
        ops = [(o, t) for o, t, _, _ in got.events]
        for tag in {t for o, t in ops if o == "all_reduce"}:
            assert ops.index(("reduce_scatter", tag)) < ops.index(("all_reduce", tag)), (rank, tag)
        last_scatter = max(i for i, (o, _) in enumerate(ops) if o == "reduce_scatter")
        assert min(i for i, (o, _) in enumerate(ops) if o == "all_reduce") < last_scatter, rank


def test_a_checkpoint_saved_under_hsdp_loads_at_other_mesh_shapes_and_continues() -> None:
    losses, ref = local_training(Hsdp().case(STEPS), WORLD)
    for rank, r in enumerate(_results()):
        assert max(abs(a - b) for a, b in zip(r["saved"], losses[:SAVED_STEPS])) <= TOL
        for shape, (rest, params, placement) in r["resumed"].items():
            assert max(abs(a - b) for a, b in zip(rest, losses[SAVED_STEPS:])) <= TOL, (rank, shape, rest)
            assert max_diff(params, ref) <= TOL, (rank, shape)
            assert placement == ("(Shard(dim=0),)" if len(shape) == 1 else "(Replicate(), Shard(dim=0))")


def test_bad_meshes_are_refused_on_every_rank_with_the_fix() -> None:
    for rank, r in enumerate(_results()):
        e = r["errors"]
        assert e["three_d"][0] == "ValueError" and "3-D mesh" in e["three_d"][1], (rank, e["three_d"])
        assert "mesh_dim_names=('replicate', 'shard')" in e["three_d"][1]
        assert e["unnamed"][0] == "ValueError" and "without mesh_dim_names" in e["unnamed"][1]
        assert e["hsdp_of_tp"][0] == "NotImplementedError" and "'weight'" in e["hsdp_of_tp"][1]
        assert "mesh=mesh['dp']" in e["hsdp_of_tp"][1]
        # reshard_after_forward=k divides the shard group (2 ranks), not the world
        assert e["reshard_over_shards"][0] == "ValueError" and "shard group of 2" in e["reshard_over_shards"][1]
        assert e["elastic_default"] is None
        for name, why in [("elastic_hsdp", "2-D (HSDP) mesh"), ("elastic_subgroup", "mesh of a subgroup"),
                          ("elastic_reshard_k", "reshard_after_forward=k")]:
            assert e[name][0] == "ValueError" and f"rank {rank}: fully_shard unit" in e[name][1], (name, e[name])
            assert why in e[name][1] and "fully_shard over the default mesh (mesh=None)" in e[name][1], e[name]



def test_tandem_plan_predicts_what_hsdp_ranks_hold_and_send() -> None:
    report = _plan()
    row = report.strategies[-1]
    assert row.name == "HSDP 2x2"
    predicted = row.estimate
    traffic = dict(report.traffic)["HSDP 2x2"]
    for rank, r in enumerate(_results()):
        got: Held = r["held"]
        assert got.units == [(u.name, u.layout.shard_numel) for u in predicted.units], rank
        held = (got.params, got.grads, got.optimizer)
        want = (predicted.params, predicted.grads, predicted.optimizer)
        if rank % 2 == 0:   # shard rank 0 (global ranks 0 and 2) holds the largest chunks: byte for byte
            assert held == want, (rank, held, want)
        else:
            assert all(h <= w for h, w in zip(held, want)), (rank, held, want)
        # bytes sent in one step by ring algorithms, from the collectives recorded
        sent = {"all_gather_into": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}
        for op, numel, itemsize, _ in got.events:
            g = 2   # both groups have 2 ranks on the 2 x 2 mesh
            sent[op] += {"all_gather_into": (g - 1) * numel, "reduce_scatter": (g - 1) / g * numel,
                         "all_reduce": 2 * (g - 1) / g * numel}[op] * itemsize
        assert {k: round(v) for k, v in sent.items()} == {
            "all_gather_into": traffic.all_gather, "reduce_scatter": traffic.reduce_scatter,
            "all_reduce": traffic.all_reduce}, rank
        assert {kind for op, _, _, kind in got.events if op == "all_reduce"} == {"replicate"}


def test_accumulating_without_the_all_reduce_still_reduce_scatters_each_micro_batch() -> None:
    for rank, r in enumerate(_results()):
        once, no_sync = r["cases"]["all_reduce_once"], r["cases"]["accumulate"]
        for got, scatters in ((once, 2 * once.units), (no_sync, no_sync.units)):
            ops = [op for op, *_ in got.events]
            assert ops.count("reduce_scatter") == scatters and ops.count("all_reduce") == got.units, (rank, ops)


def test_a_bf16_policy_is_close_to_torchs_hsdp_and_differs_from_fp32() -> None:
    for rank, r in enumerate(_results()):
        ours, theirs, fp32 = r["cases"]["bf16"], r["cases"]["torch_bf16"], r["cases"]["adamw"]
        gap_to_torch, gap_to_fp32 = max_diff(ours.params, theirs.params), max_diff(ours.params, fp32.params)
        assert gap_to_torch <= 2e-3, (rank, gap_to_torch)
        assert gap_to_fp32 > 10 * gap_to_torch and gap_to_fp32 > 1e-4, (rank, gap_to_fp32, gap_to_torch)
        assert all(p.dtype == torch.float32 for p in ours.params.values())   # the shards stay fp32
