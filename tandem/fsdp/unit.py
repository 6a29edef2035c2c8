"""One fully_shard unit at run time: its parameters and buffers, the all-gather
that unshards them and the reduce-scatter that shards its gradients, each as a
launch/wait pair with an explicit state.

Life of a unit in one step (with ``reshard_after_forward=True``)::

    SHARDED --launch_gather--> GATHERING --wait_gather--> UNSHARDED   (pre-forward)
    UNSHARDED --reshard--> SHARDED                                    (post-forward)
    SHARDED --...--> UNSHARDED                                        (pre-backward)
    gradients arrive; reduce: IDLE -> READY --launch_reduce--> IN_FLIGHT
    UNSHARDED --reshard--> SHARDED                                    (post-backward)
    IN_FLIGHT --advance_reduce--> IDLE: sharded .grad set             (end of backward)
    HSDP: IN_FLIGHT --advance_reduce--> ALL_REDUCING --advance_reduce--> IDLE

A :class:`ShardedUnit` is the schedule's handle on three collaborators, each
owning its state:

- :class:`~tandem.fsdp.unit_params.UnitParams` (unit_params.py): the buffers,
  the parameters in both forms, the dtypes, the layout;
- :class:`~tandem.fsdp.unit_gather.UnitGather` (unit_gather.py): gather and
  release, the ``ShardState`` and the gather in flight;
- :class:`~tandem.fsdp.unit_reduce.UnitReduce` (unit_reduce.py): the
  gradients' reduction, the ``ReduceState`` and the stages in flight (Notes
  [gradient flags] and [hybrid sharding]).

The unit itself holds what the schedule and ``FSDPModule``'s setters decide:
the groups, the per-step toggles and the counters of the iteration, and hands
them to its collaborators' calls.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.comm.failure_gate import FailureGate
from tandem.comm.group import GroupComm
from tandem.fsdp.layout import ParamShard, UnitLayout
from tandem.fsdp.tensor_parallel import TensorParallelParam
from tandem.fsdp.unit_gather import UnitGather
from tandem.fsdp.unit_params import UnitParams
from tandem.fsdp.unit_reduce import UnitReduce
from tandem.fsdp.unit_state import CommOverrides, ManagedParam, ReduceState, ShardState, UnitConfig, UnitPhase
from tandem.fsdp.unit_walk import ParamEntry

__all__ = ["UNIT_ATTR", "ShardedUnit", "unit_of"]

UNIT_ATTR = "_tandem_fsdp_unit"  # the attribute a fully_shard module holds its unit in


class ShardedUnit:
    """The parameters of one ``fully_shard`` call, each sharded on its dim (0
    unless ``shard_placement_fn`` said otherwise) across ``comm``, the shard
    group (Note [hybrid sharding] in unit_reduce.py)."""

    def __init__(self, name: str, params: list[ParamEntry], mesh: Any, comm: GroupComm,
                 config: UnitConfig, tp: list[TensorParallelParam | None] | None = None,
                 replicate_comm: GroupComm | None = None, shard_dims: list[int] | None = None) -> None:
        # The mesh: 1-D, or 2-D (replicate, shard): Note [hybrid sharding] in unit_reduce.py.
        self.mesh = mesh
        self.comm = comm                      # all-gathers: the shard group
        self.replicate_comm = replicate_comm  # HSDP: all-reduces of the reduced shards
        self.reduce_comm: GroupComm = comm    # reduce-scatters (a second group, set by the schedule)
        self.group_comm: GroupComm | None = None  # reshard_after_forward=k
        self.gate: FailureGate | None = None  # Note [a broken step goes on] in tandem/comm/failure_gate.py
        self.config = config
        self.overrides = CommOverrides()
        self.params = UnitParams(name, params, mesh, comm, config, tp, hybrid=replicate_comm is not None,
                                 shard_dims=shard_dims)
        self.gather = UnitGather(self.params)
        self.reduction = UnitReduce(self.params, self.overrides)
        self.applying = False  # inside FSDPModule._apply of the module that owns it (module.py)
        self.phase = UnitPhase.IDLE
        self.forward_calls = 0      # this iteration (Note [unit completion] in schedule.py)
        self.untracked_calls = 0    # calls whose inputs need no gradient
        self.inputs_done = 0        # calls whose backward is over
        # Per-step toggles, set through FSDPModule's methods; the schedule reads them.
        self.reshard_after_forward: bool | int = True
        self.auto_reshard_after_forward = False  # None was given: the root keeps its parameters
        self.reshard_after_backward = True
        self.requires_grad_sync = True
        self.requires_all_reduce = True   # Note [hybrid sharding] in unit_reduce.py
        self.unshard_in_backward = True   # False: backward needs no parameter values (an embedding)
        self.reduce_scatter_unused_params = False  # zeros, not None, for a gradient no rank produced
        # set_reduce_scatter_max_input_buffers; None: by the backend (Note [reductions in flight] in schedule.py)
        self.max_reduce_buffers: int | None = None
        self.divide_factor: float | None = None
        self.schedule: Any = None  # the root's Schedule, set at the root's first forward
        self.modules: tuple[nn.Module, ...] = ()  # the module(s) fully_shard was called on
        self.pending_forward: set[int] = set()    # ids of modules of the group yet to run forward
        self.mergeable = False                # below min_unit_bytes (Note [tiny units] in api.py)
        self.hooks: list[Any] = []            # its module hooks, removed if it is absorbed
        # The units whose gathers this one launches (set_modules_to_*_prefetch; Note
        # [prefetch] in schedule.py); None: the neighbours of the last iteration.
        self.forward_prefetch: list[ShardedUnit] | None = None
        self.backward_prefetch: list[ShardedUnit] | None = None

    # ------------------------------------------------------------------ its parameters
    @property
    def name(self) -> str:
        """The unit's path in the model (the root's lazy init names it: schedule.py),
        which its collectives' tags and its errors carry."""
        return self.params.name

    @name.setter
    def name(self, value: str) -> None:
        self.params.name = value

    @property
    def layout(self) -> UnitLayout:
        return self.params.layout

    @property
    def managed(self) -> list[ManagedParam]:
        return self.params.managed

    @property
    def shard_flat(self) -> torch.Tensor:
        return self.params.shard_flat

    @property
    def unsharded_flat(self) -> torch.Tensor:
        return self.params.unsharded_flat

    @property
    def orig_dtype(self) -> torch.dtype:
        return self.params.orig_dtype

    @property
    def param_dtype(self) -> torch.dtype:
        return self.params.param_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.params.reduce_dtype

    @property
    def on_meta(self) -> bool:
        """Built from meta parameters and not given memory yet (``to_empty``)."""
        return self.params.on_meta

    @property
    def num_trainable(self) -> int:
        return self.params.num_trainable

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks whose gradients a reduction averages: the shard
        group's, times the replicate group's under HSDP."""
        return self.comm.size * (self.replicate_comm.size if self.replicate_comm is not None else 1)

    def to_dtensor(self, local: torch.Tensor, spec: ParamShard,
                   tp: TensorParallelParam | None = None) -> torch.Tensor:
        return self.params.to_dtensor(local, spec, tp)

    def register_sharded(self) -> None:
        """Register the sharded parameters (for ``state_dict``) without freeing anything."""
        self.params.register(unsharded=False)

    def rebuild_unsharded(self) -> None:
        self.params.rebuild_unsharded()

    # ------------------------------------------------------------------ gather and release
    @property
    def state(self) -> ShardState:
        return self.gather.state

    def launch_gather(self) -> None:
        """Start the all-gather of the full parameters (async)."""
        self.gather.launch(self.comm, self.group_comm, self.overrides)

    def wait_gather(self) -> None:
        """Finish the all-gather and register the full parameters on the modules."""
        self.gather.wait()

    def unshard(self) -> None:
        """Make the full parameters available and registered now."""
        self.gather.unshard(self.comm, self.group_comm, self.overrides)

    def reshard(self, keep_group_shard: bool = False) -> None:
        """Free the full parameters and register the sharded ones again (keep a
        1/k slice with ``keep_group_shard``, for ``reshard_after_forward=k``)."""
        self.gather.reshard(self.group_comm, keep_group_shard)

    # ------------------------------------------------------------------ the gradients' reduction
    @property
    def reduce_state(self) -> ReduceState:
        return self.reduction.state

    @property
    def num_ready(self) -> int:
        return self.reduction.num_ready

    @property
    def completed(self) -> bool:
        """This backward is over for the unit (Note [unit completion] in schedule.py)."""
        return self.reduction.completed

    def grad_ready(self) -> bool:
        """Count one arrived gradient; True when all trainable ones have."""
        return self.reduction.grad_ready()

    def mark_ready(self) -> None:
        """This backward is over for the unit: queue its reduction (once per backward)."""
        self.reduction.mark_ready()

    def reset_step(self) -> None:
        self.reduction.reset_step()

    def launch_reduce(self) -> None:
        """Reduce-scatter the unsharded gradients (Note [gradient flags]) and free them."""
        self.reduction.launch(self.reduce_comm)

    @property
    def reduce_buffers(self) -> int:
        """The most reduce-scatters in flight once this unit's has launched, each
        holding its full-size input (Note [reductions in flight] in schedule.py)."""
        if self.max_reduce_buffers is not None:
            return self.max_reduce_buffers
        return 2 if self.reduce_comm.wait_blocks_host(self.config.device) else 1

    @property
    def reduce_done(self) -> bool:
        return self.reduction.done

    @property
    def reducing(self) -> bool:
        return self.reduction.reducing

    def advance_reduce(self, divide_factor: float) -> None:
        """Finish the reduction's current stage (waiting for it)."""
        self.reduction.advance(divide_factor, self.replicate_comm, all_reduce=self.requires_all_reduce,
                               unused_params=self.reduce_scatter_unused_params)

    def finish_reduce(self, divide_factor: float) -> None:
        """Finish every stage of the reduction in flight (waiting for them)."""
        while self.reducing:
            self.advance_reduce(divide_factor)

    def wait_host_grads(self) -> None:
        """Wait for the gradients' copies to the host (Note [gradients to the host] in unit_reduce.py)."""
        self.reduction.wait_host_grads()

    def skip_reduce(self) -> None:
        """Gradient sync is off: keep the unsharded gradients (Note [accumulation dtype])."""
        self.reduction.skip()

    def discard_reduce(self) -> None:
        """Drop this iteration's gradients (FSDPModule.reset_iter_state)."""
        self.reduction.discard()

    # ------------------------------------------------------------------ a new world
    def guard_comms(self) -> None:
        """Put this unit's gate on each of its groups (Note [a broken step goes on]
        in tandem/comm/failure_gate.py): after its groups change, or its gate."""
        for comm in (self.comm, self.reduce_comm, self.group_comm, self.replicate_comm):
            if comm is not None:
                comm.gate = self.gate

    def relayout(self, mesh: Any, comm: GroupComm) -> None:
        """Go on over ``comm`` (Note [regrouped units] in regroup.py): a new layout
        of the same parameters; pending collectives of the old group are dropped,
        and the next forward runs lazy_init over the new group."""
        self.mesh, self.comm, self.reduce_comm, self.group_comm = mesh, comm, comm, None
        if self.gate is not None:
            self.gate.reopen()  # Note [a broken step goes on] in tandem/comm/failure_gate.py
        self.guard_comms()
        self.params.relayout(mesh, comm)
        self.gather = UnitGather(self.params)
        self.reduction = UnitReduce(self.params, self.overrides)
        self.phase = UnitPhase.IDLE
        self.forward_calls = self.untracked_calls = self.inputs_done = 0
        self.pending_forward = set()
        self.schedule = None

    def __repr__(self) -> str:
        return (f"ShardedUnit('{self.name}', {len(self.managed)} params, {self.layout.numel} elements, "
                f"{self.state.name})")


def unit_of(module: nn.Module) -> ShardedUnit | None:
    return getattr(module, UNIT_ATTR, None)
