"""tandem.fully_shard (ZeRO-3) against torch's own fully_shard (FSDP2, which runs
on CPU/gloo without overlap) and against one process training on the global batch.

A grid of cases runs inside one spawned group per world size (2, and 3 where
shards are uneven); each case trains a small transformer-like model with AdamW
and clipping by global norm and returns what the tests compare: per-step losses,
final full parameters, the collectives issued, and the bytes each rank holds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tandem.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard, plan_unit
from tandem.fsdp.unit_state import ShardState
from tandem.testing import as_dtensor, as_fsdp, run_distributed, sharded_unit

D, V, SEQ, GLOBAL_BATCH = 20, 37, 5, 12   # odd sizes: shards of 3 ranks are uneven
TOL = 1e-5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 3 * D)
        self.fc2 = nn.Linear(3 * D, D)
        self.alt = nn.Linear(D, D)      # used by odd ranks only in the "branchy" cases
        self.unused = nn.Linear(D, 2)   # used by nobody in the "branchy" cases

    def forward(self, x: torch.Tensor, branch: int = 0) -> torch.Tensor:
        h = self.fc2(torch.tanh(self.fc1(self.norm(x))))
        if branch == 1:
            h = self.alt(h)
        return x + h


class Net(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(D, V)

    def forward(self, tokens: torch.Tensor, branch: int = 0) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.layers:
            h = block(h, branch)
        return self.head(h)


@dataclass(frozen=True)
class Case:
    impl: str = "tandem"                # "tandem" or "torch"
    reshard: bool | int | None = None   # reshard_after_forward for every unit (None: root keeps)
    micro: int = 1                      # micro-batches per step, all but the last without sync
    bf16: bool = False                  # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    offload: bool = False               # CPUOffloadPolicy (on CPU: shards stay where they are)
    branchy: bool = False               # odd ranks use Block.alt, nobody uses Block.unused
    min_unit_bytes: int = 0             # tandem only: 0 keeps torch's units
    steps: int = 3
    clip: float = 0.3
    groups: bool = True                 # two param groups (decay / no decay)


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    return (torch.randint(0, V, (GLOBAL_BATCH, SEQ), generator=g),
            torch.randint(0, V, (GLOBAL_BATCH, SEQ), generator=g))


def _loss(model: nn.Module, tokens: torch.Tensor, target: torch.Tensor, branch: int) -> torch.Tensor:
    logits = model(tokens, branch).float()
    return nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1).to(logits.device))


def _optimizer(model: nn.Module, case: Case) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    if not case.groups:
        return torch.optim.AdamW([p for _, p in named], lr=0.02)
    decay = [p for n, p in named if n.endswith("weight")]
    rest = [p for n, p in named if not n.endswith("weight")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=0.02)


def local_training(case: Case, world_size: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the global batch: the reference every case must equal."""
    torch.manual_seed(0)
    model = Net()
    opt = _optimizer(model, case)
    n = GLOBAL_BATCH // world_size
    losses = []
    for step in range(case.steps):
        total = 0.0
        for m in range(case.micro):
            tokens, target = _batch(step, m)
            parts = [_loss(model, tokens[r * n:(r + 1) * n], target[r * n:(r + 1) * n],
                           r % 2 if case.branchy else 0) for r in range(world_size)]
            loss = torch.stack(parts).mean() / case.micro
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@dataclass
class Outcome:
    losses: list[float]
    params: dict[str, torch.Tensor]
    events: list[tuple[str, str, int]] = field(default_factory=list)   # (op, tag, numel)
    param_bytes: int = 0        # distinct storages of the parameters held after a step
    optim_bytes: int = 0        # distinct storages of the optimizer state
    model_bytes: int = 0        # all parameters, full
    units: int = 0
    prefetched: list[str] = field(default_factory=list)  # layers.1's state when layers.0 ran (step 2)
    rs_before_last_gather: bool = False


