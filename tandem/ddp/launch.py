"""Launching: every complete bucket's reduction, in bucket order, as soon as
its predecessors are launched (Note [launch order]): all-reduced in place
(Note [in-place reduction]), from the bucket, through a communication hook, or
reduce-scattered under ZeRO (Note [zero reduction]).

# Note [launch order]
Bucket k is launched only after buckets 0..k-1 (see Note [bucket order] in
plan.py). Gradients may become ready in a different order on different ranks
(rank-dependent control flow, or simply timing), but the sequence of collectives
each rank issues is the same: bucket 0, 1, ..., n-1, then the used-parameter map
when one is needed. Collectives are matched by issue order, so this is what keeps
ranks from reducing the wrong buffers into each other or hanging.

# Note [in-place reduction]
A bucket that holds one large parameter and no flag slot (Note [solo buckets]
in plan.py) needs no staging: its
gradient is scaled in place and all-reduced as it is, so param.grad holds the
average when the wait returns. That saves the copy into the bucket and the copy
back, two passes over the parameter's memory (41 MB on the 10M benchmark MLP).
param.grad stays a tensor of its own, as in torch. Only on the plain path: not
under ZeRO (the bucket is the reduce-scatter's input), a communication hook
(it gets the bucket's buffer), gradient_as_bucket_view (param.grad must be the
view) or check_finite (it reads the reduced buckets). A gradient that is None,
non-contiguous or of another dtype, or the .grad of a parameter that got no
gradient in this backward (it must stay as it was), is copied into the bucket
as before.

# Note [zero reduction]
Under ZeRO stages 1 and 2 (Note [flat buffer layout] in plan.py) the same buckets
are launched in the same order, but each is reduce-scattered instead of
all-reduced: rank r receives only the averaged gradients of its shard, elements
``[r * s, (r + 1) * s)`` of the bucket, in ``grad_shards[bucket]`` (a flat buffer
of ``1/world`` the size, which the sharded optimizer steps from). The full bucket
buffer is the staging area the reduce-scatter reads. The missing-gradient flag
would land in one rank's shard only, so it travels in a one-element all-reduce of
its own. ``param.grad`` is not overwritten: at stage 1 it keeps this rank's local
(unaveraged) gradient, at stage 2 it is released (None) as soon as its bucket is
launched, so that backward does not hold two full copies. At both stages the
memory of the bucket buffer is released until the next synchronised forward, so
that between steps a stage-2 rank holds only its gradient shards. Buckets are never re-planned (the optimizer's shards
are laid out over the construction-time plan).
"""

from __future__ import annotations

from tandem.ddp.bucket import Bucket
from tandem.ddp.grad_bucket import GradBucket, HookWork
from tandem.ddp.reducer_state import ReducerState, StepState

__all__ = ["Launching"]


class Launching(ReducerState):
    """The reducer's second layer: bucket launches."""

    def _launch_complete(self) -> None:
        """Launch every complete bucket whose predecessors are launched (Note [launch order])."""
        if not self.options.overlap and self.state is StepState.ARMED:
            return  # not overlapping: _finish_step launches them all
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].complete:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        spec = bucket.spec
        if bucket.single and self._in_place:  # Note [in-place reduction]
            # A parameter without a gradient this step keeps its .grad as it was.
            grad = bucket.reducible_in_place() if self._locally_used[spec.params[0]] else None
            if grad is not None:
                grad.mul_(self._div)
                bucket.in_place = True
                bucket.launched(self.comm.all_reduce(grad, tag=f"bucket {bucket.index}", async_op=True))
                return
            bucket.ensure_data()
            bucket.copy_in(0, self._div, rebind=False)
        elif not bucket.copies_per_param:
            bucket.copy_all(self._div, self.options.gradient_as_bucket_view)
        bucket.scale_deferred(self._div)  # views autograd accumulated into (Bucket.copy_in)
        if self._check is not None:  # Note [check_finite] in finite.py
            self._check.mark(bucket)
        if self._comm_hook is not None:
            if self._serialize_hooks and bucket.index > 0:
                previous = self.buckets[bucket.index - 1].work
                assert isinstance(previous, HookWork)
                previous.settle()  # Note [hook order] in grad_bucket.py
            hook_name = getattr(self._comm_hook, "__qualname__", repr(self._comm_hook))
            future = self._comm_hook(self._comm_hook_state,
                                     GradBucket(bucket, bucket.index == len(self.buckets) - 1,
                                                self.comm))
            bucket.launched(HookWork(future, bucket, hook_name))
            return
        if self._zero:
            work = self.comm.reduce_scatter(self.grad_shards[bucket.index], bucket.data,
                                            tag=f"bucket {bucket.index}", async_op=True)
            bucket.launched(work)
            if self.options.zero_stage >= 2:
                for p in bucket.params:  # copied into the bucket: free it during backward
                    p.grad = None
            return
        if spec.extra:
            # fill_ takes the value as a kernel argument; item assignment copies it from
            # the host, which waits for the GPU (Note [late flag] in late_flag.py).
            bucket.data[spec.numel].fill_(self._missing_flag)
        payload = bucket.data.narrow(0, 0, spec.numel + spec.extra)
        work = self.comm.all_reduce(payload, tag=f"bucket {bucket.index}", async_op=True)
        bucket.launched(work)
        stepper = self._stepper
        if stepper is not None and self._check is None:
            # Note [fused step] in fused.py: the local gradients are in the bucket; the averaged
            # ones will be bound at the end. Free these during backward.
            for i, p in zip(spec.params, bucket.params):
                if stepper.owns(i):
                    p.grad = None
