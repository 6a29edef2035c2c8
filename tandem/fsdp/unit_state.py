"""What a fully_shard unit is made of: its states (one enum per dimension), its
parameters in both forms (:class:`ManagedParam`: the sharded DTensor and the
unsharded view), the shard and unsharded buffers (Note [unit buffers] in
layout.py), and how either form is registered on the modules. The first layer
of :class:`tandem.fsdp.unit.ShardedUnit`; unit_gather.py and unit_reduce.py
move it between the states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch
from torch import nn

from tandem._compat import dtensor_api, dtensor_local
from tandem.comm.group import GroupComm, Work
from tandem.fsdp.layout import ParamShard, UnitLayout, plan_unit
from tandem.fsdp.tensor_parallel import TensorParallelParam
from tandem.fsdp.unit_walk import ParamEntry

__all__ = ["CommOverrides", "ManagedParam", "PendingGather", "PendingReduce", "ReduceState", "ShardState",
           "UnitPhase", "UnitConfig", "UnitState"]


class ShardState(Enum):
    SHARDED = auto()        # only this rank's shard exists; sharded parameters registered
    GATHERING = auto()      # all-gather launched, not yet waited on
    UNSHARDED = auto()      # full parameters in the unsharded buffer, registered on the modules
    GROUP_SHARDED = auto()  # reshard_after_forward=k: a 1/k slice of the full buffer kept


class ReduceState(Enum):
    IDLE = auto()        # no reduction pending in this backward
    READY = auto()          # every gradient of this backward arrived (or backward ended)
    IN_FLIGHT = auto()      # reduce-scatter launched, not yet finished
    ALL_REDUCING = auto()   # HSDP: the shard's all-reduce over the replicate group launched


class UnitPhase(Enum):
    """Where a unit is in its iteration (not torch's ``module.training``, nor tandem's TrainingState)."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()   # its backward has started (a forward now is a recomputation)


@dataclass
class ManagedParam:
    """One parameter of a unit, in both of its forms."""

    fqn: str                               # name under the module given to fully_shard
    owners: list[tuple[nn.Module, str]]    # (module, attribute) holding it; tied: several
    spec: ParamShard
    sharded: nn.Parameter                  # DTensor, Shard(0): a view of the shard buffer
    unsharded: nn.Parameter                # a view of the unsharded buffer
    requires_grad: bool
    tp: TensorParallelParam | None = None  # Note [2-D parameters] in tensor_parallel.py
    # Gradients of backwards without sync, kept in reduce_dtype (Note [accumulation dtype] in unit_reduce.py).
    accumulated: torch.Tensor | None = None


@dataclass(frozen=True)
class UnitConfig:
    """How one unit gathers, reduces and keeps its parameters (fully_shard's arguments)."""

    device: torch.device                # where forward and the collectives run
    shard_device: torch.device          # where the shards live (CPU with CPUOffloadPolicy)
    param_dtype: torch.dtype | None     # MixedPrecisionPolicy.param_dtype
    reduce_dtype: torch.dtype | None    # MixedPrecisionPolicy.reduce_dtype
    pin_memory: bool                    # pin the offloaded shards (CUDA only)
    cast_forward_inputs: bool = True    # MixedPrecisionPolicy.cast_forward_inputs
    output_dtype: torch.dtype | None = None  # MixedPrecisionPolicy.output_dtype


