"""How a complete bucket is reduced: one object per kind, chosen when the
reducer is built (or a communication hook or a fused optimizer changes it),
never re-decided per gradient or per step.

* :class:`AllReduce`: the plain path, an average all-reduced from the bucket
  (or on a lone parameter's own gradient: Note [in-place reduction]), the
  missing-gradient flag in the last bucket's spare element;
* :class:`ReduceScatter`: ZeRO stages 1 and 2 (Note [zero reduction]);
* :class:`HookReduce`: a communication hook (Note [hook order] in grad_bucket.py).

Each has a ``launch`` (the bucket's collective, started), a ``settle`` (after
the last launch, before any other collective), a ``deliver`` (the averages to
``param.grad``), an ``end_step`` and a ``shadow`` (a joined rank's zeros, Note
[join mirror] in join.py): the :class:`~tandem.ddp.bucket.Reduction` protocol,
which :class:`~tandem.ddp.bucket.BucketGroup` calls in bucket order. The plain
path and a hook deliver through :class:`GradDelivery`: the averages copied back
into ``param.grad``, or ``param.grad`` left as its view of the reduced bucket
(Note [gradients born in their bucket]), with the checks that keep a gradient
the user kept from being overwritten.

# Note [in-place reduction]
A bucket that holds one large parameter and no flag slot (Note [solo buckets]
in plan.py) needs no staging: its gradient is scaled in place and all-reduced
as it is, so param.grad holds the average when the wait returns. That saves the
copy into the bucket and the copy back, two passes over the parameter's memory
(41 MB on the 10M benchmark MLP). param.grad stays a tensor of its own, as in
torch. Only on the plain path: not under ZeRO (the bucket is the
reduce-scatter's input), a communication hook (it gets the bucket's buffer),
gradient_as_bucket_view (param.grad must be the view) or check_finite (it reads
the reduced buckets). A gradient that is None, non-contiguous or of another
dtype, or the .grad of a parameter that got no gradient in this backward (it
must stay as it was), is copied into the bucket as before.

# Note [scaled by the collective]
On NCCL the average's scaling rides in the all-reduce itself: a pre-multiplied
sum (``PREMUL_SUM``, NCCL 2.11+; each rank multiplies its input by its factor
as the reduction reads it), so the bucket is not scaled by a kernel of its own
before launch. That saves the host a launch per bucket and the GPU a pass over
the bucket's memory (a solo bucket's ``mul_``, or the scaling after a batched
copy). The missing-gradient flag is scaled with the rest, which keeps "some
rank raised it" readable as a sum above zero. A joined rank's zeros go through a
pre-multiplied sum too, so that every rank issues the same operator. Not with
check_finite, whose flags are counts; and on gloo, which has no such operator,
the bucket is scaled as before.

# Note [zero reduction]
Under ZeRO stages 1 and 2 (Note [flat buffer layout] in plan.py) the same buckets
are launched in the same order, but each is reduce-scattered instead of
all-reduced: rank r receives only the averaged gradients of its shard, elements
``[r * s, (r + 1) * s)`` of the bucket, in ``grad_shards[bucket]`` (a flat buffer
of ``1/world`` the size, which the sharded optimizer steps from). The full bucket
buffer is the staging area the reduce-scatter reads. The missing-gradient flag
would land in one rank's shard only, so it travels in a one-element all-reduce of
its own. ``param.grad`` is not what the optimizer steps: at stage 2 it is
released (None) as soon as its bucket is launched, at stage 1 at the end of
backward, when every shard has landed (as DeepSpeed's stage 1: holding it
through the step cost a model's worth of memory). Between steps a rank holds
only its gradient shards (Note [zero buckets]). Gradients accumulate across
backwards under ``no_sync`` only, as in every ZeRO: a synchronised backward's
reduction overwrites the shards.

# Note [zero buckets]
Under ZeRO a bucket is only a staging area for its collective, so each has
memory of its own rather than a slice of one flat buffer, held only while
backward needs it: the first bucket takes its memory when the step is armed,
bucket k + 1 when bucket k is launched (or when a gradient of it arrives
first), and every bucket gives it back at the end of backward, once its shard
is taken. A bucket takes its memory zeroed and binds the ``.grad`` of each of
its parameters that has none to its view, so autograd accumulates the gradient
into the bucket (``param.grad += new``): no gradient tensor of the model's size
exists beside the buckets, and nothing is copied in (the bucket is scaled in
place at launch, ``Bucket.deferred``). A gradient that exists already (under
``no_sync``) or arrives before its bucket has memory is copied in as before.
What backward holds at most is then the buckets from the first to the one
after the bucket last launched, not the whole model's gradients twice
(BENCHMARKS.md has the peak it gives, against DeepSpeed's stage 2). A ``.grad`` the user kept
past backward keeps its memory: the bucket then moves to new memory rather
than free that one (``Bucket.give_back_memory``).

# Note [gradients born in their bucket]
Averaged gradients are not copied back to ``param.grad``: after a synchronised
step, ``param.grad`` is the parameter's view of its reduced bucket (as under
torch's ``gradient_as_bucket_view=True``), so the copy back is gone; and where
the user keeps gradients between steps (``zero_grad(set_to_none=False)``,
accumulation under no_sync) autograd accumulates straight into the bucket and
the copy in is gone too: the bucket is scaled in place at launch
(``Bucket.deferred`` for a view that may still receive a second gradient).
After ``zero_grad(set_to_none=True)`` autograd makes a fresh gradient, which is
copied in (scaled) as before. What torch's default lets a user observe stays true:

* a tensor the user assigned to ``param.grad`` before the forward stays
  ``param.grad`` and receives the average by copy (``_foreign``);
* a parameter unused in a backward keeps its ``.grad`` untouched (it gets a
  tensor of its own before its bucket, which it shared, is scaled: ``_mark_unused``);
* an old gradient the user kept (``g = p.grad``, or a view of it) is never
  overwritten: at the start of each synchronised backward, before any bucket is
  written, the reducer checks that nothing outside it holds the buckets' memory
  (the buffer's storage use count, and the Python references of each view that
  its parameter no longer holds: ``_escaped``) and otherwise moves the buckets to
  new memory (``_rebase``), which the kept tensors no longer share.

The fresh gradients that the views replace are freed at the start of the next
forward (``_retired``), not at the end of backward: that is when torch frees
them (``zero_grad(set_to_none=True)``), and the forward's activations then reuse
their memory. Freed at the end of backward, 40 MB at once, glibc trims the top
of its heap and the next backward faults every page of its fresh gradients back
in: on the benchmark transformer 5,000-10,000 minor page faults and about 20 ms
per step, depending on the process's allocation history (BENCHMARKS.md, "page
faults"). Peak memory is the same either way (backward holds both); between a
step and the next forward the process holds what torch's DDP holds.

What differs: ``param.grad`` is a view of a larger buffer (``torch.save`` of a
lone ``.grad`` saves the buffer; ``.grad.data_ptr()`` points into the bucket).
Not under ZeRO, gradient_as_bucket_view (which binds views its own way),
check_finite (a step may be dropped after the buckets are written), a fused
optimizer, distributed autograd, solo buckets (Note [in-place reduction] in reduction.py: they
have no bucket memory) or tensor-parallel parameters: there the copy back stays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from tandem._compat import foreach_copy_
from tandem.comm.group import GroupComm
from tandem.ddp.bucket import Bucket, GradBuffer, PendingReduction, StepInputs
from tandem.ddp.finite import FiniteCheck
from tandem.ddp.fused import BucketStepper
from tandem.ddp.grad_bucket import CommHook, GradBucket, HookWork
from tandem.dtensor import local_grad, set_local_grad

__all__ = ["AllReduce", "GradDelivery", "HookReduce", "ReduceScatter", "bind_views", "foreign_grads",
           "views_escaped", "write_back"]




class AllReduce:
    """The plain path: each bucket's average all-reduced."""

    flag_alone = False

    def __init__(self, comm: GroupComm, delivery: GradDelivery, *, check: FiniteCheck | None,
                 stepper: BucketStepper | None) -> None:
        self._comm, self._delivery, self._check = comm, delivery, check
        # Note [fused step] in fused.py: the local gradients are in the bucket; the averaged
        # ones are bound at the end. Freed during backward (not when the step may be dropped).
        self._frees = stepper if check is None else None
        self._stepper = stepper
        self.on_lone_grad = not (delivery.as_view or check is not None)
        # Note [scaled by the collective]: the operator per factor, made once.
        self._premul: dict[float, Any] | None = {} if check is None and _has_premul_sum(comm) else None

    def _op(self, div: float) -> tuple[float, Any]:
        """The scaling left to do before launch, and the collective's operator."""
        if self._premul is None:
            return div, dist.ReduceOp.SUM
        op = self._premul.get(div)
        if op is None:
            op = self._premul[div] = dist._make_nccl_premul_sum(div)
        return 1.0, op

    def launch(self, bucket: Bucket, step: StepInputs, is_last: bool) -> None:
        spec = bucket.spec
        scale, op = self._op(step.div)
        if bucket.reduces_in_place:  # Note [in-place reduction]
            # A parameter without a gradient this step keeps its .grad as it was.
            grad = bucket.reducible_in_place() if step.used[spec.params[0]] else None
            if grad is not None:
                if scale != 1.0:
                    grad.mul_(scale)
                bucket.reduced_on_grad = True
                bucket.launched(self._comm.all_reduce(grad, op=op, tag=f"bucket {bucket.index}", async_op=True))
                return
            bucket.ensure_data()
            bucket.copy_in(0, scale, rebind=False)
            bucket.scale_deferred(scale)
        else:
            bucket.fill(scale, self._delivery.as_view)
        if self._check is not None:  # Note [check_finite] in finite.py
            self._check.mark(bucket)
        if spec.extra:
            # fill_ takes the value as a kernel argument; item assignment copies it from
            # the host, which waits for the GPU (Note [late flag] in late_flag.py).
            bucket.data[spec.numel].fill_(step.missing_flag)
        payload = bucket.data.narrow(0, 0, spec.numel + spec.extra)
        bucket.launched(self._comm.all_reduce(payload, op=op, tag=f"bucket {bucket.index}", async_op=True))
        if self._frees is not None:
            for i, p in zip(spec.params, bucket.params):
                if self._frees.owns(i):
                    p.grad = None

    def settle(self, buckets: Sequence[Bucket]) -> None:
        pass

    def deliver(self, bucket: Bucket, used: list[int] | None) -> None:
        self._delivery.deliver(bucket, used, self._stepper)

    def end_step(self, params: Sequence[torch.nn.Parameter], buckets: Sequence[Bucket]) -> None:
        pass

    def shadow(self, bucket: Bucket, is_last: bool) -> PendingReduction:
        spec = bucket.spec
        zeros = torch.zeros(spec.numel + spec.extra, dtype=spec.dtype, device=spec.device)
        # Note [scaled by the collective]: the same operator as the ranks still training.
        _, op = self._op(1.0)
        return self._comm.all_reduce(zeros, op=op, tag=f"bucket {bucket.index}", async_op=True)


