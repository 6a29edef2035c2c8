"""A fully_shard model laid out again over a new default group: what an elastic
job (Note [elastic trainer] in tandem/elastic/run.py) does to every unit when
its world changes, and the rows of a full tensor that this rank then keeps.

# Note [regrouped units]
After a rank dies (or a replacement joins) the default group is a new one of
another size, and every unit's layout (Note [unit buffers] in layout.py)
depends on the world size: a chunk of ``ceil(rows / world)`` rows, its padding,
the shard buffer's size. :func:`reset_process_group` lays every unit out again
for the new group, in place:

- the sharded parameters stay the same ``nn.Parameter`` objects, so that the
  optimizer's ``param_groups`` and its per-parameter ``state`` keys, a
  scheduler, and any reference the user holds stay valid. Each one's local
  tensor is pointed at its rows of the new shard buffer with ``set_`` (as Note
  [tiny units] in api.py moves shards), and its DTensor layout is replaced by
  one over the new mesh (same global shape and placement; :func:`tandem._compat.
  set_dtensor_spec`). Its ``.grad`` must be None (zero_grad first): a gradient
  of the old layout cannot be kept.
- the unsharded parameters are new objects over a new unsharded buffer, and
  the root's schedule is dropped: the next forward runs ``lazy_init`` again
  (schedule.py), which builds the reduce-scatter group over the new ranks and
  puts its gradient hooks on the new objects. The old ones, and the autograd
  graph of a step abandoned in its backward, hold only the old buffers.
- collectives of the old group still pending (a gather, a reduce-scatter of
  the abandoned step) are dropped, not waited on: their peers may be gone.

The new shards hold zeros: the caller loads the values, each rank its new
rows, from the old world's shards (the survivors' own and
their buddy copies: Note [elastic fully_shard] in
tandem/elastic/fsdp_shards.py) or from a checkpoint. Only the 1-D default mesh
is laid out again (not HSDP, tensor parallelism or a mesh of the caller's):
:func:`check_regroupable` says so before training starts.
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch import nn

from tandem._compat import clear_dtensor_sharding_cache
from tandem.comm.group import GroupComm
from tandem.fsdp.arguments import default_mesh
from tandem.fsdp.unit import ShardedUnit, unit_of

__all__ = ["check_regroupable", "reset_process_group", "units_of"]

logger = logging.getLogger(__name__)


def units_of(module: nn.Module) -> list[ShardedUnit]:
    """Every fully_shard unit under ``module``, in module order (the same on every rank)."""
    units: list[ShardedUnit] = []
    for m in module.modules():
        unit = unit_of(m)
        if unit is not None and unit not in units:
            units.append(unit)
    return units


def check_regroupable(module: nn.Module, rank: int) -> None:
    """Raise ValueError, naming the unit, when a unit of ``module`` cannot be laid
    out again over a new default group (Note [regrouped units])."""
    for unit in units_of(module):
        why = ("is sharded over a 2-D (HSDP) mesh" if unit.replicate_comm is not None else
               "has tensor-parallel parameters" if any(m.tp is not None for m in unit.params.managed) else
               "keeps a 1/k slice after forward (reshard_after_forward=k)"
               if not isinstance(unit.reshard_after_forward, bool) else
               "is sharded over a mesh of a subgroup" if unit.comm.size != dist.get_world_size() else None)
        if why is not None:
            raise ValueError(f"rank {rank}: fully_shard unit '{unit.name}' {why}; an elastic job lays "
                             "units out again over the new world's default group only: fully_shard over "
                             "the default mesh (mesh=None), without reshard_after_forward=k")


def reset_process_group(module: nn.Module) -> None:
    """Lay every unit under ``module`` (the root: the one whose forward runs
    first) out over the current default group, with zeros in the shards (Note
    [regrouped units]). No communication.

    Raises:
        RuntimeError: naming the parameter, when a sharded parameter still holds
            a gradient (call ``optimizer.zero_grad(set_to_none=True)`` first).
    """
    units = units_of(module)
    for unit in units:  # before any unit changes
        for m in unit.params.managed:
            if m.sharded.grad is not None:
                raise RuntimeError(f"rank {dist.get_rank()}: fully_shard parameter '{m.fqn}' still has a gradient "
                                   "as its unit is laid out again for a new world; call "
                                   "optimizer.zero_grad(set_to_none=True) before model.reset_process_group()")
    mesh = default_mesh()
    comm = GroupComm(mesh.get_group())
    clear_dtensor_sharding_cache()  # a new mesh may equal an old one (see there)
    for unit in units:
        _relayout(unit, mesh, comm)
    logger.info("fully_shard: %d unit(s) laid out again over %d rank(s)", len(units), comm.size)


def _relayout(unit: ShardedUnit, mesh: object, comm: GroupComm) -> None:
    unit.relayout(mesh, comm)  # pending collectives of the old group are dropped (Note [regrouped units])