def fully_shard_of(impl: str, **tandem_only: Any) -> Callable[..., Any]:
    """``impl``'s fully_shard ("tandem" or "torch"), with the arguments only
    tandem's takes (``min_unit_bytes``) given to tandem's."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        return torch_fully_shard
    return functools.partial(fully_shard, **tandem_only)


def shard(model: Net, case: Case) -> None:
    wrap = fully_shard_of(case.impl, min_unit_bytes=case.min_unit_bytes)
    kwargs: dict[str, Any] = {}
    if case.bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if case.reshard is not None:
        kwargs["reshard_after_forward"] = case.reshard
    if case.offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for block in model.layers:
        wrap(block, **kwargs)
    wrap(model, **kwargs)


def distributed(rank: int, world_size: int, case: Case) -> Outcome:
    torch.manual_seed(0)
    model = Net()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shard(model, case)
    opt = _optimizer(model, case)
    out = Outcome([], {}, model_bytes=model_bytes)
    units = tandem_units(model) if case.impl == "tandem" else []
    log: list[tuple[str, str, int]] = []
    step_holder = [0]
    if case.impl == "tandem" and len(units) > 1:
        nxt = sharded_unit(model.layers[1])
        model.get_submodule("layers.0.fc1").register_forward_pre_hook(
            lambda *_: out.prefetched.append(nxt.state.name) if step_holder[0] == 1 else None)
    for step in range(case.steps):
        step_holder[0] = step
        if step == 1:  # the reduce-scatter group exists from the first forward on
            comms = [c for u in units for c in (u.comm, u.reduce_comm, u.group_comm) if c is not None]
            for comm in {id(c): c for c in comms}.values():
                comm.observers.append(lambda e: log.append((e.op, e.tag, e.numel)))
        out.losses.append(train_step(model, opt, case, rank, world_size, step))
        if step == 1:
            out.events = list(log)
            log.clear()
    out.params = {k: v.full_tensor() for k, v in model.state_dict().items()}
    out.param_bytes = _distinct_bytes(as_dtensor(p).to_local() for p in model.parameters())
    out.optim_bytes = _distinct_bytes(v.to_local() if hasattr(v, "to_local") else v
                                      for s in opt.state.values() for k, v in s.items() if k != "step")
    out.units = len(units)
    if units:
        out.param_bytes += sum(u.params.unsharded_flat.untyped_storage().nbytes() for u in units)
        assert all(u.state is ShardState.SHARDED for u in units), [u.state for u in units]
    return out


def train_step(model: nn.Module, opt: torch.optim.Optimizer, case: Case, rank: int, world_size: int,
               step: int) -> float:
    """One optimizer step of a sharded model on this rank's part of the global batch;
    returns the global batch's mean loss."""
    n = GLOBAL_BATCH // world_size
    branch = rank % 2 if case.branchy else 0
    total: torch.Tensor | int = 0
    for m in range(case.micro):
        as_fsdp(model).set_requires_gradient_sync(m == case.micro - 1)
        tokens, target = _batch(step, m)
        loss = _loss(model, tokens[rank * n:(rank + 1) * n], target[rank * n:(rank + 1) * n], branch)
        (loss / case.micro).backward()
        total += loss.detach() / case.micro
    torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
    opt.step()
    opt.zero_grad()
    assert isinstance(total, torch.Tensor)
    dist.all_reduce(total)  # a tensor on the loss's device (CUDA for nccl)
    return total.item() / world_size


def tandem_units(model: nn.Module) -> list:
    units: list = []
    for m in model.modules():
        u = getattr(m, "_tandem_fsdp_unit", None)
        if u is not None and u not in units:
            units.append(u)
    return units


def _distinct_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


CASES = {
    "default": Case(),
    "torch": Case(impl="torch"),
    "reshard": Case(reshard=True),
    "no_reshard": Case(reshard=False),
    "accumulate": Case(micro=2),
    "torch_accumulate": Case(impl="torch", micro=2),
    "bf16": Case(bf16=True),
    "torch_bf16": Case(impl="torch", bf16=True),
    "branchy": Case(branchy=True),
    "merged": Case(min_unit_bytes=1 << 20),
    "offload": Case(offload=True),
}


def _grid(rank: int, world_size: int) -> dict[str, tuple[Outcome, tuple[list[float], dict[str, torch.Tensor]]]]:
    results = {}
    for name, case in CASES.items():
        local = local_training(case if not case.bf16 else Case(), world_size) if rank == 0 else ([], {})
        results[name] = (distributed(rank, world_size, case), local)
    return results if rank == 0 else {}


@functools.cache
def _results(world_size: int) -> dict:
    return run_distributed(_grid, world_size, timeout=240)[0]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


WORLDS = [2, 3]


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("name", ["default", "reshard", "no_reshard", "accumulate", "branchy", "merged", "offload"])
def test_equals_local_training_on_the_global_batch(world_size: int, name: str) -> None:
    got, (losses, params) = _results(world_size)[name]
    assert max(abs(a - b) for a, b in zip(got.losses, losses)) <= TOL, (got.losses, losses)
    assert max_diff(got.params, params) <= TOL


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("name,reference", [("default", "torch"), ("accumulate", "torch_accumulate")])
def test_equals_torch_fully_shard(world_size: int, name: str, reference: str) -> None:
    got, _ = _results(world_size)[name]
    ref, _ = _results(world_size)[reference]
    assert max(abs(a - b) for a, b in zip(got.losses, ref.losses)) <= TOL
    assert max_diff(got.params, ref.params) <= TOL


@pytest.mark.parametrize("world_size", WORLDS)
def test_bf16_policy_is_close_to_torch_and_differs_from_fp32(world_size: int) -> None:
    results = _results(world_size)
    ours, theirs, fp32 = results["bf16"][0], results["torch_bf16"][0], results["default"][0]
    gap_to_torch = max_diff(ours.params, theirs.params)
    gap_to_fp32 = max_diff(ours.params, fp32.params)
    assert gap_to_torch <= 2e-3, gap_to_torch
    assert gap_to_fp32 > 10 * gap_to_torch and gap_to_fp32 > 1e-4, (gap_to_fp32, gap_to_torch)
    assert all(p.dtype == torch.float32 for p in ours.params.values())  # shards stay fp32


