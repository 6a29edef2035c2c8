"""A unit's gradients reduced: the reduce-scatter that shards them, with one
flag per parameter (Note [gradient flags]), then under HSDP the all-reduce over
the replicate group (Note [hybrid sharding]), each stage a launch and a wait
with an explicit :class:`ReduceState`, which :class:`UnitReduce` owns; at the
end the sharded ``.grad`` is set.

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

# Note [gradients to the host]
Under ``CPUOffloadPolicy`` the reduced gradients are copied to the host. A
synchronous copy (into pageable memory) stops the host until the GPU has run
everything queued before it, at every unit's reduction: the host loses the
lead it keeps over the GPU in backward, and the GPU waits while it catches
up. As torch's FSDP2 does, the copy is asynchronous, into pinned memory
(``Tensor.to(..., non_blocking=True)`` from a GPU pins its host output), an
event is recorded after it, and the end of backward waits for the events
(:meth:`UnitReduce.wait_host_grads`), before an optimizer on the host reads
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

import torch

from tandem._compat import chunk_cat, dtensor_like, dtensor_local
from tandem.comm.group import GroupComm
from tandem.quantized.collectives import reduce_scatter_quantized
from tandem.dtensor import local_grad
from tandem.fsdp.unit_params import UnitParams
from tandem.fsdp.unit_state import CommOverrides, PendingReduce, ReduceState

__all__ = ["UnitReduce"]


class UnitReduce:
    """The reduction of one unit's gradients, step by step.

    Args:
        params: the unit's parameters and buffers.
        overrides: the unit's communication overrides (FSDPModule's setters change them).
    """

    def __init__(self, params: UnitParams, overrides: CommOverrides) -> None:
        self.params, self._overrides = params, overrides
        self.state = ReduceState.IDLE
        self.pending: PendingReduce | None = None
        self._partial: torch.Tensor | None = None  # HSDP without all-reduce: the sum so far
        self._all_local = True  # this rank had every gradient in its last reduce-scatter
        self._to_host: torch.cuda.Event | None = None  # Note [gradients to the host]: copies in flight
        self.num_ready = 0
        self.completed = False      # this backward (Note [unit completion] in schedule.py)
        policy = params.config.comm_policy
        self._bits = None if policy is None else policy.grad_bits  # int8/int4 reductions (comm_policy.py)
        self._block = 0 if policy is None else policy.block

    def grad_ready(self) -> bool:
        """Count one arrived gradient; True when all have, in a unit without
        frozen parameters (Note [unit completion] in schedule.py)."""
        self.num_ready += 1
        return self.num_ready == self.params.num_trainable == len(self.params.managed)

    def mark_ready(self) -> None:
        """This backward is over for the unit: queue its reduction (once per backward)."""
        if not self.completed:
            self.completed = True
            self._expect(ReduceState.IDLE)
            self.state = ReduceState.READY

    def reset_step(self) -> None:
        self.num_ready = 0
        self.completed = False

    def launch(self, reduce_comm: GroupComm) -> None:
        """Reduce-scatter the unsharded gradients over ``reduce_comm`` (Note
        [gradient flags]) and free them."""
        self._expect(ReduceState.READY)
        self._accumulate()
        p, overrides = self.params, self._overrides
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
        custom = overrides.reduce_scatter
        width = p.layout.shard_numel + len(flags)
        inp = overrides.allocate(custom, world * width, p.reduce_dtype, p.config.device).view(world, width)
        chunk_cat(grads + [flag_rows], world, inp)
        for m in p.managed:
            m.unsharded.grad = None
            m.accumulated = None
        if self._bits is not None and reduce_comm.size > 1:  # Note [quantized units] in comm_policy.py
            assert custom is None  # refused by set_custom_reduce_scatter
            n = p.layout.shard_numel
            out = torch.empty(width, dtype=p.reduce_dtype, device=p.config.device)
            handle = reduce_scatter_quantized(reduce_comm, out, inp[:, :n], self._bits, self._block,
                                              exact=inp[:, n:], tag=f"unit {p.name}", async_op=True)
            self.pending = PendingReduce(handle, out, handle.sent)  # the input is freed here
            self.state = ReduceState.IN_FLIGHT
            return
        in_place = custom is None  # Note [reduce-scatter in place]; a custom one gets its own output
        out = inp[reduce_comm.rank] if in_place else overrides.allocate(custom, width, p.reduce_dtype, p.config.device)
        work = reduce_comm.reduce_scatter(out, inp.view(-1), tag=f"unit {p.name}", async_op=True, via=custom)
        self.pending = PendingReduce(work, out, inp, in_place)
        self.state = ReduceState.IN_FLIGHT

    @property
    def done(self) -> bool:
        """The collective of the reduction's current stage has completed
        (:meth:`advance` will not block)."""
        return self.pending is not None and self.pending.work.is_completed()

    @property
    def reducing(self) -> bool:
        """A reduction is in flight (either stage)."""
        return self.state in (ReduceState.IN_FLIGHT, ReduceState.ALL_REDUCING)

    def advance(self, divide_factor: float, replicate_comm: GroupComm | None, *, all_reduce: bool,
                unused_params: bool) -> None:
        """Finish the reduction's current stage (waiting for it): after the
        reduce-scatter, launch the all-reduce over ``replicate_comm`` under HSDP
        (Note [hybrid sharding]; with ``all_reduce`` False, keep the partial sum
        instead); after the last stage set (or accumulate into) the sharded
        ``.grad`` (``unused_params``: zeros for a gradient no rank produced)."""
        self._expect(ReduceState.IN_FLIGHT, ReduceState.ALL_REDUCING)
        reduce = self.pending
        assert reduce is not None
        reduce.work.wait()
        self.pending = None
        output = reduce.output
        if self.state is ReduceState.IN_FLIGHT and replicate_comm is not None and replicate_comm.size > 1:
            if reduce.in_place:  # the second stage must not keep the whole input alive
                output = output.clone()
            del reduce
            if self._partial is not None:
                output.add_(self._partial)
                self._partial = None
            if not all_reduce:  # keep the partial sum for the next all-reduce
                self._partial = output
                self.state = ReduceState.IDLE
                return
            work = replicate_comm.all_reduce(output, tag=f"unit {self.params.name}", async_op=True)
            self.pending = PendingReduce(work, output, output)
            self.state = ReduceState.ALL_REDUCING
            return
        del reduce  # the input, unless output is a view of it
        self.state = ReduceState.IDLE
        self._set_grads(output, divide_factor, unused_params)

    def _set_grads(self, output: torch.Tensor, divide_factor: float, unused_params: bool) -> None:
        """Divide the reduced block and set the sharded gradients from a copy of it,
        which keeps no reduction buffer alive (Note [reduce-scatter in place])."""
        p = self.params
        n = p.layout.shard_numel
        # Every flag's sum is at least this rank's: where this rank has every
        # gradient, none is 0 and nothing needs reading, which on CUDA would stop
        # the host (Note [gradient flags]); the sums are read only where it does not.
        flags = [1.0] * len(p.managed) if self._all_local else output[n:].tolist()
        grads = output[:n]
        # torch's set_all_reduce_hook sees the mean, or with set_force_sum_reduction_for_comms
        # the sum before the division; the gradients are summed and then divided either way.
        hook = self._overrides.all_reduce_hook
        if hook is not None and self._overrides.force_sum:
            hook(grads)
        if divide_factor != 1:
            grads.div_(divide_factor)
        if hook is not None and not self._overrides.force_sum:
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
            if (flag == 0 and not unused_params) or not m.requires_grad:
                continue
            local = grads.narrow(0, m.spec.shard_offset, m.spec.local_numel).view(m.spec.local_shape)
            if m.sharded.grad is None:
                m.sharded.grad = dtensor_like(local, m.sharded)
            else:
                dtensor_local(m.sharded.grad).add_(local)

    def skip(self) -> None:
        """Gradient sync is off: keep the unsharded gradients, summed in
        ``reduce_dtype`` (Note [accumulation dtype])."""
        self._expect(ReduceState.READY)
        self._accumulate()
        p = self.params
        for m in p.managed:
            g = local_grad(m.unsharded)
            if g is not None and g.dtype != p.reduce_dtype:
                m.accumulated = g.to(p.reduce_dtype)
                m.unsharded.grad = None
        self.state = ReduceState.IDLE

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

    def discard(self) -> None:
        """Drop this iteration's gradients (FSDPModule.reset_iter_state): wait for
        a reduction in flight and forget it, the HSDP partial sum and the
        unsynced gradients; the sharded ``.grad`` of earlier steps stays."""
        self.wait_host_grads()
        if self.pending is not None:
            self.pending.work.wait()
        self.pending = None
        self._partial = None
        self.state = ReduceState.IDLE
        for m in self.params.managed:
            m.unsharded.grad = None
            m.accumulated = None
        self.reset_step()

    def _expect(self, *allowed: ReduceState) -> None:
        if self.state not in allowed:
            raise RuntimeError(
                f"fully_shard unit '{self.params.name}': gradient reduction is {self.state.name}, expected "
                f"{'/'.join(s.name for s in allowed)} ({self.num_ready}/{self.params.num_trainable} "
                "gradients ready)")
