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

# Note [gradient flags]
Ranks may use different parameters of a unit in one step (rank-dependent
control flow). Every rank therefore reduce-scatters every parameter of the
unit, with zeros where it has no gradient, so that all ranks issue the same
collectives; and each rank's block carries one extra element per parameter,
1 if this rank produced a gradient for it. After the reduce-scatter the sums say
how many ranks did: none leaves the sharded ``.grad`` untouched (None stays
None, as for an unused parameter in torch), any gives the average over all
ranks with zeros for the ranks that did not use it, which is the gradient of
the global batch's mean loss.

# Note [hybrid sharding]
With a 2-D mesh ``(replicate, shard)`` (HSDP, as torch's FSDP2 takes it) a
unit is sharded within its row of the mesh, the shard group: the layout,
gathers and reduce-scatters are the 1-D ones over that group, and each row
holds a whole copy of the model. After a unit's reduce-scatter its output
(the gradient shard and its flags) is all-reduced over the replicate group,
the ranks holding the same shard in the other rows, and divided by the whole
data-parallel size, so the gradient is the global batch's mean as with a 1-D
mesh over every rank. The sharded parameters are DTensors over the 2-D mesh
with placements ``(Replicate(), Shard(0))``, torch's, so optimizers, clipping
by the global norm and distributed checkpoints see the same layout as under
torch. The all-reduce starts once the reduce-scatter has completed, so it is a
second stage of the unit's reduction, ``ALL_REDUCING``; the stages are issued
in the schedule's reduce order on every rank (Note [reduce order] in
schedule.py), so the all-reduces of every replicate group match. With
``set_requires_all_reduce(False)`` (gradient accumulation over the slower
link only once per step, as in torch) the reduce-scatter runs and its output
is added to a partial sum kept on the unit, which the next all-reduce takes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch
from torch import nn

from tandem._compat import chunk_cat, dtensor_api, dtensor_like, dtensor_local, foreach_copy_, \
    preserve_version_counters
from tandem.comm.group import GroupComm, Work
from tandem.dtensor import local_grad
from tandem.fsdp.layout import ParamShard, UnitLayout, plan_unit
from tandem.fsdp.tensor_parallel import TensorParallelParam
from tandem.fsdp.units import ParamEntry

__all__ = ["ManagedParam", "ReduceState", "ShardState", "ShardedUnit", "UnitConfig"]

logger = logging.getLogger(__name__)


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


class TrainingState(Enum):
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
class _Gather:
    work: Work
    output: torch.Tensor
    input: torch.Tensor     # kept alive until the collective completes
    direct: bool            # the output is parameter-major already (one plain copy)


@dataclass
class _Reduce:
    work: Work
    output: torch.Tensor
    input: torch.Tensor