class ReduceScatter:
    """ZeRO stages 1 and 2: each bucket reduce-scattered into this rank's shard
    (Note [zero reduction])."""

    on_lone_grad = False
    flag_alone = True

    def __init__(self, comm: GroupComm, shards: list[torch.Tensor], stage: int, *,
                 check: FiniteCheck | None) -> None:
        self._comm, self._shards, self._check = comm, shards, check
        self._frees_grads = stage >= 2  # during backward; stage 1 at its end
        device = shards[0].device if shards else comm.device
        # Note [gloo's reduce-scatter] in tandem/comm/group.py: in place where that is
        # an all-reduce, the shard copied out of the bucket when it is waited for
        self._chunk_in_bucket = comm.in_place_scatter_all_reduces(device)

    def launch(self, bucket: Bucket, step: StepInputs, is_last: bool) -> None:
        bucket.fill(step.div, False)
        if self._check is not None:  # Note [check_finite] in finite.py
            self._check.mark(bucket)
        work = self._comm.reduce_scatter(self._output(bucket, bucket.data), bucket.data,
                                         tag=f"bucket {bucket.index}", async_op=True)
        bucket.launched(work)
        if self._frees_grads:
            for p in bucket.params:  # copied into the bucket: free it during backward
                p.grad = None

    def settle(self, buckets: Sequence[Bucket]) -> None:
        pass

    def _output(self, bucket: Bucket, input: torch.Tensor) -> torch.Tensor:
        """Where this rank's chunk of the sum lands: its shard, or on gloo its chunk of ``input``."""
        shard = self._shards[bucket.index]
        return input.narrow(0, self._comm.rank * shard.numel(), shard.numel()) if self._chunk_in_bucket else shard

    def deliver(self, bucket: Bucket, used: list[int] | None) -> None:
        if self._chunk_in_bucket:  # the optimizer steps from the shards: this rank's, copied out
            self._shards[bucket.index].copy_(self._output(bucket, bucket.data))

    def end_step(self, params: Sequence[torch.nn.Parameter], buckets: Sequence[Bucket]) -> None:
        for p in params:
            p.grad = None
        for bucket in buckets:  # Note [zero buckets]
            bucket.give_back_memory()

    def shadow(self, bucket: Bucket, is_last: bool) -> PendingReduction:
        spec = bucket.spec
        zeros = torch.zeros(spec.padded_numel, dtype=spec.dtype, device=spec.device)
        # the collective the ranks still training issue (in place on gloo), and zeros for this shard
        return self._comm.reduce_scatter(self._output(bucket, zeros), zeros, tag=f"bucket {bucket.index}",
                                         async_op=True)


