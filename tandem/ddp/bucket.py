"""The gradient buckets: one flat buffer planned over the parameters (planned
again in arrival order, moved to new memory when a kept gradient holds the
old), the buckets cut from it with the state of their reduction in the current
backward, and :class:`BucketGroup`, one reducer's buckets, which launches each
complete bucket in bucket order (Note [launch order]) through the
:class:`Reduction` the reducer chose (tandem/ddp/reduction.py implements it).

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
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Protocol, cast

import torch

from tandem._compat import foreach_copy_, storage_use_count
from tandem.comm.group import GroupComm
from tandem.ddp.checks import NonFinite
from tandem.ddp.errors import gradient_twice
from tandem.ddp.plan import BucketPlan, BucketSpec, ParamInfo, plan_ddp_buckets
from tandem.dtensor import is_distributed, local_grad, local_tensor, set_local_grad

__all__ = ["Bucket", "BucketGroup", "BucketState", "GradBuffer", "PendingReduction", "ReducerOptions", "Reduction",
           "StepInputs"]

logger = logging.getLogger(__name__)


class PendingReduction(Protocol):
    """A bucket's reduction in flight: a collective's
    :class:`~tandem.comm.group.Work`, or a communication hook's future
    (:class:`~tandem.ddp.grad_bucket.HookWork`, which builds on buckets)."""

    def wait(self) -> None: ...

# Average parameter size (elements) under which a bucket copies its gradients in
# one batch when complete rather than one by one (Note [copy granularity]).
_BATCH_COPY_BELOW = 16384
# References to a bucket's view while only the bucket holds it: its list, and
# sys.getrefcount's argument (views_held_elsewhere).
_VIEW_REFS = 2


class BucketState(Enum):
    FILLING = auto()     # gradients of this step still arriving
    IN_FLIGHT = auto()   # reduction launched, not yet waited on
    REDUCED = auto()     # averaged gradients in the buffer


class GradBuffer:
    """One flat, contiguous gradient tensor per (device, dtype) of a plan.

    See Note [flat buffer layout] in plan.py. ZeRO reuses this buffer: a bucket's
    shard for rank r is ``bucket.data.view(world, -1)[r]``.
    """

    def __init__(self, numel_by_key: dict[tuple[torch.device, torch.dtype], int],
                 solo: tuple[BucketSpec, ...] = ()) -> None:
        self.flat: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {
            key: torch.zeros(n, dtype=key[1], device=key[0]) for key, n in numel_by_key.items()}
        # Note [solo buckets] in plan.py: staging tensors, without memory once the
        # buckets' views exist (release_solo) until a step needs them.
        self.solo: dict[int, torch.Tensor] = {
            spec.index: torch.empty(spec.padded_numel, dtype=spec.dtype, device=spec.device) for spec in solo}

        self._views: dict[tuple[torch.device, torch.dtype], int | None] = {}

    def count_views(self) -> None:
        """Remember how many tensors share each flat buffer now, when only the
        reducer's own views do (Note [gradients born in their bucket] in reduction.py)."""
        self._views = {key: storage_use_count(t) for key, t in self.flat.items()}

    def escaped(self) -> bool:
        """Whether a tensor on the buffer's memory was made since :meth:`count_views`
        and is still alive (a view of ``param.grad`` the user kept, say)."""
        for key, t in self.flat.items():
            counted = self._views.get(key)
            if counted is None:
                return True  # never counted, or this torch cannot count: assume the worst
            count = storage_use_count(t)
            if count is None or count > counted:
                return True
        return False

    def slice(self, spec: BucketSpec) -> torch.Tensor:
        if spec.index in self.solo:  # a solo bucket's staging, or a ZeRO bucket's own memory
            return self.solo[spec.index]
        return self.flat[(spec.device, spec.dtype)].narrow(0, spec.buffer_offset, spec.padded_numel)

    def release_solo(self) -> None:
        for t in self.solo.values():
            t.untyped_storage().resize_(0)

    @property
    def held_bytes(self) -> int:
        """Bytes of memory the buffer holds now (solo staging only once used)."""
        return sum(t.untyped_storage().nbytes() for t in (*self.flat.values(), *self.solo.values()))

    @property
    def released(self) -> bool:
        """Whether no tensor of the buffer holds memory (ZeRO between steps)."""
        return all(t.untyped_storage().size() == 0 for t in (*self.flat.values(), *self.solo.values()) if t.numel())

    def slice_shard(self, spec: BucketSpec, world_size: int) -> torch.Tensor:
        """In a buffer of ``1/world_size`` the plan's size: one rank's shard of the bucket."""
        return self.flat[(spec.device, spec.dtype)].narrow(
            0, spec.buffer_offset // world_size, spec.padded_numel // world_size)


class Bucket:
    """The parameters of one :class:`BucketSpec` and their gradient views."""

    def __init__(self, spec: BucketSpec, params: list[torch.nn.Parameter], names: list[str],
                 data: torch.Tensor) -> None:
        self.spec = spec
        # Note [copy granularity]: on the CPU, large parameters are scaled into the
        # bucket as each becomes ready (one fused pass over memory, early); a bucket
        # of small ones is filled with one batched copy and one scaling when it is
        # complete (per parameter, the Python and dispatch overhead would dominate).
        # On an accelerator every bucket is filled in one batch: kernels run
        # asynchronously, so what a copy costs the host (a Python call and a launch
        # per parameter, on the autograd engine's thread) is what matters there.
        self.copies_per_param = spec.device.type == "cpu" and spec.numel >= _BATCH_COPY_BELOW * len(params)
        self.index = spec.index
        self.params = params
        self.size = len(params)
        self.names = names
        self._use_data(data)
        self.tensor_parallel = any(map(is_distributed, params))  # else .grad is the local gradient
        # param.grad may stay bound to its view between steps (Note [gradients born in
        # their bucket] in reduction.py): not a solo bucket's staging, not tensor-parallel shards.
        # A view is a .grad only of a parameter of its dtype (not under a reduce dtype).
        self.bindable = not spec.solo and not self.tensor_parallel and all(p.dtype == spec.dtype for p in params)
        # Note [in-place reduction] in reduction.py: one parameter and no flag slot (a
        # planned solo bucket, or one parameter over the cap) can reduce on its .grad.
        self.single = len(params) == 1 and spec.extra == 0
        # Chosen with the reduction (configure): whether this bucket reduces on param.grad
        # itself, and whether a gradient is copied in as it becomes ready (else at launch).
        self.reduces_in_place = False
        self.copy_on_ready = self.copies_per_param
        self.reduced_on_grad = False  # this step's reduction runs on param.grad itself
        # Positions whose gradient autograd accumulated into the view itself, to be
        # scaled at launch (a second gradient may still add to it until then).
        self.deferred: list[int] = []
        self.state = BucketState.REDUCED
        self.ready = [False] * len(params)
        self.num_ready = 0
        self.work: PendingReduction | None = None

    def _use_data(self, data: torch.Tensor) -> None:
        self.data = data                                  # the whole padded slice
        self.grads = data.narrow(0, 0, self.spec.numel)   # the parameters' region
        # Shaped like each parameter's local tensor: Note [tensor-parallel parameters] in tandem/dtensor.py.
        self.views = [data.narrow(0, off, local.numel()).view_as(local)
                      for off, local in zip(self.spec.offsets, map(local_tensor, self.params))]
        self._own_uses = storage_use_count(data)  # the tensors above, and the buffer's own

    def take_memory(self) -> None:
        """ZeRO (Note [zero buckets] in reduction.py): this bucket's memory,
        zeroed, and the ``.grad`` of every parameter without one bound to its
        view, so that autograd accumulates the gradient into the bucket."""
        storage = self.data.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.data.numel() * self.data.element_size())
        self.data.zero_()
        for p, view in zip(self.params, self.views):
            if p.grad is None:
                p.grad = view

    def give_back_memory(self) -> None:
        """ZeRO, after backward (``param.grad`` is None again): free this bucket's
        memory, unless a tensor outside the bucket still uses it (a ``.grad`` the
        user kept): then that memory stays the user's and the bucket gets new."""
        views, params = self.views, self.params
        kept = any(params[k].grad is views[k] or sys.getrefcount(views[k]) > _VIEW_REFS
                   for k in range(len(views)))
        uses = storage_use_count(self.data)
        if kept or uses is None or self._own_uses is None or uses > self._own_uses:
            self._use_data(torch.empty(0, dtype=self.data.dtype, device=self.data.device)
                           .resize_(self.data.numel()))
        self.data.untyped_storage().resize_(0)

    def configure(self, *, on_lone_grad: bool) -> None:
        """Fix how gradients reach this bucket, for the reduction chosen: with
        ``on_lone_grad`` (a reduction that may run on a lone parameter's .grad, Note
        [in-place reduction] in reduction.py) a single-parameter bucket copies nothing."""
        self.reduces_in_place = self.single and on_lone_grad
        self.copy_on_ready = self.copies_per_param and not self.reduces_in_place

    @property
    def complete(self) -> bool:
        return self.num_ready == self.size

    def reset(self) -> None:
        """Start a new step: no gradient has arrived yet."""
        self._expect(BucketState.REDUCED, BucketState.FILLING)
        self.state = BucketState.FILLING
        self.ready = [False] * len(self.params)
        self.num_ready = 0
        self.work = None
        self.reduced_on_grad = False
        self.deferred = []

    def mark_ready(self, pos: int) -> None:
        if self.state is not BucketState.FILLING:  # hot path: check before calling
            self._expect(BucketState.FILLING)
        if not self.ready[pos]:
            self.ready[pos] = True
            self.num_ready += 1

    def launched(self, work: PendingReduction) -> None:
        self._expect(BucketState.FILLING)
        self.state = BucketState.IN_FLIGHT
        self.work = work

    def wait(self) -> None:
        self._expect(BucketState.IN_FLIGHT)
        assert self.work is not None
        self.work.wait()
        self.work = None
        self.state = BucketState.REDUCED

    def copy_in(self, pos: int, scale: float, rebind: bool) -> None:
        """Put ``param.grad * scale`` into the view of parameter ``pos`` (zeros when
        the gradient is None). With ``rebind``, param.grad becomes the view."""
        p, view = self.params[pos], self.views[pos]
        grad = local_grad(p)
        if grad is None:
            view.zero_()
        elif _aliases(grad, view):
            if pos not in self.deferred:  # scaled at launch: scale_deferred
                self.deferred.append(pos)
        else:
            if scale == 1.0:
                view.copy_(grad)
            else:
                torch.mul(grad, scale, out=view)
            if rebind:
                set_local_grad(p, view)

    def scale_deferred(self, scale: float) -> None:
        """Scale the gradients that were accumulated into their views (:meth:`copy_in`)."""
        if self.deferred and scale == 1.0:
            self.deferred = []
        elif self.deferred:
            views = [self.views[pos] for pos in self.deferred]
            if len(views) == 1:
                views[0].mul_(scale)
            else:
                torch._foreach_mul_(views, scale)
            self.deferred = []

    def copy_all(self, scale: float, rebind: bool) -> None:
        """:meth:`copy_in` for every parameter, batched: one copy, one scaling."""
        grads = self.local_grads()
        views = self.views
        if all(g is v for g, v in zip(grads, views)):
            # Every gradient was born in its view (Note [gradients born in their
            # bucket] in reduction.py): nothing to copy.
            self._scale(scale)
            return
        if not rebind and all(g is not None for g in grads) and not any(g is v for g, v in zip(grads, views)):
            # Separate gradient tensors, all defined: one batched copy.
            foreach_copy_(views, cast("list[torch.Tensor]", grads))
            self._scale(scale)
            return
        dst, src = [], []
        for p, view, grad in zip(self.params, self.views, grads):
            if grad is None:
                view.zero_()
            elif not _aliases(grad, view):
                dst.append(view)
                src.append(grad)
                if rebind:
                    set_local_grad(p, view)
        if dst:
            foreach_copy_(dst, src)
        self._scale(scale)

    def _scale(self, scale: float) -> None:
        if scale != 1.0:  # 1.0: the collective scales (Note [scaled by the collective] in reduction.py)
            self.grads.mul_(scale)

    def fill(self, scale: float, rebind: bool) -> None:
        """Before launch: the gradients not yet copied in are (batched, Note [copy
        granularity]), and those autograd accumulated into the views are scaled."""
        if not self.copies_per_param:
            self.copy_all(scale, rebind)
        self.scale_deferred(scale)

    def local_grads(self) -> list[torch.Tensor | None]:
        """Each parameter's gradient as the buckets hold it (local shards: Note
        [tensor-parallel parameters] in tandem/dtensor.py); the hot path, once
        or twice a step per bucket, skips the per-parameter check without DTensors."""
        if self.tensor_parallel:
            return [local_grad(p) for p in self.params]
        return [p.grad for p in self.params]

    def ensure_data(self) -> None:
        """Give a solo bucket's staging tensor its memory (zeros) the first time a
        gradient must be copied in (Note [solo buckets] in plan.py)."""
        storage = self.data.untyped_storage()
        if storage.size() == 0 and self.data.numel():
            storage.resize_(self.data.numel() * self.data.element_size())
            self.data.zero_()

    def reducible_in_place(self) -> torch.Tensor | None:
        """The solo parameter's gradient, if the collective can run on it directly:
        dense, contiguous, of the bucket's dtype and device (else None: copy it in)."""
        grad = local_grad(self.params[0])
        spec = self.spec
        if (grad is None or grad.layout is not torch.strided or not grad.is_contiguous()
                or grad.dtype != spec.dtype or grad.device != spec.device):
            return None
        return grad

    def views_held_elsewhere(self) -> bool:
        """Whether a view that its parameter no longer holds as .grad is referenced
        outside this bucket (an old ``p.grad`` the user kept: Note [gradients born
        in their bucket] in reduction.py)."""
        views, params = self.views, self.params
        for k in range(len(views)):  # by index: a loop variable would be a reference too
            if params[k].grad is not views[k] and sys.getrefcount(views[k]) > _VIEW_REFS:
                return True
        return False

    def grad_is_view(self, pos: int) -> bool:
        grad = local_grad(self.params[pos])
        return grad is not None and _aliases(grad, self.views[pos])

    def missing(self) -> list[str]:
        return [n for n, r in zip(self.names, self.ready) if not r]

    def _expect(self, *allowed: BucketState) -> None:
        if self.state not in allowed:
            raise RuntimeError(
                f"bucket {self.index} is {self.state.name}, expected "
                f"{'/'.join(s.name for s in allowed)} "
                f"({self.num_ready}/{len(self.params)} gradients ready)")


