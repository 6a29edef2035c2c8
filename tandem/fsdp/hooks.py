"""The forward hooks fully_shard puts on each unit's module(s), and
:func:`lazy_init`, which the first of them to run calls: the first unit to run
forward becomes the root (as in torch's FSDP2) of every unit under it, which
get their process groups (Note [two groups]) and gradient hooks, and one
:class:`Schedule` drives them all.

# Note [two groups]
All-gathers and reduce-scatters go to two process groups over the same ranks.
Collectives are matched by their order of issue within a group, and the two
kinds interleave differently on different ranks as soon as one rank's
gradients arrive at another moment (a parameter it did not use, say). Within
each group the order is the same everywhere: gathers follow the units' forward
and backward order, which all ranks share, and reduce-scatters follow
:attr:`Schedule.reduce_order` (Note [reduce order] in schedule.py).

# Note [fully_shard under torch.compile]
Blocks may be compiled one by one, as torchtitan does with torch's FSDP2:
``torch.compile(block)`` before ``fully_shard`` (the compiled wrapper becomes
the unit's module), or after it (``torch.compile(sharded)`` or
``sharded.compile()``). Each block's forward is one graph, and a unit's
gathers and reductions run between graphs, where the hooks are: before
``fully_shard`` they are the compiled wrapper's hooks, which run outside its
graph; after it, dynamo meets them while tracing ``Module._call_impl``, so the
forward hooks are disabled for dynamo (torch's FSDP2 disables its own): they
gather through tandem's comm layer, and a collective traced into a graph would
bypass it. The backward hooks are run by the autograd engine, outside compiled
code. The graph reads the unit's ``unsharded`` parameters, the same objects at
every step (their storage is freed and allocated again), so one graph serves
every step and every block of a class.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch.distributed as dist
from torch import nn

from tandem._compat import not_traced
from tandem.comm.elastic_group import new_world_group
from tandem.comm.group import GroupComm
from tandem.fsdp.schedule import Schedule
from tandem.fsdp.unit import ShardedUnit, unit_of

__all__ = ["lazy_init", "post_forward", "pre_forward"]

logger = logging.getLogger(__name__)


@not_traced  # Note [fully_shard under torch.compile]
def pre_forward(unit: ShardedUnit, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The forward pre-hook of a unit's module."""
    schedule = unit.schedule if unit.schedule is not None else lazy_init(unit, module)
    return schedule.pre_forward(unit, args, kwargs)


@not_traced  # Note [fully_shard under torch.compile]
def post_forward(unit: ShardedUnit, module: nn.Module, args: tuple, output: Any) -> Any:
    """The forward hook of a unit's module."""
    assert unit.schedule is not None
    return unit.schedule.post_forward(unit, module, output)


def lazy_init(root: ShardedUnit, root_module: nn.Module) -> Schedule:
    """Make ``root`` the root of every unit under ``root_module`` (its first forward)."""
    if len(root.modules) > 1:
        names = ", ".join(type(m).__name__ for m in root.modules)
        raise RuntimeError(f"fully_shard: the unit of a list of modules ({names}) ran forward first, as the root; "
                           "a group cannot be the root (Note [grouped modules]): call fully_shard on the model "
                           "that contains them too, and run forward through it")
    units: list[ShardedUnit] = []
    for path, module in root_module.named_modules():
        unit = unit_of(module)
        if unit is None or unit in units:
            continue
        if unit.on_meta:
            rank = dist.get_rank() if dist.is_initialized() else 0
            fqns = [f"{path}.{m.fqn}" if path else m.fqn for m in unit.managed]
            raise RuntimeError(
                f"rank {rank}: fully_shard parameters are still on the meta device ({', '.join(fqns[:4])}"
                f"{', ...' if len(fqns) > 4 else ''}): call model.to_empty(device=...) and initialise them "
                "(the model's init_weights() under tandem.fsdp.init_like_unsharded(), or load a state dict) "
                "before the first forward")
        if unit.schedule is not None:
            raise RuntimeError(
                f"fully_shard: '{path}' already ran forward as a root of its own; run forward through "
                "the outermost fully_shard module first (it becomes the root of the units inside it)")
        unit.name = path or "<root>"
        units.append(unit)
    schedule = Schedule(root, units)
    if root.auto_reshard_after_forward:
        root.reshard_after_forward = False
    reduce_comms: dict[tuple[int, ...], GroupComm] = {}
    group_comms: dict[tuple[tuple[int, ...], int], GroupComm] = {}
    for unit in units:
        unit.schedule = schedule
        ranks = tuple(dist.get_process_group_ranks(unit.comm.group or dist.group.WORLD))
        if ranks not in reduce_comms:
            reduce_comms[ranks] = _second_group(ranks, unit.comm)
        unit.reduce_comm = reduce_comms[ranks]
        unit.guard_comms()
        k = unit.reshard_after_forward
        if not isinstance(k, bool):
            key = (ranks, k)
            if key not in group_comms:
                group_comms[key] = _subgroup(ranks, k, unit.comm.rank)
            unit.group_comm = group_comms[key]
        unit.params.watch_grads(functools.partial(schedule.on_grad, unit))
    logger.info("fully_shard: root with %d units, %d parameters, %d elements, world %d",
                len(units), sum(len(u.managed) for u in units), sum(u.layout.numel for u in units),
                root.comm.size)
    return schedule


def _second_group(ranks: tuple[int, ...], comm: GroupComm) -> GroupComm:
    """The reduce-scatter group (Note [two groups])."""
    if comm.size == 1:
        return comm
    if len(ranks) == dist.get_world_size():  # an elastic job's members wait for each other first
        return GroupComm(new_world_group("fully_shard reduce-scatters"))
    return GroupComm(dist.new_group(list(ranks), use_local_synchronization=True))


def _subgroup(ranks: tuple[int, ...], k: int, rank: int) -> GroupComm:
    """The group of ``k`` consecutive ranks holding this rank, for reshard_after_forward=k."""
    start = rank // k * k
    return GroupComm(dist.new_group(list(ranks[start:start + k]), use_local_synchronization=True))