class ShardedUnit:
    """The parameters of one ``fully_shard`` call, each sharded on its dim (0
    unless ``shard_placement_fn`` said otherwise) across ``comm``, the shard
    group (Note [hybrid sharding])."""

    def __init__(self, name: str, params: list[ParamEntry], mesh: Any, comm: GroupComm,
                 config: UnitConfig, tp: list[TensorParallelParam | None] | None = None,
                 replicate_comm: GroupComm | None = None, shard_dims: list[int] | None = None) -> None:
        self.name = name
        self.mesh = mesh                      # 1-D, or 2-D (replicate, shard): Note [hybrid sharding]
        self.comm = comm                      # all-gathers: the shard group
        self.replicate_comm = replicate_comm  # HSDP: all-reduces of the reduced shards
        self.reduce_comm: GroupComm = comm    # reduce-scatters (a second group, set by the schedule)
        self.group_comm: GroupComm | None = None  # reshard_after_forward=k
        self.config = config
        self.orig_dtype = _uniform_dtype(name, params)
        self.param_dtype = config.param_dtype or self.orig_dtype
        self.reduce_dtype = config.reduce_dtype or self.param_dtype
        # Note [2-D parameters]: a tensor-parallel parameter is sharded as its local tensor.
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
        self.reduce_state = ReduceState.IDLE
        self.training = TrainingState.IDLE
        self._gather: _Gather | None = None
        self._reduce: _Reduce | None = None
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
        self.requires_all_reduce = True   # Note [hybrid sharding]
        self._partial: torch.Tensor | None = None
        self.forward_prefetch: list[ShardedUnit] | None = None
        self.backward_prefetch: list[ShardedUnit] | None = None
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
        # sharded is a DTensor over mesh["tp"] (Note [2-D parameters]).
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
        if self.replicate_comm is not None:  # Note [hybrid sharding]
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

    # ------------------------------------------------------------------ gather / release
    def launch_gather(self) -> None:
        """Start the all-gather of the full parameters (async)."""
        self._expect(ShardState.SHARDED, ShardState.GROUP_SHARDED)
        tag = f"unit {self.name}"
        if not self.layout.shard_numel:  # a unit without parameters (a root over sharded blocks)
            self._gather = _Gather(Work(None), self.unsharded_flat, self.shard_flat, direct=True)
            self.state = ShardState.GATHERING
            return
        elif self.state is ShardState.GROUP_SHARDED:
            assert self._group_shard is not None and self.group_comm is not None
            out = torch.empty_like(self.unsharded_flat, memory_format=torch.contiguous_format)
            work = self.group_comm.all_gather_into(out, self._group_shard, tag=tag, async_op=True)
            self._gather = _Gather(work, out, self._group_shard, direct=True)
        else:
            inp = self.shard_flat.to(self.config.device, self.param_dtype, non_blocking=True)
            out = torch.empty(self.layout.unsharded_numel, dtype=self.param_dtype, device=self.config.device)
            work = self.comm.all_gather_into(out, inp, tag=tag, async_op=True)
            self._gather = _Gather(work, out, inp, direct=False)
        self.state = ShardState.GATHERING

    def wait_gather(self) -> None:
        """Finish the all-gather and register the full parameters on the modules."""
        self._expect(ShardState.GATHERING)
        gather = self._gather
        assert gather is not None
        gather.work.wait()
        # Note [saved parameters]: the tensors autograd saved in forward are views of
        # the unsharded buffer; refilling it with the same values is not a
        # modification autograd should reject. A collective never writes into it:
        # it bumps its output's version counter at some moment between launch and
        # wait, in a communication thread; a copy bumps it here, where it is undone.
        self._alloc_unsharded()
        with preserve_version_counters((self.unsharded_flat,)), torch.no_grad():
            if gather.direct:  # already parameter-major (a 1/k slice of this buffer per rank)
                self.unsharded_flat.copy_(gather.output)
            else:
                world = self.layout.world_size
                src = gather.output.view(world, -1).split(self.layout.chunk_numels, dim=1)
                foreach_copy_(self._copy_out_dst, [s.view(world, *p.local_shape) if p.shard_dim else s
                                                   for s, p in zip(src, self.layout.params)])
        self._gather = None
        self._group_shard = None
        self.state = ShardState.UNSHARDED
        self._register(unsharded=True)

    def unshard(self) -> None:
        """Make the full parameters available and registered now (launching the
        gather if needed)."""
        if self.state in (ShardState.SHARDED, ShardState.GROUP_SHARDED):
            self.launch_gather()
        if self.state is ShardState.GATHERING:
            self.wait_gather()
        else:
            self._register(unsharded=True)  # state_dict() may have registered the shards

    def reshard(self, keep_group_shard: bool = False) -> None:
        """Free the full parameters and register the sharded ones again. With
        ``keep_group_shard``, keep this rank's 1/k slice of them for a gather over
        the smaller group (``reshard_after_forward=k``)."""
        if self.state is ShardState.GATHERING:
            self.wait_gather()
        if self.state is ShardState.UNSHARDED:
            if keep_group_shard and self.group_comm is not None:
                slices = self.unsharded_flat.view(self.group_comm.size, -1)
                self._group_shard = slices[self.group_comm.rank].clone()
            self._register(unsharded=False)
            self._free_unsharded()
            self.state = ShardState.GROUP_SHARDED if self._group_shard is not None else ShardState.SHARDED
        elif self.state is ShardState.GROUP_SHARDED and not keep_group_shard:
            self._group_shard = None
            self.state = ShardState.SHARDED

    def rebuild_unsharded(self) -> None:
        """A new unsharded buffer (on the device, in ``param_dtype``), with the
        same unsharded parameter objects pointing into it; new ones for a unit
        leaving the meta device, which has never run (no hooks hold them)."""
        leaving_meta = self.unsharded_flat.is_meta
        self.unsharded_flat = self._new_unsharded_buffer()
        for m in self.managed:
            view = self.unsharded_flat.narrow(0, m.spec.unsharded_offset, m.spec.numel).view(m.spec.shape)
            if leaving_meta:
                m.unsharded = nn.Parameter(view, requires_grad=m.requires_grad)
            else:
                m.unsharded.data = view
        self._copy_out_dst = self._copy_out_views()
        self._free_unsharded()

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

    # ------------------------------------------------------------------ gradients
    def grad_ready(self) -> bool:
        """Count one arrived gradient; True when all trainable ones have."""
        self.num_ready += 1
        return self.num_ready == self.num_trainable

    def launch_reduce(self) -> None:
        """Reduce-scatter the unsharded gradients (Note [gradient flags]) and free them."""
        self._expect_reduce(ReduceState.READY)
        world = self.layout.world_size
        grads, flags = [], []
        for m in self.managed:
            g = local_grad(m.unsharded)  # Note [2-D parameters]: the tensor-parallel shard's gradient
            flags.append(0.0 if g is None else 1.0)
            if g is None:
                g = torch.zeros(m.spec.shape, dtype=self.param_dtype, device=self.config.device)
            grads.append(self._blocks(g, m.spec) if m.spec.shard_dim else g)
        flag_rows = torch.tensor(flags, dtype=self.param_dtype, device=self.config.device).expand(world, -1)
        inp = torch.empty(world, self.layout.shard_numel + len(flags), dtype=self.reduce_dtype,
                          device=self.config.device)
        chunk_cat(grads + [flag_rows], world, inp)
        for m in self.managed:
            m.unsharded.grad = None
        out = torch.empty(inp.shape[1], dtype=self.reduce_dtype, device=self.config.device)
        work = self.reduce_comm.reduce_scatter(out, inp.view(-1), tag=f"unit {self.name}", async_op=True)
        self._reduce = _Reduce(work, out, inp)
        self.reduce_state = ReduceState.IN_FLIGHT

    @property
    def reduce_done(self) -> bool:
        """The collective of the reduction's current stage has completed
        (:meth:`advance_reduce` will not block)."""
        return self._reduce is not None and self._reduce.work.is_completed()

    @property
    def reducing(self) -> bool:
        """A reduction is in flight (either stage)."""
        return self.reduce_state in (ReduceState.IN_FLIGHT, ReduceState.ALL_REDUCING)

    def advance_reduce(self, divide_factor: float) -> None:
        """Finish the reduction's current stage (waiting for it): after the
        reduce-scatter, launch the all-reduce over the replicate group under
        HSDP (Note [hybrid sharding]); after the last stage set (or accumulate
        into) the sharded ``.grad``."""
        self._expect_reduce(ReduceState.IN_FLIGHT, ReduceState.ALL_REDUCING)
        reduce = self._reduce
        assert reduce is not None
        reduce.work.wait()
        if self.reduce_state is ReduceState.IN_FLIGHT and self.replicate_comm is not None \
                and self.replicate_comm.size > 1:
            if self._partial is not None:
                reduce.output.add_(self._partial)
                self._partial = None
            if not self.requires_all_reduce:  # keep the partial sum for the next all-reduce
                self._partial = reduce.output
                self._reduce = None
                self.reduce_state = ReduceState.IDLE
                return
            work = self.replicate_comm.all_reduce(reduce.output, tag=f"unit {self.name}", async_op=True)
            self._reduce = _Reduce(work, reduce.output, reduce.output)
            self.reduce_state = ReduceState.ALL_REDUCING
            return
        self._reduce = None
        self.reduce_state = ReduceState.IDLE
        self._set_grads(reduce.output, divide_factor)

    def finish_reduce(self, divide_factor: float) -> None:
        """Finish every stage of the reduction in flight (waiting for them)."""
        while self.reducing:
            self.advance_reduce(divide_factor)

    def _set_grads(self, output: torch.Tensor, divide_factor: float) -> None:
        n = self.layout.shard_numel
        flags = output[n:].tolist()
        grads = output[:n]
        if divide_factor != 1:
            grads.div_(divide_factor)
        grads = grads.to(self.config.shard_device, self.orig_dtype)
        for m, flag in zip(self.managed, flags):
            if flag == 0 or not m.requires_grad:
                continue
            local = grads.narrow(0, m.spec.shard_offset, m.spec.local_numel).view(m.spec.local_shape)
            if m.sharded.grad is None:
                m.sharded.grad = dtensor_like(local, m.sharded)
            else:
                dtensor_local(m.sharded.grad).add_(local)

    def skip_reduce(self) -> None:
        """Gradient sync is off: keep accumulating the unsharded gradients."""
        self._expect_reduce(ReduceState.READY)
        self.reduce_state = ReduceState.IDLE

    def mark_ready(self) -> None:
        """This backward is over for the unit: queue its reduction (once per backward)."""
        if not self.completed:
            self.completed = True
            self._expect_reduce(ReduceState.IDLE)
            self.reduce_state = ReduceState.READY

    def reset_step(self) -> None:
        self.num_ready = 0
        self.completed = False

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

    @property
    def nbytes_sharded(self) -> int:
        return self.shard_flat.numel() * self.shard_flat.element_size()

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