@pytest.mark.parametrize("world_size", WORLDS)
def test_held_bytes_are_one_nth_of_the_model(world_size: int) -> None:
    for name in ("default", "no_reshard", "merged"):
        got, _ = _results(world_size)[name]
        bound = 1.10 * got.model_bytes / world_size + 64 * 1024
        assert got.param_bytes <= bound, (name, got.param_bytes, bound)
        # AdamW: two moments per element
        assert got.optim_bytes <= 2 * bound, (name, got.optim_bytes, bound)
        assert got.param_bytes < got.model_bytes / world_size * 1.5


def _traffic(events: list[tuple[str, str, int]], world_size: int) -> float:
    """Bytes a rank sends in ring algorithms: an all-gather (w-1) inputs, a
    reduce-scatter (w-1)/w of its input."""
    total = 0.0
    for op, _, numel in events:
        if op == "all_gather_into":
            total += (world_size - 1) * numel
        elif op == "reduce_scatter":
            total += (world_size - 1) / world_size * numel
    return total


@pytest.mark.parametrize("world_size", WORLDS)
def test_collectives_counts_and_bytes_against_ddp(world_size: int) -> None:
    results = _results(world_size)
    numel = sum(t.numel() for t in results["default"][0].params.values())
    ddp = 2 * (world_size - 1) / world_size * numel   # one ring all-reduce of every gradient
    reshard, keep = results["reshard"][0], results["no_reshard"][0]
    units = reshard.units
    ops = [op for op, _, _ in reshard.events]
    assert ops.count("all_gather_into") == 2 * units and ops.count("reduce_scatter") == units
    ops = [op for op, _, _ in keep.events]
    assert ops.count("all_gather_into") == units and ops.count("reduce_scatter") == units
    assert 1.45 <= _traffic(reshard.events, world_size) / ddp <= 1.65
    assert 0.95 <= _traffic(keep.events, world_size) / ddp <= 1.15


@pytest.mark.parametrize("world_size", WORLDS)
def test_gathers_prefetch_and_reductions_overlap_backward(world_size: int) -> None:
    got, _ = _results(world_size)["reshard"]
    # When layers.0 computes in step 2, layers.1's gather was already launched.
    assert got.prefetched and got.prefetched[0] in ("GATHERING", "UNSHARDED"), got.prefetched
    # The first reduce-scatter is launched before backward's last gather: during backward.
    ops = [op for op, _, _ in got.events]
    last_gather = len(ops) - 1 - ops[::-1].index("all_gather_into")
    assert ops.index("reduce_scatter") < last_gather


def test_tiny_units_merge_into_the_enclosing_unit() -> None:
    got, _ = _results(2)["merged"]
    assert got.units == 1
    assert _results(2)["default"][0].units == 4


# ---------------------------------------------------------------------- layout (pure)

@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_layout_reassembles_every_parameter(world_size: int) -> None:
    shapes = [(7, 3), (1,), (4,), (2, 5, 2), (13,), (3, 3)]
    params = [torch.randn(s) for s in shapes]
    layouts = [plan_unit(shapes, world_size, r) for r in range(world_size)]
    assert len({lay.shard_numel for lay in layouts}) == 1
    gathered = torch.cat([_shard_buffer(params, lay) for lay in layouts])   # what all-gather yields
    for k, p in enumerate(params):
        spec = layouts[0].params[k]
        chunks = gathered.view(world_size, -1)[:, spec.shard_offset:spec.shard_offset + spec.chunk_numel]
        assert torch.equal(chunks.reshape(-1)[:p.numel()].view(p.shape), p)
        # the local rows are torch.chunk's (what DTensor's Shard(0) expects)
        expected = list(torch.chunk(p, world_size, dim=0)) + [p[:0]] * world_size
        for r, lay in enumerate(layouts):
            assert lay.params[k].local_shape == tuple(expected[r].shape)


def _shard_buffer(params: list[torch.Tensor], layout) -> torch.Tensor:
    buf = torch.zeros(layout.shard_numel)
    for p, spec in zip(params, layout.params):
        rows = p.reshape(p.shape[0], -1)[spec.row_start:spec.row_start + spec.local_rows]
        buf[spec.shard_offset:spec.shard_offset + spec.local_numel] = rows.reshape(-1)
    return buf


def test_layout_rejects_scalars_and_bad_ranks() -> None:
    with pytest.raises(ValueError, match="0-dimensional"):
        plan_unit([(3,), ()], 2, 0)
    with pytest.raises(ValueError, match="rank must be in"):
        plan_unit([(3,)], 2, 2)
    assert math.prod(plan_unit([(5, 4)], 3, 2).params[0].local_shape) == 4
