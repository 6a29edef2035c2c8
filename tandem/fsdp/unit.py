"""One fully_shard unit at run time: its buffers (Note [unit buffers] in
layout.py), the all-gather that unshards it and the reduce-scatter that shards
its gradients, each as a launch/wait pair with an explicit state.

Life of a unit in one step (with ``reshard_after_forward=True``)::

    SHARDED --launch_gather--> GATHERING --wait_gather--> UNSHARDED   (pre-forward)
    UNSHARDED --reshard--> SHARDED                                    (post-forward)
    SHARDED --...--> UNSHARDED                                        (pre-backward)
    gradients arrive; reduce: IDLE -> READY --launch_reduce--> IN_FLIGHT
    UNSHARDED --reshard--> SHARDED                                    (post-backward)
    IN_FLIGHT --advance_reduce--> IDLE: sharded .grad set             (end of backward)
    HSDP: IN_FLIGHT --advance_reduce--> ALL_REDUCING --advance_reduce--> IDLE

A :class:`ShardedUnit` is its state and two independent halves, one file each:

- unit_state.py: the states, the parameters in both forms, the buffers;
- unit_gather.py: gather and release (the ``ShardState`` transitions);
- unit_reduce.py: the gradients' reduction (the ``ReduceState`` transitions,
  Notes [gradient flags] and [hybrid sharding]).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tandem.comm.group import GroupComm
from tandem.fsdp.tensor_parallel import TensorParallelParam
from tandem.fsdp.unit_gather import UnitGather
from tandem.fsdp.unit_reduce import UnitReduce
from tandem.fsdp.unit_state import UnitConfig
from tandem.fsdp.unit_walk import ParamEntry

__all__ = ["UNIT_ATTR", "ShardedUnit", "unit_of"]

UNIT_ATTR = "_tandem_fsdp_unit"  # the attribute a fully_shard module holds its unit in


class ShardedUnit(UnitGather, UnitReduce):
    """The parameters of one ``fully_shard`` call, each sharded on its dim (0
    unless ``shard_placement_fn`` said otherwise) across ``comm``, the shard
    group (Note [hybrid sharding] in unit_reduce.py)."""

    def __init__(self, name: str, params: list[ParamEntry], mesh: Any, comm: GroupComm,
                 config: UnitConfig, tp: list[TensorParallelParam | None] | None = None,
                 replicate_comm: GroupComm | None = None, shard_dims: list[int] | None = None) -> None:
        super().__init__(name, params, mesh, comm, config, tp, replicate_comm, shard_dims)
        # The units whose gathers this one launches (set_modules_to_*_prefetch; Note
        # [prefetch] in schedule.py); None: the neighbours of the last iteration.
        self.forward_prefetch: list[ShardedUnit] | None = None
        self.backward_prefetch: list[ShardedUnit] | None = None


def unit_of(module: nn.Module) -> ShardedUnit | None:
    return getattr(module, UNIT_ATTR, None)