class HookReduce:
    """Each bucket's sum handed to a communication hook, whose future brings the
    average back (Note [hook order] in grad_bucket.py)."""

    on_lone_grad = False
    flag_alone = True

    def __init__(self, comm: GroupComm, hook: CommHook, state: object, delivery: GradDelivery, *,
                 serialize: bool, check: FiniteCheck | None, stepper: BucketStepper | None) -> None:
        self._comm, self._hook, self._state, self._delivery = comm, hook, state, delivery
        self._serialize, self._check, self._stepper = serialize, check, stepper
        self.name = getattr(hook, "__qualname__", repr(hook))
        self._previous: HookWork | None = None
        # A hook that raised in this step (a collective it waited for inside, a peer
        # lost): its error is the bucket's, raised where a reduction's would be, at the
        # end of backward (Note [recovered reduction failures] in reducer.py), and the
        # later buckets' hooks are not called on the broken group.
        self._failed: BaseException | None = None

    def launch(self, bucket: Bucket, step: StepInputs, is_last: bool) -> None:
        bucket.fill(step.div, self._delivery.as_view)
        if self._check is not None:  # Note [check_finite] in finite.py
            self._check.mark(bucket)
        if self._serialize and bucket.index > 0:
            assert self._previous is not None
            self._previous.await_hook()  # Note [hook order] in grad_bucket.py
        future = None
        if self._failed is None:
            try:
                future = self._hook(self._state, GradBucket(bucket, is_last, self._comm))
            except Exception as e:
                self._failed = e
        if future is None:
            future = torch.futures.Future()
            future.set_exception(self._failed)  # type: ignore[arg-type]  # torch's stub says Tensor
        work = HookWork(future, bucket, self.name)
        self._previous = work
        bucket.launched(work)

    def settle(self, buckets: Sequence[Bucket]) -> None:
        # The last hook may still issue collectives from its callbacks: let it
        # finish before anything else goes on the wire (Note [hook order]).
        if self._serialize and self._previous is not None:
            self._previous.await_hook()
        self._previous = None
        self._failed = None

    def deliver(self, bucket: Bucket, used: list[int] | None) -> None:
        self._delivery.deliver(bucket, used, self._stepper)

    def end_step(self, params: Sequence[torch.nn.Parameter], buckets: Sequence[Bucket]) -> None:
        pass

    def shadow(self, bucket: Bucket, is_last: bool) -> PendingReduction:
        # As torch: the hook runs on a zero bucket, one bucket after another (the
        # strictest Note [hook order]).
        bucket.ensure_data()
        bucket.grads.zero_()
        work = HookWork(self._hook(self._state, GradBucket(bucket, is_last, self._comm)), bucket, self.name)
        work.await_hook()
        return work


