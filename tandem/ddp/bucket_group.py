"""The reducer's buckets and their reduction: a flat buffer planned over the
parameters (re-planned in arrival order, moved to new memory when a kept
gradient holds the old), the buckets cut from it, and one
:class:`~tandem.ddp.reduction.Reduction` that launches each complete bucket in
bucket order (Note [launch order]) and delivers it once reduced.

# Note [launch order]
Bucket k is launched only after buckets 0..k-1 (see Note [bucket order] in
plan.py). Gradients may become ready in a different order on different ranks
(rank-dependent control flow, or simply timing), but the sequence of collectives
each rank issues is the same: bucket 0, 1, ..., n-1, then the used-parameter map
when one is needed. Collectives are matched by issue order, so this is what keeps
ranks from reducing the wrong buffers into each other or hanging.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import torch

from tandem.comm.group import GroupComm
from tandem.ddp.bucket import Bucket, BucketState, GradBuffer, PendingReduction
from tandem.ddp.errors import gradient_twice
from tandem.ddp.plan import BucketPlan, ParamInfo, plan_ddp_buckets
from tandem.ddp.reduction import Reduction, StepInputs
from tandem.dtensor import local_grad, local_tensor, set_local_grad

__all__ = ["BucketGroup"]

logger = logging.getLogger(__name__)


class BucketGroup:
    """The buckets of one reducer and their reduction, step by step.

    Args:
        named_params: the parameters, in registration order.
        comm: the group the buckets are reduced over.
        caps: byte cap per bucket index (the last one repeats).
        zero: ZeRO's layout (Note [flat buffer layout] in plan.py), with a shard
            buffer of ``1/world`` the size for the reduce-scatters' output.
        as_view: ``gradient_as_bucket_view``: param.grad is its view of the bucket.
        check_finite: leave room for check_finite's flags (Note [check_finite] in finite.py).
        overlap: launch complete buckets during backward (else all at its end).
    """

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], comm: GroupComm, *,
                 caps: tuple[int, ...], zero: bool, as_view: bool, check_finite: bool, overlap: bool) -> None:
        self.comm = comm
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        # Note [tensor-parallel parameters] in tandem/dtensor.py: buckets hold local shards.
        self._infos = [ParamInfo(n, local_tensor(p).numel(), p.dtype, p.device) for n, p in named_params]
        self._caps, self._zero, self._as_view, self._check_finite = caps, zero, as_view, check_finite
        self._overlap = overlap
        self.reduction: Reduction | None = None
        self.grad_shards: list[torch.Tensor] = []  # Note [zero reduction] in reduction.py
        self.plan: BucketPlan
        self.buffer: GradBuffer
        self.buckets: list[Bucket] = []
        self._where: list[tuple[int, int]] = []
        self.step = StepInputs(1.0 / comm.size)
        self._next_launch = 0
        self._holding = False
        self._has_memory: list[bool] = []  # ZeRO: which buckets hold memory this step
        self.build(list(reversed(range(len(self.params)))))

    # ------------------------------------------------------------------ planning
    def build(self, order: list[int]) -> None:
        """Plan the buckets over ``order`` and give them a new buffer."""
        plan = plan_ddp_buckets(self._infos, order, self._caps, self.comm.size, zero=self._zero,
                                gradient_as_bucket_view=self._as_view, check_finite=self._check_finite)
        # ZeRO: every bucket has memory of its own, taken when backward nears it
        # and given back after (Note [zero buckets] in reduction.py).
        buffer = GradBuffer({}, solo=plan.buckets) if self._zero else \
            GradBuffer(plan.buffer_numel, solo=tuple(s for s in plan.buckets if s.solo))
        self.buckets = [Bucket(spec, [self.params[i] for i in spec.params],
                               [self.names[i] for i in spec.params], buffer.slice(spec))
                        for spec in plan.buckets]
        buffer.release_solo()  # the views exist: Note [solo buckets] in plan.py
        for b in self.buckets:  # for hang reports (tandem.comm.ledger)
            self.comm.ledger.describe_params(f"bucket {b.index}", b.names)
            if self.reduction is not None:
                b.configure(on_lone_grad=self.reduction.on_lone_grad)
        self.plan, self.buffer = plan, buffer
        if self._zero:
            size = self.comm.size
            shards = GradBuffer({key: n // size for key, n in plan.buffer_numel.items()})
            self.grad_shards[:] = [shards.slice_shard(spec, size) for spec in plan.buckets]
        self._where = [(0, 0)] * len(self.params)
        for b in self.buckets:
            for pos, i in enumerate(b.spec.params):
                self._where[i] = (b.index, pos)
        if self._as_view:
            # Existing gradients move into the (new) buffer and param.grad becomes the view.
            for i, p in enumerate(self.params):
                grad = local_grad(p)
                if grad is not None:
                    view = self.view(i)
                    view.copy_(grad)
                    set_local_grad(p, view)
        buffer.count_views()

    def rebase(self) -> None:
        """Give the buckets memory of their own again: a tensor outside the reducer
        still holds the old memory (Note [gradients born in their bucket] in write_back.py)."""
        self.build(self.order())
        self._reset_buckets()
        logger.debug("DDP: a tensor on the gradient buckets' memory is held outside the reducer "
                     "(a kept view of param.grad): the buckets moved to new memory")

    def order(self) -> list[int]:
        """The parameters in bucket order (the plan's)."""
        return [i for spec in self.plan.buckets for i in spec.params]

    def use(self, reduction: Reduction) -> None:
        """Reduce with ``reduction`` from now on (chosen by the reducer when it is
        built, and again when a hook or a fused optimizer changes it)."""
        self.reduction = reduction
        for b in self.buckets:
            b.configure(on_lone_grad=reduction.on_lone_grad)

    def view(self, i: int) -> torch.Tensor:
        b, pos = self._where[i]
        return self.buckets[b].views[pos]

    # ------------------------------------------------------------------ a step
    def start(self, step: StepInputs) -> None:
        """A synchronised forward armed a step: every bucket starts filling."""
        self.step = step
        self._reset_buckets()
        self._next_launch = 0
        self._holding = not self._overlap
        if self._zero:  # Note [zero buckets] in reduction.py
            self._has_memory = [False] * len(self.buckets)
            for b in self.buckets[:1] if self._overlap else self.buckets:
                self._take_memory(b.index)

    def _take_memory(self, b: int) -> None:
        self._has_memory[b] = True
        self.buckets[b].take_memory()

    def _reset_buckets(self) -> None:
        for b in self.buckets:
            b.reset()
            if b.spec.solo and not b.reduces_in_place:  # a hook was registered: it needs the bucket
                b.ensure_data()

    def take(self, i: int) -> bool:
        """Note [hook fast path] in reducer.py: mark parameter ``i`` ready if its
        bucket copies its gradients in one batch and it is the first arrival;
        False: it needs :meth:`ready`."""
        b, pos = self._where[i]
        bucket = self.buckets[b]
        ready = bucket.ready
        if ready[pos] or bucket.copy_on_ready or bucket.state is not BucketState.FILLING:
            return False
        if self._zero and not self._has_memory[b]:
            self._take_memory(b)
        ready[pos] = True
        bucket.num_ready += 1
        if bucket.num_ready == bucket.size:
            self.launch_complete()
        return True

    def ready(self, i: int) -> bool:
        """Parameter i's gradient is final for this backward: copy it in (or leave
        that to its bucket, Note [copy granularity] in bucket.py), mark it, launch
        what can go. Returns whether it was newly marked."""
        b, pos = self._where[i]
        bucket = self.buckets[b]
        if bucket.ready[pos] or bucket.state is not BucketState.FILLING:
            self._ready_again(i, bucket, pos)
            return False
        if self._zero and not self._has_memory[b]:
            self._take_memory(b)  # a gradient that arrived before its bucket had memory: copied in
        if bucket.copy_on_ready:
            bucket.copy_in(pos, self.step.div, self._as_view)
        bucket.mark_ready(pos)
        if bucket.complete:
            self.launch_complete()
        return True

    def _ready_again(self, i: int, bucket: Bucket, pos: int) -> None:
        """A second gradient for a parameter in one backward. Harmless while its
        bucket still fills and the gradient is a separate tensor (copy the sum
        again); otherwise the first one was already taken."""
        if bucket.state is BucketState.FILLING and bucket.ready[pos]:
            if bucket.copies_per_param and bucket.grad_is_view(pos):
                if pos in bucket.deferred:
                    return  # autograd added to the view again; scaled at launch
            else:
                if bucket.copy_on_ready:
                    bucket.copy_in(pos, self.step.div, self._as_view)
                return
        raise RuntimeError(gradient_twice(self.comm.rank, self.names[i], bucket.index))

    def ready_unused(self, i: int, *, keep_grad: bool) -> None:
        """Parameter i gets no gradient in this backward: it contributes its current
        .grad (zeros when None, as torch). With ``keep_grad`` a .grad that is its
        bucket's view gets a tensor of its own first: it must stay as it was
        (Note [gradients born in their bucket] in write_back.py)."""
        b, pos = self._where[i]
        bucket = self.buckets[b]
        if not bucket.ready[pos]:
            if keep_grad and bucket.grad_is_view(pos):
                p = self.params[i]
                p.grad = cast(torch.Tensor, p.grad).clone()
            self.ready(i)

    def launch_complete(self) -> None:
        """Launch every complete bucket whose predecessors are launched (Note [launch order])."""
        if self._holding:
            return  # not overlapping: launch_rest launches them all
        buckets, reduction = self.buckets, self.reduction
        assert reduction is not None
        last = len(buckets) - 1
        while self._next_launch <= last and buckets[self._next_launch].complete:
            reduction.launch(buckets[self._next_launch], self.step, self._next_launch == last)
            self._next_launch += 1
            if self._zero and self._next_launch <= last and not self._has_memory[self._next_launch]:
                self._take_memory(self._next_launch)  # the next bucket's gradients are born in it

    def launch_rest(self) -> None:
        """End of backward: every bucket is complete; launch those not yet launched."""
        self._holding = False
        self.launch_complete()
        assert self._next_launch == len(self.buckets), "every bucket is complete and launched"
        assert self.reduction is not None
        self.reduction.settle(self.buckets)

    def missing(self) -> list[int]:
        """The parameters whose gradient has not arrived in this backward."""
        return [i for b in self.buckets for pos, i in enumerate(b.spec.params) if not b.ready[pos]]

    def waiting_for(self) -> list[str]:
        """The parameters that buckets still filling wait for."""
        return [n for b in self.buckets if b.state is BucketState.FILLING for n in b.missing()]

    def armed(self) -> bool:
        """Whether a gradient of this step has arrived."""
        return any(b.num_ready for b in self.buckets)

    def shadow(self) -> list[PendingReduction]:
        """A joined rank's reductions of zeros, bucket by bucket (Note [join mirror] in join.py)."""
        assert self.reduction is not None
        last = len(self.buckets) - 1
        return [self.reduction.shadow(b, b.index == last) for b in self.buckets]