@dataclass
class CommOverrides:
    """What FSDPModule's setters change in a unit's collectives (torch's FSDP2 names)."""

    all_gather: Any = None         # set_custom_all_gather: torch's AllGather (allocate, __call__)
    reduce_scatter: Any = None     # set_custom_reduce_scatter: torch's ReduceScatter
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None  # set_all_reduce_hook
    force_sum: bool = False        # set_force_sum_reduction_for_comms: the hook sees sums, not means
    gather_after: Any = None       # set_post_optim_event: the root's next gathers wait for it, once

    def allocate(self, comm: Any, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer for a collective: from the custom one's ``allocate`` if it has one."""
        if comm is not None:
            return comm.allocate((numel,), dtype=dtype, device=device)
        return torch.empty(numel, dtype=dtype, device=device)


@dataclass
class PendingGather:
    """An all-gather in flight (unit_gather.py)."""

    work: Work
    output: torch.Tensor
    input: torch.Tensor     # kept alive until the collective completes
    direct: bool            # the output is parameter-major already (one plain copy)


@dataclass
class PendingReduce:
    """A reduction stage in flight (unit_reduce.py)."""

    work: Work
    output: torch.Tensor
    input: torch.Tensor


class UnitState:
    """A unit's state, parameters and buffers (the first layer of :class:`ShardedUnit`)."""

    def __init__(self, name: str, params: list[ParamEntry], mesh: Any, comm: GroupComm,
                 config: UnitConfig, tp: list[TensorParallelParam | None] | None = None,
                 replicate_comm: GroupComm | None = None, shard_dims: list[int] | None = None) -> None:
        self.name = name
        # The mesh: 1-D, or 2-D (replicate, shard): Note [hybrid sharding] in unit_reduce.py.
        self.mesh = mesh
        self.comm = comm                      # all-gathers: the shard group
        self.replicate_comm = replicate_comm  # HSDP: all-reduces of the reduced shards
        self.reduce_comm: GroupComm = comm    # reduce-scatters (a second group, set by the schedule)
        self.group_comm: GroupComm | None = None  # reshard_after_forward=k
        self.config = config
        self.orig_dtype = _uniform_dtype(name, params)
        self.param_dtype = config.param_dtype or self.orig_dtype
        self.reduce_dtype = config.reduce_dtype or self.param_dtype
        # Note [2-D parameters] in tensor_parallel.py: a tensor-parallel parameter is sharded as its local tensor.
        tp = tp if tp is not None else [None] * len(params)
        shapes = [t.local_shape if t is not None else tuple(p.shape) for (_, _, p), t in zip(params, tp)]
        self.layout: UnitLayout = plan_unit(shapes, comm.size, comm.rank, shard_dims)
        # Note [meta init] in api.py: a unit of meta parameters gets its memory in to_empty.
        meta = bool(params) and all(p.is_meta for _, _, p in params) and all(t is None for t in tp)
        self.shard_flat = self._new_shard_buffer(meta)
        self.unsharded_flat = self._new_unsharded_buffer(meta)
        self.managed = [self._manage(fqn, owners, param, spec, t)
                        for (fqn, owners, param), spec, t in zip(params, self.layout.params, tp)]
        comm.ledger.describe_params(f"unit {name}", [fqn for fqn, _, _ in params])
        self._copy_out_dst = self._copy_out_views()
        self._free_unsharded()  # views are made first: a view of a freed storage fails its bounds check
        self.state = ShardState.SHARDED
        self.applying = False  # inside FSDPModule._apply of the module that owns it (module.py)
        self.reduce_state = ReduceState.IDLE
        self.phase = UnitPhase.IDLE
        self._gather: PendingGather | None = None
        self._reduce: PendingReduce | None = None
        self._group_shard: torch.Tensor | None = None
        self.num_trainable = sum(m.requires_grad for m in self.managed)
        self.num_ready = 0
        self.completed = False      # this backward (Note [unit completion] in schedule.py)
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
        self.max_reduce_buffers = 2       # Note [two reductions in flight] in schedule.py
        self.overrides = CommOverrides()
        self._partial: torch.Tensor | None = None
        self._all_local = True  # this rank had every gradient in its last reduce-scatter (unit_reduce.py)
        self.divide_factor: float | None = None
        self.schedule: Any = None  # the root's Schedule, set at the root's first forward
        self.modules: tuple[nn.Module, ...] = ()  # the module(s) fully_shard was called on
        self.pending_forward: set[int] = set()    # ids of modules of the group yet to run forward
        self.mergeable = False                # below min_unit_bytes (Note [tiny units] in api.py)
        self.hooks: list[Any] = []            # its module hooks, removed if it is absorbed
        self._register(unsharded=False)

    # ------------------------------------------------------------------ set-up
    def _new_shard_buffer(self, meta: bool = False) -> torch.Tensor:
        device = torch.device("meta") if meta else self.config.shard_device
        buf = torch.zeros(self.layout.shard_numel, dtype=self.orig_dtype, device=device)
        if self.config.pin_memory and torch.cuda.is_available() and not meta:
            buf = buf.pin_memory()
        return buf

    def _new_unsharded_buffer(self, meta: bool = False) -> torch.Tensor:
        device = torch.device("meta") if meta else self.config.device
        return torch.empty(self.layout.unsharded_numel, dtype=self.param_dtype, device=device)

    @property
    def on_meta(self) -> bool:
        """Built from meta parameters and not given memory yet (``to_empty``)."""
        return self.shard_flat.is_meta

    def _copy_out_views(self) -> list[torch.Tensor]:
        """Each parameter's padded chunks in the unsharded buffer, one row per rank
        (rank-major blocks for a parameter sharded on another dim than 0)."""
        world = self.layout.world_size
        return [self._blocks(self.unsharded_flat.narrow(0, p.unsharded_offset, p.numel), p) if p.shard_dim
                else self.unsharded_flat.narrow(0, p.unsharded_offset, world * p.chunk_numel).view(world, -1)
                for p in self.layout.params]

    def _manage(self, fqn: str, owners: list[tuple[nn.Module, str]], param: nn.Parameter,
                spec: ParamShard, tp: TensorParallelParam | None) -> ManagedParam:
        local = self.shard_flat.narrow(0, spec.shard_offset, spec.local_numel).view(spec.local_shape)
        DTensor, _, _ = dtensor_api()
        # An absorbed tiny unit's shard is a DTensor over this mesh, or over the
        # 2-D one of its tensor-parallel layout; a tensor-parallel parameter not yet
        # sharded is a DTensor over mesh["tp"] (Note [2-D parameters] in tensor_parallel.py).
        if isinstance(param, DTensor) and (tp is None or param.device_mesh is tp.sharded_mesh):
            # A parameter of an absorbed tiny unit (Note [tiny units] in api.py): its
            # local rows move into this buffer, and the parameter object stays.
            with torch.no_grad():
                old = dtensor_local(param)
                local.copy_(old)
                old.set_(local.untyped_storage(), local.storage_offset(), local.shape, local.stride())
            sharded: nn.Parameter = param
        else:
            # A plain parameter, or a tensor-parallel one: its local tensor is what this unit shards.
            full = param.detach() if tp is None else dtensor_local(param)
            if not full.is_meta:  # meta: values come later (Note [meta init] in api.py)
                with torch.no_grad():
                    local.copy_(full.narrow(spec.shard_dim, spec.row_start, spec.local_rows))
            sharded = nn.Parameter(self.to_dtensor(local, spec, tp), requires_grad=param.requires_grad)
        view = self.unsharded_flat.narrow(0, spec.unsharded_offset, spec.numel).view(spec.shape)
        full = view if tp is None else tp.unsharded(view)
        unsharded = nn.Parameter(full, requires_grad=param.requires_grad)
        return ManagedParam(fqn, owners, spec, sharded, unsharded, param.requires_grad, tp)

    def to_dtensor(self, local: torch.Tensor, spec: ParamShard,
                   tp: TensorParallelParam | None = None) -> torch.Tensor:
        """``local`` (this rank's rows of the parameter ``spec``) as a Shard(0)
        DTensor (over the 2-D mesh for a tensor-parallel parameter)."""
        if tp is not None:
            return tp.sharded(local)
        DTensor, Shard, Replicate = dtensor_api()
        shape = torch.Size(spec.shape)
        placements: tuple[Any, ...] = (Shard(spec.shard_dim),)
        if self.replicate_comm is not None:  # Note [hybrid sharding] in unit_reduce.py
            placements = (Replicate(), Shard(spec.shard_dim))
        with torch.no_grad():
            return DTensor.from_local(local, self.mesh, placements, run_check=False, shape=shape,
                                      stride=_contiguous_strides(shape))

    def _blocks(self, full: torch.Tensor, spec: ParamShard) -> torch.Tensor:
        """The rank-major view ``(world, *local_shape)`` of a parameter (or its
        gradient) sharded on a dim other than 0 (Note [unit buffers] in layout.py)."""
        d, world = spec.shard_dim, self.layout.world_size
        shape = (*spec.shape[:d], world, spec.chunk_rows, *spec.shape[d + 1:])
        return full.reshape(shape).movedim(d, 0)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks whose gradients a reduction averages: the shard
        group's, times the replicate group's under HSDP."""
        return self.comm.size * (self.replicate_comm.size if self.replicate_comm is not None else 1)

    def register_sharded(self) -> None:
        """Register the sharded parameters (for ``state_dict``) without freeing anything."""
        self._register(unsharded=False)

    def _register(self, unsharded: bool) -> None:
        for m in self.managed:
            param = m.unsharded if unsharded else m.sharded
            for module, attr in m.owners:
                module._parameters[attr] = param

    def _alloc_unsharded(self) -> None:
        storage = self.unsharded_flat.untyped_storage()
        nbytes = self.unsharded_flat.numel() * self.unsharded_flat.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def _free_unsharded(self) -> None:
        self.unsharded_flat.untyped_storage().resize_(0)

    # ------------------------------------------------------------------ checks
    def _expect(self, *allowed: ShardState) -> None:
        if self.state not in allowed:
            raise RuntimeError(f"fully_shard unit '{self.name}' is {self.state.name}, expected "
                               f"{'/'.join(s.name for s in allowed)}")

    def _expect_reduce(self, *allowed: ReduceState) -> None:
        if self.reduce_state not in allowed:
            raise RuntimeError(
                f"fully_shard unit '{self.name}': gradient reduction is {self.reduce_state.name}, expected "
                f"{'/'.join(s.name for s in allowed)} ({self.num_ready}/{self.num_trainable} gradients ready)")

    def __repr__(self) -> str:
        return (f"ShardedUnit('{self.name}', {len(self.managed)} params, {self.layout.numel} elements, "
                f"{self.state.name})")


def _uniform_dtype(name: str, params: list[ParamEntry]) -> torch.dtype:
    dtypes = {p.dtype for _, _, p in params}
    if not dtypes:
        return torch.get_default_dtype()
    if len(dtypes) > 1:
        listing = ", ".join(f"{fqn}: {p.dtype}" for fqn, _, p in params)
        raise ValueError(f"fully_shard unit '{name}' mixes parameter dtypes ({listing}); one collective "
                         "gathers a unit, so its parameters need one dtype: call fully_shard on the "
                         "submodules of each dtype separately, or cast the model first")
    return dtypes.pop()


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(1, s)
    return tuple(reversed(strides))