def _has_premul_sum(comm: GroupComm) -> bool:
    """Whether ``comm`` reduces on NCCL with a pre-multiplied sum (Note [scaled by the collective])."""
    return (hasattr(dist, "_make_nccl_premul_sum") and torch.cuda.is_available()
            and dist.get_backend(comm.group) == "nccl")


class GradDelivery:
    """How a reduced bucket's averages reach ``param.grad``: copied back, bound as
    the bucket's views (``gradient_as_bucket_view``, a fused optimizer's own), or
    left bound where they were born (Note [gradients born in their bucket]).
    Which is chosen when the reducer is built; whether views may stay bound, at
    each forward (not inside a distributed autograd context)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], *, as_view: bool, born: bool) -> None:
        self.params = params
        self.as_view = as_view
        self.born = born        # views may stay bound at all (else the copy back stays)
        self.rebind = False     # this step: views stay bound
        self.foreign: set[int] = set()         # params whose .grad is the user's tensor: copied into
        self.retired: list[torch.Tensor] = []  # backward's fresh gradients, until the next forward

    def arm(self, buckets: Sequence[Bucket], *, rebind: bool) -> None:
        self.rebind = self.born and rebind
        if self.rebind:
            self.foreign = foreign_grads(buckets)

    def deliver(self, bucket: Bucket, globally_used: list[int] | None, stepper: BucketStepper | None) -> None:
        if bucket.reduced_on_grad:
            return  # param.grad holds the average already (Note [in-place reduction] in reduction.py)
        if self.rebind and bucket.bindable:
            bind_views(bucket, self.params, globally_used, self.foreign, self.retired)
            return
        write_back(bucket, self.params, globally_used, as_view=self.as_view, stepper=stepper)


def _bindable(buckets: Sequence[Bucket]) -> list[Bucket]:
    """Buckets whose views param.grad may be left bound to (Note [gradients born
    in their bucket])."""
    return [b for b in buckets if b.bindable]


def foreign_grads(buckets: Sequence[Bucket]) -> set[int]:
    """The parameters whose ``.grad`` is a tensor of the user's, not their view:
    the average is copied into it (``_foreign`` in Note [gradients born in their bucket])."""
    return {i for b in _bindable(buckets) for i, p, v in zip(b.spec.params, b.params, b.views)
            if (g := p.grad) is not None and g is not v}


def views_escaped(buffer: GradBuffer, buckets: Sequence[Bucket]) -> bool:
    """Whether something outside the reducer holds memory of the buckets that
    the coming step will write: a view derived from an old .grad (the buffer's
    use count), or an old .grad itself that the parameter no longer holds."""
    return buffer.escaped() or any(b.views_held_elsewhere() for b in _bindable(buckets))


def write_back(bucket: Bucket, params: Sequence[torch.Tensor], globally_used: list[int] | None, *,
               as_view: bool, stepper: BucketStepper | None) -> None:
    """Copy a reduced bucket's averages into ``param.grad`` (or bind ``param.grad``
    to its view, under ``gradient_as_bucket_view`` or for a fused optimizer's own)."""
    if not as_view and stepper is None and globally_used is None:
        grads = bucket.local_grads()
        if all(g is not None for g in grads):  # the common case, in one call
            foreach_copy_(cast("list[torch.Tensor]", grads), bucket.views)
            return
    copy_dst, copy_src = [], []
    for pos, i in enumerate(bucket.spec.params):
        if globally_used is not None and not globally_used[i]:
            continue  # unused on every rank: .grad stays as it was, like torch
        p, view = params[i], bucket.views[pos]
        grad = local_grad(p)
        if as_view or (stepper is not None and stepper.owns(i)):
            if grad is None or grad.data_ptr() != view.data_ptr():
                set_local_grad(p, view)
        elif grad is None:  # in the parameter's dtype, where the bucket has a reduce dtype
            set_local_grad(p, view.to(dtype=p.dtype, copy=True))
        else:
            copy_dst.append(grad)
            copy_src.append(view)
    if copy_dst:
        foreach_copy_(copy_dst, copy_src)


def bind_views(bucket: Bucket, params: Sequence[torch.Tensor], globally_used: list[int] | None,
               foreign: set[int], retired: list[torch.Tensor]) -> None:
    """Note [gradients born in their bucket]: param.grad becomes (or stays) its
    view of the reduced bucket; a tensor the user gave as .grad gets a copy."""
    copy_dst, copy_src = [], []
    for i, view in zip(bucket.spec.params, bucket.views):
        if globally_used is not None and not globally_used[i]:
            continue  # unused on every rank: .grad stays as it was, like torch
        p = params[i]
        grad = p.grad
        if grad is view:
            continue
        if grad is not None and i in foreign:
            copy_dst.append(grad)
            copy_src.append(view)
        else:
            if grad is not None:
                retired.append(grad)
            p.grad = view
    if copy_dst:
        foreach_copy_(copy_dst, copy_src)
