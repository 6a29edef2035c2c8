"""One fully_shard unit at run time, as torch's ``FSDPParamGroup``: the
all-gather that unshards its parameters and the reduce-scatter that shards
their gradients, each a launch/wait pair with an explicit state
(:class:`ShardState`, :class:`ReduceState`), the groups they run over and the
per-step toggles that ``FSDPModule``'s setters change. Its parameters, in both
forms, and their buffers are a :class:`~tandem.fsdp.unit_params.UnitParams`
(unit_params.py); the schedule (schedule.py) decides when each step runs.

Life of a unit in one step (with ``reshard_after_forward=True``)::

    SHARDED --launch_gather--> GATHERING --wait_gather--> UNSHARDED   (pre-forward)
    UNSHARDED --reshard--> SHARDED                                    (post-forward)
    SHARDED --...--> UNSHARDED                                        (pre-backward)
    gradients arrive; reduce: IDLE -> READY --launch_reduce--> IN_FLIGHT
    UNSHARDED --reshard--> SHARDED                                    (post-backward)
    IN_FLIGHT --advance_reduce--> IDLE: sharded .grad set             (end of backward)
    HSDP: IN_FLIGHT --advance_reduce--> ALL_REDUCING --advance_reduce--> IDLE

# Note [gather input in place]
An all-gather sends this rank's shard buffer as it is when it has the
gather's dtype and device (no copy). Otherwise (a ``param_dtype``, a shard
offloaded to the host) the shard is cast or copied straight into this rank's
chunk of the all-gather's output, which is the collective's input (an
in-place all-gather, as torch's FSDP2 issues them): a separate cast copy
would stay alive beside the output until the gather is waited on, a unit's
shard in ``param_dtype`` more at the peak than FSDP2 for every prefetched
unit.

# Note [gradient flags]
Ranks may use different parameters of a unit in one step (rank-dependent
control flow). Every rank therefore reduce-scatters every parameter of the
unit, with zeros where it has no gradient, so that all ranks issue the same
collectives; and each rank's block carries one extra element per parameter,
1 if this rank produced a gradient for it. After the reduce-scatter the sums say
how many ranks did: none leaves the sharded ``.grad`` untouched (None stays
None, as for an unused parameter in torch), any gives the average over all
ranks with zeros for the ranks that did not use it, which is the gradient of
the global batch's mean loss. The flags are filled on the device and their sums
read back only by a rank that lacked some gradient itself: a rank with every
gradient knows every sum is at least one, so in the common step (every rank
uses every parameter) no rank reads a device value and a CUDA host never waits
for the GPU.

# Note [reduce-scatter in place]
A unit's reduce-scatter writes this rank's block of the sum into this rank's
chunk of its own input (in place, as NCCL and gloo allow), so while it is in
flight only the input is alive, where torch's FSDP2 holds a separate output
beside it. When it has completed, the block's gradients are copied out (cast
to the parameters' dtype, or to the host under CPUOffloadPolicy, which copy
anyway) and the input freed: the sharded gradients are ``1/world`` of it,
without the flags, and keep no reduction buffer alive. The copy costs
``1/world`` of the copy-in. This also leaves room for the gradient flags'
``world * n`` elements (Note [gradient flags]), which FSDP2's input does not
carry: in flight tandem holds less than FSDP2 by a block's size, and while
the block is copied out as much as FSDP2 holds in flight plus the flags. A
custom reduce-scatter (``set_custom_reduce_scatter``) gets an output of its
own from its ``allocate``. Under HSDP the block is copied out before the
all-reduce over the replicate group, so that the whole input is not kept
alive during it. On gloo, in place is also what spares torch's clone of the
input (Note [gloo's reduce-scatter] in tandem/comm/group.py).

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

# Note [gradients to the host]
Under ``CPUOffloadPolicy`` the reduced gradients are copied to the host. A
synchronous copy (into pageable memory) stops the host until the GPU has run
everything queued before it, at every unit's reduction: the host loses the
lead it keeps over the GPU in backward, and the GPU waits while it catches
up. As torch's FSDP2 does, the copy is asynchronous, into pinned memory
(``Tensor.to(..., non_blocking=True)`` from a GPU pins its host output), an
event is recorded after it, and the end of backward waits for the events
(:meth:`ShardedUnit.wait_host_grads`), before an optimizer on the host reads
the gradients. Where a sharded gradient is there already (accumulation
across backwards) the copy stays synchronous: the addition on the host needs
it; so it does with ``pin_memory=False``.

# Note [accumulation dtype]
With gradient sync off (``set_requires_gradient_sync(False)``: micro-batches,
a chunked loss) a unit's gradients are summed over several backwards before
one reduce-scatter. torch's ``MixedPrecisionPolicy`` sums them in
``reduce_dtype``: summed in ``param_dtype`` (bf16), 8 micro-batches lose about
0.5% of the sum, silently. So, as torch's FSDP2 does, when a backward without
sync ends each gradient not already in ``reduce_dtype`` moves out of the
unsharded parameter's ``.grad`` into ``ManagedParam.accumulated``, cast; the
next backward's gradient (autograd's, in ``param_dtype``) is added to it when
that backward ends, and the reduce-scatter takes the sum. The ``.grad`` that
autograd accumulates into is thus empty at the start of every backward, and
the bits equal torch's (tests/fsdp/test_fsdp_precision.py). Where some parameters
of a unit have a sum and others only a fresh gradient (torch's FSDP2 stops
there with an assertion), all are cast to ``reduce_dtype`` for the one
reduce-scatter.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from tandem._compat import chunk_cat, dtensor_like, dtensor_local, foreach_copy_, preserve_version_counters
from tandem.comm.failure_gate import FailureGate
from tandem.comm.group import GroupComm, Work
from tandem.dtensor import local_grad
from tandem.fsdp.tensor_parallel import TensorParallelParam
from tandem.fsdp.unit_params import SubclassGather, UnitParams
from tandem.fsdp.unit_state import CommOverrides, PendingGather, PendingReduce, ReduceState, ShardState, UnitConfig, \
    UnitPhase
from tandem.fsdp.unit_walk import ParamEntry
from tandem.quantized.collectives import all_gather_quantized, reduce_scatter_quantized

__all__ = ["UNIT_ATTR", "ShardedUnit", "unit_of"]

UNIT_ATTR = "_tandem_fsdp_unit"  # the attribute a fully_shard module holds its unit in


class RootSchedule(Protocol):
    """What a unit's holders call on the root's :class:`~tandem.fsdp.schedule.Schedule`
    (schedule.py imports this file, so the unit names it by what it does)."""

    root: ShardedUnit

    def pre_forward(self, unit: ShardedUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]: ...

    def post_forward(self, unit: ShardedUnit, module: nn.Module, output: Any) -> Any: ...

    def reset(self) -> None: ...


class ShardedUnit:
    """The parameters of one ``fully_shard`` call, each sharded on its dim (0
    unless ``shard_placement_fn`` said otherwise) across ``comm``, the shard
    group (Note [hybrid sharding]), and their gather and reduction."""

    def __init__(self, name: str, params: list[ParamEntry], mesh: Any, comm: GroupComm,
                 config: UnitConfig, tp: list[TensorParallelParam | None] | None = None,
                 replicate_comm: GroupComm | None = None, shard_dims: list[int] | None = None) -> None:
        # The mesh: 1-D, or 2-D (replicate, shard): Note [hybrid sharding].
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
        policy = config.comm_policy  # Note [quantized units] in comm_policy.py
        self._weight_bits = None if policy is None else policy.weight_bits  # int8 gathers
        self._grad_bits = None if policy is None else policy.grad_bits      # int8/int4 reductions
        self._block = 0 if policy is None else policy.block
        self._reset_gather()
        self._reset_reduce()
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
        self.requires_all_reduce = True   # Note [hybrid sharding]
        self.unshard_in_backward = True   # False: backward needs no parameter values (an embedding)
        self.reduce_scatter_unused_params = False  # zeros, not None, for a gradient no rank produced
        # set_reduce_scatter_max_input_buffers; None: by the backend (Note [reductions in flight] in schedule.py)
        self.max_reduce_buffers: int | None = None
        self.divide_factor: float | None = None
        # The root's Schedule, set at the root's first forward.
        self.schedule: RootSchedule | None = None
        self.modules: tuple[nn.Module, ...] = ()  # the module(s) fully_shard was called on
        self.pending_forward: set[int] = set()    # ids of modules of the group yet to run forward
        self.mergeable = False                # below min_unit_bytes (Note [tiny units] in api.py)
        self.hooks: list[Any] = []            # its module hooks, removed if it is absorbed
        # The units whose gathers this one launches (set_modules_to_*_prefetch; Note
        # [prefetch] in schedule.py); None: the neighbours of the last iteration.
        self.forward_prefetch: list[ShardedUnit] | None = None
        self.backward_prefetch: list[ShardedUnit] | None = None

    def _reset_gather(self) -> None:
        """Sharded, no gather in flight."""
        self.state = ShardState.SHARDED
        self.pending_gather: PendingGather | None = None
        self.group_shard: torch.Tensor | None = None   # reshard_after_forward=k: this rank's 1/k slice
        # Note [tensor-subclass gathers] in unit_params.py: None for a unit of plain parameters
        self.subclasses = SubclassGather(self.params) if self.params.subclass_params else None
        self.pending_subclasses: PendingGather | None = None

    def _reset_reduce(self) -> None:
        """No reduction in flight, none kept, no gradient counted."""
        self.reduce_state = ReduceState.IDLE
        self.pending_reduce: PendingReduce | None = None
        self._partial: torch.Tensor | None = None  # HSDP without all-reduce: the sum so far
        self._all_local = True  # this rank had every gradient in its last reduce-scatter
        self._to_host: torch.cuda.Event | None = None  # Note [gradients to the host]: copies in flight
        self.num_ready = 0
        self.completed = False      # this backward (Note [unit completion] in schedule.py)

    @property
    def name(self) -> str:
        """The unit's path in the model (the root's lazy init names it: schedule.py),
        which its collectives' tags and its errors carry."""
        return self.params.name

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks whose gradients a reduction averages: the shard
        group's, times the replicate group's under HSDP."""
        return self.comm.size * (self.replicate_comm.size if self.replicate_comm is not None else 1)

    # ------------------------------------------------------------------ gather and release
    def unshard(self) -> None:
        """Make the full parameters available and registered now (launching the
        gather if needed)."""
        if self.state in (ShardState.SHARDED, ShardState.GROUP_SHARDED):
            self.launch_gather()
        if self.state is ShardState.GATHERING:
            self.wait_gather()
        else:
            self.params.register(unsharded=True)  # state_dict() may have registered the shards

    def launch_gather(self) -> None:
        """Start the all-gather of the full parameters (async): over ``comm``, or
        over ``group_comm`` from the slice kept by :meth:`reshard`."""
        self._expect_shard(ShardState.SHARDED, ShardState.GROUP_SHARDED)
        p, overrides = self.params, self.overrides
        tag = f"unit {p.name}"
        if self.subclasses is not None:  # Note [tensor-subclass gathers]; never GROUP_SHARDED (reshard refuses it)
            self.pending_subclasses = self.subclasses.launch(self.comm, tag)
        if not p.flat_numel:  # a unit without plain parameters (a root over sharded blocks)
            self.pending_gather = PendingGather(Work(None), p.unsharded_flat, p.shard_flat, direct=True)
            self.state = ShardState.GATHERING
            return
        elif self.state is ShardState.GROUP_SHARDED:
            assert self.group_shard is not None and self.group_comm is not None
            custom = overrides.all_gather
            out = _buffer(custom, p.layout.world_size * p.flat_numel, p.param_dtype, p.config.device)
            work = self.group_comm.all_gather_into(out, self.group_shard, tag=tag, async_op=True, via=custom)
            self.pending_gather = PendingGather(work, out, self.group_shard, direct=True)
        elif self._weight_bits is not None and self.comm.size > 1:  # Note [quantized units] in comm_policy.py
            assert overrides.all_gather is None  # refused by set_custom_all_gather
            out = torch.empty(p.layout.world_size * p.flat_numel, dtype=p.param_dtype, device=p.config.device)
            shard = p.shard_flat.to(out.device, p.param_dtype, non_blocking=True)  # what would be sent
            handle = all_gather_quantized(self.comm, out, shard, self._weight_bits, self._block, tag=tag,
                                          async_op=True)
            self.pending_gather = PendingGather(handle, out, handle.sent, direct=False)
        else:
            custom = overrides.all_gather
            out = _buffer(custom, p.layout.world_size * p.flat_numel, p.param_dtype, p.config.device)
            inp = p.shard_flat
            if inp.dtype != p.param_dtype or inp.device != out.device:
                # Note [gather input in place]
                inp = out.view(self.comm.size, -1)[self.comm.rank]
                inp.copy_(p.shard_flat, non_blocking=True)
            work = self.comm.all_gather_into(out, inp, tag=tag, async_op=True, via=custom)
            self.pending_gather = PendingGather(work, out, inp, direct=False)
        self.state = ShardState.GATHERING

    def wait_gather(self) -> None:
        """Finish the all-gather and register the full parameters on the modules."""
        self._expect_shard(ShardState.GATHERING)
        gather, p = self.pending_gather, self.params
        assert gather is not None
        gather.work.wait()
        # Note [saved parameters]: the tensors autograd saved in forward are views of
        # the unsharded buffer; refilling it with the same values is not a
        # modification autograd should reject. A collective never writes into it:
        # it bumps its output's version counter at some moment between launch and
        # wait, in a communication thread; a copy bumps it here, where it is undone.
        p.alloc_unsharded()
        with preserve_version_counters((p.unsharded_flat,)), torch.no_grad():
            if gather.direct:  # already parameter-major (a 1/k slice of this buffer per rank)
                p.unsharded_flat.copy_(gather.output)
            else:
                world = p.layout.world_size
                src = gather.output.view(world, -1).split([spec.chunk_numel for spec in p.flat_specs], dim=1)
                foreach_copy_(p.copy_out_dst, [s.view(world, *spec.local_shape) if spec.shard_dim else s
                                               for s, spec in zip(src, p.flat_specs)])
        if self.pending_subclasses is not None:
            assert self.subclasses is not None
            self.subclasses.wait(self.pending_subclasses)
            self.pending_subclasses = None
        self.pending_gather = None
        self.group_shard = None
        self.state = ShardState.UNSHARDED
        p.register(unsharded=True)

    def reshard(self, keep_group_shard: bool = False) -> None:
        """Free the full parameters and register the sharded ones again. With
        ``keep_group_shard``, keep this rank's 1/k slice of them for a gather over
        the smaller group (``reshard_after_forward=k``)."""
        p = self.params
        if self.state is ShardState.GATHERING:
            self.wait_gather()
        if self.state is ShardState.UNSHARDED:
            if keep_group_shard and self.group_comm is not None:
                if self.subclasses is not None:
                    self.subclasses.refuse_group_shard()
                slices = p.unsharded_flat.view(self.group_comm.size, -1)
                self.group_shard = slices[self.group_comm.rank].clone()
            p.register(unsharded=False)
            p.free_unsharded()
            if self.subclasses is not None:
                self.subclasses.free()
            self.state = ShardState.GROUP_SHARDED if self.group_shard is not None else ShardState.SHARDED
        elif self.state is ShardState.GROUP_SHARDED and not keep_group_shard:
            self.group_shard = None
            self.state = ShardState.SHARDED

    # ------------------------------------------------------------------ the gradients' reduction
    def grad_ready(self) -> bool:
        """Count one arrived gradient; True when all have, in a unit without
        frozen parameters (Note [unit completion] in schedule.py)."""
        self.num_ready += 1
        return self.num_ready == self.params.num_trainable == len(self.params.managed)

    def mark_ready(self) -> None:
        """This backward is over for the unit: queue its reduction (once per backward)."""
        if not self.completed:
            self.completed = True
            self._expect_reduce(ReduceState.IDLE)
            self.reduce_state = ReduceState.READY

    def reset_step(self) -> None:
        self.num_ready = 0
        self.completed = False

    def launch_reduce(self) -> None:
        """Reduce-scatter the unsharded gradients over ``reduce_comm`` (Note
        [gradient flags]) and free them."""
        self._expect_reduce(ReduceState.READY)
        self._accumulate()
        p, custom, reduce_comm = self.params, self.overrides.reduce_scatter, self.reduce_comm
        world = p.layout.world_size
        grads, flags = [], []
        for m in p.managed:
            # Note [2-D parameters] in tensor_parallel.py: the shard's gradient
            g = m.accumulated if m.accumulated is not None else local_grad(m.unsharded)
            flags.append(0.0 if g is None else 1.0)
            if g is None:
                g = torch.zeros(m.spec.shape, dtype=p.param_dtype, device=p.config.device)
            grads.append(g)
        if len({g.dtype for g in grads}) > 1:  # Note [accumulation dtype]: sums and fresh gradients
            grads = [g.to(p.reduce_dtype) for g in grads]
        grads = [p.blocks(g, m.spec) if m.spec.shard_dim else g for g, m in zip(grads, p.managed)]
        # Filled on the device, not copied from a host list: a copy from pageable
        # memory stops the host on CUDA (Note [gradient flags]).
        flag_row = torch.ones(len(flags), dtype=grads[0].dtype, device=p.config.device)
        for i, f in enumerate(flags):
            if not f:
                flag_row[i].fill_(0.0)  # not flag_row[i] = 0: a copy from the host
        self._all_local = all(flags)
        flag_rows = flag_row.expand(world, -1)
        width = p.layout.shard_numel + len(flags)
        inp = _buffer(custom, world * width, p.reduce_dtype, p.config.device).view(world, width)
        chunk_cat(grads + [flag_rows], world, inp)
        for m in p.managed:
            m.unsharded.grad = None
            m.accumulated = None
        if self._grad_bits is not None and reduce_comm.size > 1:  # Note [quantized units] in comm_policy.py
            assert custom is None  # refused by set_custom_reduce_scatter
            n = p.layout.shard_numel
            out = torch.empty(width, dtype=p.reduce_dtype, device=p.config.device)
            handle = reduce_scatter_quantized(reduce_comm, out, inp[:, :n], self._grad_bits, self._block,
                                              exact=inp[:, n:], tag=f"unit {p.name}", async_op=True)
            self.pending_reduce = PendingReduce(handle, out, handle.sent)  # the input is freed here
            self.reduce_state = ReduceState.IN_FLIGHT
            return
        # Note [reduce-scatter in place]: the output is this rank's chunk of the input; a custom one gets its own
        output_in_input = custom is None
        out = inp[reduce_comm.rank] if output_in_input else _buffer(custom, width, p.reduce_dtype, p.config.device)
        work = reduce_comm.reduce_scatter(out, inp.view(-1), tag=f"unit {p.name}", async_op=True, via=custom)
        self.pending_reduce = PendingReduce(work, out, inp, output_in_input)
        self.reduce_state = ReduceState.IN_FLIGHT

    @property
    def reduce_buffers(self) -> int:
        """The most reduce-scatters in flight once this unit's has launched, each
        holding its full-size input (Note [reductions in flight] in schedule.py)."""
        if self.max_reduce_buffers is not None:
            return self.max_reduce_buffers
        return 2 if self.reduce_comm.wait_blocks_host(self.config.device) else 1

    @property
    def reduce_done(self) -> bool:
        """The collective of the reduction's current stage has completed
        (:meth:`advance_reduce` will not block)."""
        return self.pending_reduce is not None and self.pending_reduce.work.is_completed()

    @property
    def reducing(self) -> bool:
        """A reduction is in flight (either stage)."""
        return self.reduce_state in (ReduceState.IN_FLIGHT, ReduceState.ALL_REDUCING)

    def advance_reduce(self) -> None:
        """Finish the reduction's current stage (waiting for it): after the
        reduce-scatter, launch the all-reduce over ``replicate_comm`` under HSDP
        (Note [hybrid sharding]; with ``requires_all_reduce`` False, keep the
        partial sum instead); after the last stage set (or accumulate into) the
        sharded ``.grad``."""
        self._expect_reduce(ReduceState.IN_FLIGHT, ReduceState.ALL_REDUCING)
        reduce = self.pending_reduce
        assert reduce is not None
        reduce.work.wait()
        self.pending_reduce = None
        output = reduce.output
        replicate_comm = self.replicate_comm
        if self.reduce_state is ReduceState.IN_FLIGHT and replicate_comm is not None and replicate_comm.size > 1:
            if reduce.output_in_input:  # the second stage must not keep the whole input alive
                output = output.clone()
            del reduce
            if self._partial is not None:
                output.add_(self._partial)
                self._partial = None
            if not self.requires_all_reduce:  # keep the partial sum for the next all-reduce
                self._partial = output
                self.reduce_state = ReduceState.IDLE
                return
            work = replicate_comm.all_reduce(output, tag=f"unit {self.name}", async_op=True)
            self.pending_reduce = PendingReduce(work, output, output)
            self.reduce_state = ReduceState.ALL_REDUCING
            return
        del reduce  # the input, unless output is a view of it
        self.reduce_state = ReduceState.IDLE
        self._set_grads(output)

    def finish_reduce(self) -> None:
        """Finish every stage of the reduction in flight (waiting for them)."""
        while self.reducing:
            self.advance_reduce()

    def _set_grads(self, output: torch.Tensor) -> None:
        """Divide the reduced block (by ``divide_factor``, or the data-parallel size)
        and set the sharded gradients from a copy of it, which keeps no reduction
        buffer alive (Note [reduce-scatter in place])."""
        p = self.params
        n = p.layout.shard_numel
        # Every flag's sum is at least this rank's: where this rank has every
        # gradient, none is 0 and nothing needs reading, which on CUDA would stop
        # the host (Note [gradient flags]); the sums are read only where it does not.
        flags = [1.0] * len(p.managed) if self._all_local else output[n:].tolist()
        grads = output[:n]
        # torch's set_all_reduce_hook sees the mean, or with set_force_sum_reduction_for_comms
        # the sum before the division; the gradients are summed and then divided either way.
        hook = self.overrides.all_reduce_hook
        if hook is not None and self.overrides.force_sum:
            hook(grads)
        divide_factor = self.divide_factor or self.dp_size
        if divide_factor != 1:
            grads.div_(divide_factor)
        if hook is not None and not self.overrides.force_sum:
            hook(grads)
        # Note [gradients to the host]: asynchronous unless added to gradients already there
        to_host = (p.config.pin_memory and grads.is_cuda and p.config.shard_device.type == "cpu"
                   and all(m.sharded.grad is None for m in p.managed))
        cast = grads.to(p.config.shard_device, p.orig_dtype, non_blocking=to_host)
        grads = cast.clone() if cast.data_ptr() == grads.data_ptr() else cast
        if to_host:
            self._to_host = torch.cuda.Event()
            self._to_host.record()
        for m, flag in zip(p.managed, flags):
            # No rank produced it: None stays None, unless set_reduce_scatter_unused_params
            # asked for the zeros every rank sent (Note [gradient flags]).
            if (flag == 0 and not self.reduce_scatter_unused_params) or not m.requires_grad:
                continue
            local = grads.narrow(0, m.spec.shard_offset, m.spec.local_numel).view(m.spec.local_shape)
            if m.sharded.grad is None:
                m.sharded.grad = dtensor_like(local, m.sharded)
            else:
                dtensor_local(m.sharded.grad).add_(local)

    def skip_reduce(self) -> None:
        """Gradient sync is off: keep the unsharded gradients, summed in
        ``reduce_dtype`` (Note [accumulation dtype])."""
        self._expect_reduce(ReduceState.READY)
        self._accumulate()
        p = self.params
        for m in p.managed:
            g = local_grad(m.unsharded)
            if g is not None and g.dtype != p.reduce_dtype:
                m.accumulated = g.to(p.reduce_dtype)
                m.unsharded.grad = None
        self.reduce_state = ReduceState.IDLE

    def _accumulate(self) -> None:
        """Add this backward's gradients to the sums kept in ``reduce_dtype``
        (Note [accumulation dtype])."""
        for m in self.params.managed:
            if m.accumulated is None:
                continue
            g = local_grad(m.unsharded)
            if g is not None:
                m.accumulated += g
                m.unsharded.grad = None

    def wait_host_grads(self) -> None:
        """Wait until the sharded gradients copied to the host have arrived (Note
        [gradients to the host]): at the end of backward, before an optimizer
        on the host reads them."""
        if self._to_host is not None:
            self._to_host.synchronize()
            self._to_host = None

    def discard_reduce(self) -> None:
        """Drop this iteration's gradients (FSDPModule.reset_iter_state): wait for
        a reduction in flight and forget it, the HSDP partial sum and the
        unsynced gradients; the sharded ``.grad`` of earlier steps stays."""
        self.wait_host_grads()
        if self.pending_reduce is not None:
            self.pending_reduce.work.wait()
        self.pending_reduce = None
        self._partial = None
        self.reduce_state = ReduceState.IDLE
        for m in self.params.managed:
            m.unsharded.grad = None
            m.accumulated = None
        self.reset_step()

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
        self._reset_gather()
        self._reset_reduce()
        self.phase = UnitPhase.IDLE
        self.forward_calls = self.untracked_calls = self.inputs_done = 0
        self.pending_forward = set()
        self.schedule = None

    # ------------------------------------------------------------------ guards
    def _expect_shard(self, *allowed: ShardState) -> None:
        if self.state not in allowed:
            raise RuntimeError(f"fully_shard unit '{self.name}' is {self.state.name}, expected "
                               f"{'/'.join(s.name for s in allowed)}")

    def _expect_reduce(self, *allowed: ReduceState) -> None:
        if self.reduce_state not in allowed:
            raise RuntimeError(
                f"fully_shard unit '{self.name}': gradient reduction is {self.reduce_state.name}, expected "
                f"{'/'.join(s.name for s in allowed)} ({self.num_ready}/{self.params.num_trainable} "
                "gradients ready)")

    def __repr__(self) -> str:
        return (f"ShardedUnit('{self.name}', {len(self.params.managed)} params, {self.params.layout.numel} "
                f"elements, {self.state.name})")


def unit_of(module: nn.Module) -> ShardedUnit | None:
    return getattr(module, UNIT_ATTR, None)


def _buffer(custom: Any, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer for a collective: from the custom one's ``allocate``
    (set_custom_all_gather, set_custom_reduce_scatter) if it has one."""
    if custom is not None:
        return custom.allocate((numel,), dtype=dtype, device=device)
    return torch.empty(numel, dtype=dtype, device=device)