def _aliases(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return grad.data_ptr() == view.data_ptr() and grad.shape == view.shape


@dataclass
class StepInputs:
    """What one synchronised step gives its reductions: set when it is armed."""

    div: float
    """The factor every gradient is scaled by (1/world, or 1 under a hook)."""
    used: list[bool] = field(default_factory=list)
    """Per parameter: whether this rank's backward produced its gradient."""
    missing_flag: float = 0.0
    """1.0 once this rank found a gradient missing (Note [missing-gradient flag] in reducer.py)."""


class Reduction(Protocol):
    """How a complete bucket is reduced, one kind per reducer (tandem/ddp/reduction.py):
    the group calls ``launch`` in bucket order, ``settle`` after the last launch,
    ``deliver`` once a bucket is waited for, ``end_step`` at the end, and ``shadow``
    for a joined rank's zeros."""

    on_lone_grad: bool
    """Whether a lone parameter's bucket may reduce on its .grad (Note [in-place reduction])."""
    flag_alone: bool
    """Whether the missing-gradient flag needs an all-reduce of its own."""

    def launch(self, bucket: Bucket, step: StepInputs, is_last: bool) -> None: ...
    def settle(self, buckets: Sequence[Bucket]) -> None: ...
    def deliver(self, bucket: Bucket, used: list[int] | None) -> None: ...
    def end_step(self, params: Sequence[torch.nn.Parameter], buckets: Sequence[Bucket]) -> None: ...
    def shadow(self, bucket: Bucket, is_last: bool) -> PendingReduction: ...


@dataclass(frozen=True, kw_only=True)
class ReducerOptions:
    caps: tuple[int, ...]
    """Byte cap per bucket index (the last one repeats)."""
    find_unused_parameters: bool = False
    """Walk the graph after forward; unreached parameters do not hold up their buckets."""
    static_graph: bool = False
    """The graph is the same every step: learn hook counts and unused params in step one."""
    gradient_as_bucket_view: bool = False
    """param.grad is a view into the flat bucket buffer: no copies, less memory."""
    rebuild_buckets: bool = True
    """After the first step, re-plan buckets in the order gradients actually arrived."""
    zero_stage: int = 0
    """0: all-reduce each bucket; 1, 2: reduce-scatter it (Note [zero reduction] in reduction.py)."""
    overlap: bool = True
    """Launch each bucket's reduction during backward once it is complete (False:
    launch them all at the end of backward)."""
    check_finite: NonFinite | None = None
    """Agree across ranks whether a step's gradients are finite, and raise or drop
    the step when they are not (Note [check_finite] in finite.py); None: no check, no cost."""
    reduce_dtype: torch.dtype | None = None
    """The buckets' dtype, which gradients are cast into and averaged in; None: each
    parameter's own (then a bucket holds parameters of one dtype)."""


class BucketGroup:
    """The buckets of one reducer and their reduction, step by step.

    Args:
        named_params: the parameters, in registration order.
        comm: the group the buckets are reduced over.
        options: the wrapper's choices. Of them the buckets read the caps, ZeRO's
            layout (Note [flat buffer layout] in plan.py, with a shard buffer of
            ``1/world`` the size for the reduce-scatters' output),
            ``gradient_as_bucket_view``, room for check_finite's flags (Note
            [check_finite] in finite.py) and ``overlap``.
    """

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], comm: GroupComm,
                 options: ReducerOptions) -> None:
        self.comm = comm
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        # Note [tensor-parallel parameters] in tandem/dtensor.py: buckets hold local shards.
        self._infos = [ParamInfo(n, local_tensor(p).numel(), options.reduce_dtype or p.dtype, p.device)
                       for n, p in named_params]
        self._caps, self._zero, self._as_view = options.caps, options.zero_stage > 0, options.gradient_as_bucket_view
        self._check_finite = options.check_finite is not None
        self._overlap = options.overlap
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
        still holds the old memory (Note [gradients born in their bucket] in reduction.py)."""
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
        (Note [gradients born in their bucket] in reduction.py)."""
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
