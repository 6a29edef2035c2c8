"""The gradient reducer: readiness hooks, in-order bucket launches, and the end of
backward.

Life of one synchronised step::

    forward ends   -> arm(outputs)           buckets FILLING; unused params marked
    grad of p lands-> _on_grad(p)            copy p.grad/world into its bucket view;
                                             launch every complete bucket in order
    backward ends  -> _finish()              launch the rest, wait all, write
                                             averaged grads to param.grad

A gradient's path, file by file (all in tandem/ddp/)::

    plan.py         which bucket and offset a parameter gets (pure)
    reducer.py      hook -> _ready -> _launch -> _finish_step -> _write_back
    bucket.py       the bucket's views, its state, the copy in (scaled)
    grad_bucket.py  what a communication hook sees, and its pending result
    fused.py        the optimizer step per bucket, when one is fused
    finite.py       check_finite: one NaN/Inf decision on every rank
    errors.py       what the reducer says when the model or the loop is wrong

# Note [launch order]
Bucket k is launched only after buckets 0..k-1 (see Note [bucket order] in
plan.py). Gradients may become ready in a different order on different ranks
(rank-dependent control flow, or simply timing), but the sequence of collectives
each rank issues is the same: bucket 0, 1, ..., n-1, then the used-parameter map
when one is needed. Collectives are matched by issue order, so this is what keeps
ranks from reducing the wrong buffers into each other or hanging.

# Note [missing-gradient flag]
Without find_unused_parameters, a parameter that gets no gradient on one rank
would leave its bucket unlaunched there while the other ranks wait for it: torch
hangs or reports it one iteration late by index. Here, the rank that finds a
gradient missing at the end of backward launches its remaining buckets anyway
(with zeros), and raises a flag: one reserved element after the parameters of
the last bucket, which the reduction sums like any gradient. Every rank reads the
flag after waiting for the last bucket; if any rank raised it, all ranks gather
the missing names (a collective only on this error path) and raise the same
error, naming the parameters and the ranks. The check costs no extra collective.

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
optimizer, distributed autograd, solo buckets (Note [in-place reduction]: they
have no bucket memory) or tensor-parallel parameters: there the copy back stays.

# Note [hook fast path]
The post-accumulate-grad hook runs once per parameter per backward, in Python,
where torch's reducer runs C++; on a model of 400 small tensors it is most of
what DDP costs. In the steady state (after the first step, no static-graph hook
counts, the end-of-backward callback already queued, grad mode off) a gradient
of a bucket that copies its gradients in one batch (Note [copy granularity] in
bucket.py) needs nothing but a mark: the hook marks it and launches the bucket
when it is the last; everything else (a first or second arrival, a per-parameter
copy, create_graph) takes the general path through _ready. Both paths keep the
same state, so either may take any gradient.

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

# Note [end of backward]
The finishing callback is queued on the autograd graph task that runs the
outputs' gradients (a hook on each output tensor), not on whichever task fires a
parameter hook first: with reentrant activation checkpointing, parameter hooks
fire inside nested backward passes, and a callback queued there would run before
the outer backward is done. A pass through the outputs that computes no
parameter gradient (``torch.autograd.grad(out, x, create_graph=True)`` for a
gradient penalty) is not the synchronised backward: the output hook queues the
callback only if the pass will execute a parameter's AccumulateGrad node, or
an opaque node (a reentrant checkpoint, whose nested passes compute the
gradients of the parameters it hides; torch cannot take ``autograd.grad``
through those, so such a pass is always a full backward).
Under ``backward(create_graph=True)`` hooks run with grad mode on; the reducer's
copies and reductions run under no_grad, so reduced gradients carry no graph
(as with torch's DDP, whose reducer works outside autograd).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import cast

import torch

from tandem._compat import accumulate_grad_node, dist_autograd_context_id, foreach_copy_, \
    queue_backward_callback, storage_use_count, will_execute_in_this_backward
from tandem.comm.group import CollectiveEvent, GroupComm, Work
from tandem.ddp.bucket import Bucket, BucketState, GradBuffer
from tandem.ddp.dist_autograd import ContextGrads, unsupported_under_context
from tandem.ddp.fused import BucketStepper
from tandem.ddp.checks import NonFinite, NonFiniteReport
from tandem.ddp.finite import FLAGS_CHECKED_TAG, FiniteCheck
from tandem.ddp.errors import gradient_twice, missing_gradients, unfinished_backward
from tandem.ddp.grad_bucket import CommHook, GradBucket, HookWork, issues_one_collective
from tandem._tree import iter_tensors
from tandem.ddp.graph import opaque_nodes, reachable_params
from tandem.ddp.plan import BucketPlan, ParamInfo, plan_ddp_buckets
from tandem.dtensor import local_grad, local_tensor, set_local_grad

__all__ = ["CommStats", "GradReducer", "ReducerOptions", "StepState"]

logger = logging.getLogger(__name__)

_FLAGS_TAG = "missing gradients flag"


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
    """0: all-reduce each bucket; 1, 2: reduce-scatter it (Note [zero reduction])."""
    overlap: bool = True
    """Launch each bucket's reduction during backward once it is complete (False:
    launch them all at the end of backward)."""
    check_finite: NonFinite | None = None
    """Agree across ranks whether a step's gradients are finite, and raise or drop
    the step when they are not (Note [check_finite] in finite.py); None: no check, no cost."""


class StepState(Enum):
    IDLE = auto()        # no synchronised backward expected (no_sync, eval, or done)
    ARMED = auto()       # forward armed the reducer; gradients may arrive
    FINISHING = auto()   # end of backward: launching the rest, waiting, writing back


@dataclass(frozen=True)
class CommStats:
    """Gradient communication of one synchronised backward, on this rank."""

    bytes: int
    """Payload bytes of the gradient collectives issued through tandem's comm layer
    (hooks that call torch.distributed directly are not seen)."""
    wait_s: float
    """Seconds the end of backward spent waiting for reductions to finish."""


class GradReducer:
    """Averages the gradients of ``params`` across ``comm`` during backward."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], comm: GroupComm,
                 options: ReducerOptions) -> None:
        self.comm = comm
        self.options = options
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        # Note [tensor-parallel parameters] in tandem/dtensor.py: buckets hold local shards.
        self._infos = [ParamInfo(n, local_tensor(p).numel(), p.dtype, p.device) for n, p in named_params]
        self._div = 1.0 / comm.size
        self._static = options.static_graph
        self._as_view = options.gradient_as_bucket_view
        self._zero = options.zero_stage > 0
        if self._zero and options.rebuild_buckets:
            raise ValueError("ZeRO needs a fixed bucket plan: pass rebuild_buckets=False")
        self.grad_shards: list[torch.Tensor] = []  # Note [zero reduction]
        self.state = StepState.IDLE
        self.steps = 0                      # synchronised backwards whose gradients were delivered
        # Note [check_finite] in finite.py
        self._check = None if options.check_finite is None else FiniteCheck(options.check_finite, self)
        # Note [gradients born in their bucket]: where param.grad may be left as its
        # bucket's view after a step (decided per step in arm: _rebind).
        self._born = not (self._zero or self._as_view or self._check is not None) \
            and storage_use_count(torch.zeros(1)) is not None
        self._rebind = False
        self._retired: list[torch.Tensor] = []  # backward's fresh gradients, until the next forward
        self._fast = False  # Note [hook fast path], decided in arm
        self._foreign: set[int] = set()  # params whose .grad is the user's tensor: copied into

        self.plan: BucketPlan
        self.buckets: list[Bucket] = []
        self._where: list[tuple[int, int]] = []
        self._build(list(reversed(range(len(self.params)))))

        # per-step bookkeeping
        self._next_launch = 0
        self._callback_queued = False
        self._output_nodes: list[object] = []  # Note [end of backward]
        self._locally_used = [False] * len(self.params)
        self._arrival: list[int] = []       # param indices in order of first readiness
        self._pending_unused: list[int] = []  # marked ready when backward starts
        self._missing_flag = 0.0            # Note [missing-gradient flag]
        self._name_ranks = True             # every rank takes part in error paths (not inside join)
        self._in_place = False              # Note [in-place reduction], decided in arm
        self._rebuild_pending = False
        # static graph: learned in the first synchronised step
        self._hook_count = [0] * len(self.params)
        self._expected_count: list[int] | None = None
        self._static_used: list[int] | None = None  # per param: used on some rank in step one

        # communication hook (Note [hook order] in grad_bucket.py)
        self._comm_hook: CommHook | None = None
        self._comm_hook_state: object = None
        self._serialize_hooks = False
        self.last_stats: CommStats | None = None
        self._stepper: BucketStepper | None = None  # Note [fused step] in fused.py
        self._bytes = 0
        comm.observers.append(self._count_bytes)

        # Note [end of backward]: which passes compute parameter gradients.
        self._acc_nodes = [accumulate_grad_node(p) for p in self.params]
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                       for i, p in enumerate(self.params)]
        # Note [distributed autograd] in dist_autograd.py: hooks on the AccumulateGrad
        # nodes, added by the first forward that runs inside a context.
        self._context_hooks: list[object] = []
        self._context_id: int | None = None        # the context the armed forward ran in
        self._context_grads: ContextGrads | None = None
        self._used_counts: list[int] | None = None
        logger.info("DDP: %s, world %d", self.plan.describe(), comm.size)

    # ------------------------------------------------------------------ planning
    def _build(self, order: list[int]) -> None:
        plan = plan_ddp_buckets(self._infos, order, self.options.caps, self.comm.size, zero=self._zero,
                                gradient_as_bucket_view=self._as_view, check_finite=self._check is not None)
        buffer = GradBuffer(plan.buffer_numel, solo=tuple(s for s in plan.buckets if s.solo))
        self.buckets = [Bucket(spec, [self.params[i] for i in spec.params],
                               [self.names[i] for i in spec.params], buffer.slice(spec))
                        for spec in plan.buckets]
        buffer.release_solo()  # the views exist: Note [solo buckets] in plan.py
        for b in self.buckets:  # for hang reports (tandem.comm.ledger)
            self.comm.ledger.describe_params(f"bucket {b.index}", b.names)
        self.plan, self.buffer = plan, buffer
        if self._zero:
            size = self.comm.size
            shards = GradBuffer({key: n // size for key, n in plan.buffer_numel.items()})
            self.grad_shards = [shards.slice_shard(spec, size) for spec in plan.buckets]
        self._where = [(0, 0)] * len(self.params)
        for b in self.buckets:
            for pos, i in enumerate(b.spec.params):
                self._where[i] = (b.index, pos)
        if self.options.gradient_as_bucket_view:
            # Existing gradients move into the (new) buffer and param.grad becomes the view.
            for i, p in enumerate(self.params):
                grad = local_grad(p)
                if grad is not None:
                    view = self._view(i)
                    view.copy_(grad)
                    set_local_grad(p, view)
        buffer.settle()

    def _rebase(self) -> None:
        """Give the buckets memory of their own again: a tensor outside the reducer
        still holds the old memory (Note [gradients born in their bucket])."""
        self._build([i for spec in self.plan.buckets for i in spec.params])
        self._reset_buckets()
        self._foreign = self._foreign_grads()
        logger.debug("DDP: a tensor on the gradient buckets' memory is held outside the reducer "
                     "(a kept view of param.grad): the buckets moved to new memory")

    def _reset_buckets(self) -> None:
        """Every bucket starts a new step (in arm, and after _rebase built new ones)."""
        for b in self.buckets:
            b.reset()
            if b.spec.solo and not self._in_place:  # a hook was registered: it needs the bucket
                b.ensure_data()

    def _bindable(self) -> list[Bucket]:
        """Buckets whose views param.grad may be left bound to (Note [gradients born
        in their bucket])."""
        return [b for b in self.buckets if b.bindable]

    def _foreign_grads(self) -> set[int]:
        return {i for b in self._bindable() for i, p, v in zip(b.spec.params, b.params, b.views)
                if (g := p.grad) is not None and g is not v}

    def _escaped(self) -> bool:
        """Whether something outside the reducer holds memory of the buckets that
        the coming step will write: a view derived from an old .grad (the buffer's
        use count), or an old .grad itself that the parameter no longer holds."""
        return self.buffer.escaped() or any(b.views_held_elsewhere() for b in self._bindable())

    def _view(self, i: int) -> torch.Tensor:
        b, pos = self._where[i]
        return self.buckets[b].views[pos]

    def before_forward(self) -> None:
        """Called before a forward with grad enabled, on every rank in step."""
        self.comm.ledger.mark_step(self.steps)
        self._output_nodes = []  # the previous forward's graph: Note [end of backward]
        self._retired = []  # Note [gradients born in their bucket]: freed now, as torch frees them
        if self.state is StepState.ARMED and any(b.num_ready for b in self.buckets):
            self._raise_unfinished()
        self.state = StepState.IDLE
        if self._rebuild_pending:
            self._rebuild_pending = False
            self._rebuild()

    def _rebuild(self) -> None:
        # Note [bucket order]: every rank adopts rank 0's arrival order.
        seen = set(self._arrival)
        order = self._arrival + [i for i in reversed(range(len(self.params))) if i not in seen]
        t = torch.tensor(order, dtype=torch.int64, device=self.comm.device)
        if self.comm.size > 1:
            self.comm.broadcast(t, 0, tag="bucket order")
        order = t.tolist()
        if order == [i for b in self.plan.buckets for i in b.params]:
            return
        self._build(order)
        logger.info("DDP: buckets rebuilt in gradient arrival order: %s", self.plan.describe())

    # ------------------------------------------------------------------ arming
    def arm(self, output: object, divisor: int | None = None, name_ranks: bool = True) -> None:
        """Prepare for the synchronised backward of the forward that produced ``output``.

        ``divisor``: how many ranks the gradients are averaged over (default: the
        group size; fewer under join with divide_by_initial_world_size=False).
        ``name_ranks``: every rank takes part in this step's error paths (False
        under join, Note [check_finite] in finite.py)."""
        # With a comm hook, buckets hold plain sums: the hook divides (as torch).
        self._div = 1.0 if self._comm_hook else 1.0 / (divisor or self.comm.size)
        # Note [in-place reduction]: only where param.grad is what the plain path writes.
        self._in_place = not (self._zero or self._as_view or self._comm_hook is not None
                              or self._check is not None)
        self._bytes = 0
        if self.buffer.released:  # Note [zero reduction]
            self.buffer.restore()
            for b in self.buckets:  # parameters' regions are all written before launch
                b.data.narrow(0, b.spec.numel, b.spec.padded_numel - b.spec.numel).zero_()
        self._reset_buckets()
        self._next_launch = 0
        self._callback_queued = False
        self._missing_flag = 0.0
        self._locally_used = [False] * len(self.params)
        self._hook_count = [0] * len(self.params)
        self._name_ranks = name_ranks
        if self._check is not None:
            self._check.arm(marked=self._zero or self._as_view or self._comm_hook is not None,
                            name_ranks=name_ranks)
        self.state = StepState.ARMED
        outputs = [t for t in iter_tensors(output) if t.requires_grad]
        for t in outputs:
            if t.grad_fn is not None:
                t.register_hook(self._on_output_grad)
        # Note [end of backward]: held until the synchronised pass starts (or the
        # next forward), released before the next forward builds its graph.
        self._output_nodes = [t.grad_fn for t in outputs if t.grad_fn is not None]
        if self.steps == 0:
            self._arrival = []  # an earlier first step may have failed half-way
        self._pending_unused = self._find_unused(outputs)
        self._context_grads = None
        self._context_id = dist_autograd_context_id()
        if self._context_id is not None:
            self._hook_context_grads()
        # Note [gradients born in their bucket]
        self._rebind = self._born and self._stepper is None and self._context_id is None
        # Note [hook fast path]: no hook counts (static graph), no arrival order to record.
        self._fast = not self._static and self.steps > 0
        if self._rebind:
            self._foreign = self._foreign_grads()

    def _hook_context_grads(self) -> None:
        """Note [distributed autograd] in dist_autograd.py: this forward runs inside a
        distributed autograd context, so its backward may leave the gradients there."""
        what = "ZeRO" if self._zero else "fuse_optimizer" if self._stepper is not None else None
        if what is not None:
            self.state = StepState.IDLE
            raise RuntimeError(unsupported_under_context(self.comm.rank, what))
        if not self._context_hooks:
            self._context_hooks = [node.register_hook(functools.partial(self._on_context_grad, i))
                                   for i, node in enumerate(self._acc_nodes)]

    def _find_unused(self, outputs: list[torch.Tensor]) -> list[int]:
        """Parameters known to get no gradient in this backward. They are marked
        ready when backward starts, not now: a forward whose output is dropped
        must not launch reductions (torch behaves the same)."""
        if self._learning_static_graph:
            return []
        if self.options.static_graph:
            assert self._static_used is not None
            return [i for i, used in enumerate(self._static_used) if not used]
        if self.options.find_unused_parameters:
            reach = reachable_params(outputs, self._index_of)
            if not reach.opaque:
                # Parameters hidden behind an opaque node (reentrant checkpointing)
                # may still get gradients: then unreached ones wait for the end of
                # backward instead (see _finish_step).
                return [i for i in range(len(self.params)) if i not in reach.params]
        return []

    @property
    def _learning_static_graph(self) -> bool:
        return self.options.static_graph and self._expected_count is None

    # ------------------------------------------------------------------ hooks
    def _on_output_grad(self, grad: torch.Tensor) -> None:
        # Note [end of backward]
        if not self._callback_queued and self._pass_computes_param_grads():
            self._queue_finish()

    def _pass_computes_param_grads(self) -> bool:
        if any(map(will_execute_in_this_backward, self._acc_nodes)):
            return True
        # Rare: an input-only pass (gradient penalty), or every parameter hidden
        # behind reentrant checkpoints, whose nested passes compute them.
        return any(map(will_execute_in_this_backward, opaque_nodes(self._output_nodes)))

    def _queue_finish(self) -> None:
        """First thing in a synchronised backward: queue the end-of-backward
        callback and mark the parameters known to be unused."""
        if not self._callback_queued:
            self._callback_queued = True
            self._output_nodes = []
            queue_backward_callback(self._finish)
            if self._rebind and self._escaped():
                self._rebase()
            for i in self._pending_unused:
                self._mark_unused(i)
            self._launch_complete()

    def _on_grad(self, i: int, param: torch.Tensor | None = None) -> None:
        # Hot path: runs once per parameter per backward (the post-accumulate-grad hook).
        if self.state is not StepState.ARMED:
            return  # no_sync, or a backward that no synchronised forward armed
        if self._fast and self._callback_queued and not torch.is_grad_enabled():
            # Note [hook fast path]: the steady state of a batched-copy bucket.
            b, pos = self._where[i]
            bucket = self.buckets[b]
            ready = bucket.ready
            if not (ready[pos] or bucket.copies_per_param or bucket.state is not BucketState.FILLING):
                self._locally_used[i] = True
                ready[pos] = True
                bucket.num_ready += 1
                if bucket.num_ready == bucket.size:
                    self._launch_complete()
                return
        if torch.is_grad_enabled():  # backward(create_graph=True): Note [end of backward]
            with torch.no_grad():
                self._on_grad(i, param)
            return
        if not self._callback_queued:
            self._queue_finish()
        self._locally_used[i] = True
        if self._static:
            self._hook_count[i] += 1
            if self._expected_count is None:
                if self._hook_count[i] == 1:
                    self._arrival.append(i)
                return  # first step of a static graph: everything is reduced at the end
            if self._hook_count[i] < self._expected_count[i]:
                return
        if self._ready(i) and self.steps == 0 and not self._static:
            self._arrival.append(i)

    def _on_context_grad(self, i: int, grad_inputs: object, grad_outputs: object) -> None:
        # The AccumulateGrad node's post hook (Note [distributed autograd] in dist_autograd.py).
        if self.state is not StepState.ARMED or self._locally_used[i] or self._context_id is None:
            return  # no synchronised backward, or a local one: _on_grad took the gradient
        if self._context_grads is None:
            # The engine's thread does not expose the backward's context to Python
            # (torch's reducer reads a C++ thread-local): the forward's context it is.
            self._context_grads = ContextGrads(self._context_id, self.params, self.names, self.comm.rank)
        self._context_grads.bind(i)
        self._on_grad(i)

    def _ready(self, i: int) -> bool:
        """Parameter i's gradient is final for this backward: copy it in (or leave
        that to its bucket, Note [copy granularity]), mark it, launch what can go.
        Returns whether it was newly marked."""
        b, pos = self._where[i]
        bucket = self.buckets[b]
        if bucket.ready[pos] or bucket.state is not BucketState.FILLING:
            self._ready_again(i, bucket, pos)
            return False
        if bucket.copies_per_param and not (bucket.single and self._in_place):
            bucket.copy_in(pos, self._div, self._as_view)  # (in place: at launch)
        bucket.mark_ready(pos)
        if bucket.complete:
            self._launch_complete()
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
                if bucket.copies_per_param and not (bucket.single and self._in_place):
                    bucket.copy_in(pos, self._div, self._as_view)
                return
        raise RuntimeError(gradient_twice(self.comm.rank, self.names[i], bucket.index))

    def _mark_unused(self, i: int) -> None:
        """Parameter i gets no gradient in this backward: it contributes its current
        .grad (zeros when None, as torch), and is not counted as used."""
        b, pos = self._where[i]
        bucket = self.buckets[b]
        if not bucket.ready[pos]:
            if self._rebind and bucket.grad_is_view(pos):
                # Its .grad must stay as it was (Note [gradients born in their
                # bucket]): the bucket takes a copy, scaled, and .grad its own tensor.
                p = self.params[i]
                p.grad = cast(torch.Tensor, p.grad).clone()
            self._ready(i)

    # ------------------------------------------------------------------ launching
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
            bucket.data[spec.numel] = self._missing_flag
        payload = bucket.data.narrow(0, 0, spec.numel + spec.extra)
        work = self.comm.all_reduce(payload, tag=f"bucket {bucket.index}", async_op=True)
        bucket.launched(work)
        stepper = self._stepper
        if stepper is not None and self._check is None:
            # Note [fused step]: the local gradients are in the bucket; the averaged
            # ones will be bound at the end. Free these during backward.
            for i, p in zip(spec.params, bucket.params):
                if stepper.owns(i):
                    p.grad = None

    # ------------------------------------------------------------------ finishing
    def _finish(self) -> None:
        if self.state is not StepState.ARMED:
            return
        if torch.is_grad_enabled():  # backward(create_graph=True): Note [end of backward]
            with torch.no_grad():
                self._finish()
            return
        self.state = StepState.FINISHING
        context_grads, self._context_grads = self._context_grads, None
        self._used_counts = None
        try:
            self._finish_step()
            if self._rebind:  # after _finish_step: its locals hold views of the buffer
                self.buffer.settle()  # Note [gradients born in their bucket]
            if context_grads is not None:  # Note [distributed autograd] in dist_autograd.py
                context_grads.deliver(self._used_counts, self.comm.size)
        finally:
            if context_grads is not None:
                context_grads.restore()
            self.state = StepState.IDLE
            self._callback_queued = False

    def _finish_step(self) -> None:
        learning = self._learning_static_graph
        track_used = self._tracks_used
        if learning:
            self._expected_count = list(self._hook_count)
            for i in range(len(self.params)):
                if self._hook_count[i]:
                    self._ready(i)
        missing = [i for b in self.buckets for pos, i in enumerate(b.spec.params) if not b.ready[pos]]
        if missing and not track_used:
            self._missing_flag = 1.0  # Note [missing-gradient flag]
        for i in missing:
            self._mark_unused(i)
        self._launch_complete()
        assert self._next_launch == len(self.buckets), "every bucket is complete and launched"

        if self._serialize_hooks:
            # The last hook may still issue collectives from its callbacks: let it
            # finish before anything else goes on the wire (Note [hook order] in
            # grad_bucket.py).
            last_work = self.buckets[-1].work
            assert isinstance(last_work, HookWork)
            last_work.settle()
        used_work: Work | None = None
        used = None
        if track_used:
            used = torch.tensor(self._locally_used, dtype=torch.int32, device=self.comm.device)
            used_work = self.comm.all_reduce(used, tag="used parameters", async_op=True)
        flag = None
        # A hook reduces only the parameters' region, a reduce-scatter leaves the
        # flag on one rank (Note [zero reduction]): the flag travels alone.
        flag_alone = self._comm_hook is not None or self._zero
        if flag_alone and self._check is None:
            flag = torch.tensor([self._missing_flag], device=self.comm.device)
            self.comm.all_reduce(flag, tag=_FLAGS_TAG)
        # Note [fused step] in fused.py: step each bucket as soon as it lands, unless
        # a decision needs every bucket first (dropping the step, the used map).
        stepper = self._stepper
        pipelined = stepper is not None and self._check is None and used_work is None
        if stepper is not None and pipelined:
            stepper.begin_step()
        waited = 0.0
        for bucket in self.buckets:
            started = time.perf_counter()
            bucket.wait()
            waited += time.perf_counter() - started
            if pipelined:
                self._deliver(bucket, None)
        if used_work is not None:
            started = time.perf_counter()
            used_work.wait()
            waited += time.perf_counter() - started
        self.last_stats = CommStats(self._bytes, waited)
        nonfinite = False
        if self._check is not None:
            flag, nonfinite = self._check.agree(flag_alone, self._missing_flag)
        if flag is None:
            last = self.buckets[-1]
            flag = last.data[last.spec.numel]
        if float(flag) > 0:
            self._raise_missing([self.names[i] for i in missing])

        globally_used = None if used is None else used.tolist()
        if learning:
            self._static_used = globally_used
        elif self.options.static_graph:
            globally_used = self._static_used
        self._used_counts = globally_used  # ranks per parameter (all-reduced with SUM)
        if self.steps == 0 and self.options.rebuild_buckets and not (
                self.options.find_unused_parameters and not self.options.static_graph):
            self._rebuild_pending = True
        if nonfinite:
            assert self._check is not None
            self._check.handle()  # raises, or drops this step's gradients on every rank
            return
        if not pipelined:
            if stepper is not None:
                stepper.begin_step()
            for bucket in self.buckets:
                self._deliver(bucket, globally_used)
        if stepper is not None:
            stepper.end_step()
        if self._zero:  # Note [zero reduction]
            if self.options.zero_stage >= 2:
                for p in self.params:
                    p.grad = None
            self.buffer.release()
        self.steps += 1

    def _deliver(self, bucket: Bucket, globally_used: list[int] | None) -> None:
        """Hand a reduced bucket over: its averaged gradients to param.grad (not
        under ZeRO, Note [zero reduction]), and to the fused optimizer's step."""
        if not self._zero:
            self._write_back(bucket, globally_used)
        if self._stepper is not None:
            self._stepper.step_bucket(bucket)

    def _write_back(self, bucket: Bucket, globally_used: list[int] | None) -> None:
        if bucket.in_place:
            return  # param.grad holds the average already (Note [in-place reduction])
        if self._rebind and bucket.bindable:
            self._bind_views(bucket, globally_used)
            return
        as_view, stepper = self._as_view, self._stepper
        if not as_view and stepper is None and globally_used is None:
            grads = bucket.local_grads()
            if all(g is not None for g in grads):  # the common case, in one call
                foreach_copy_(cast("list[torch.Tensor]", grads), bucket.views)
                return
        copy_dst, copy_src = [], []
        for pos, i in enumerate(bucket.spec.params):
            if globally_used is not None and not globally_used[i]:
                continue  # unused on every rank: .grad stays as it was, like torch
            p, view = self.params[i], bucket.views[pos]
            grad = local_grad(p)
            if as_view or (stepper is not None and stepper.owns(i)):
                if grad is None or grad.data_ptr() != view.data_ptr():
                    set_local_grad(p, view)
            elif grad is None:
                set_local_grad(p, view.clone())
            else:
                copy_dst.append(grad)
                copy_src.append(view)
        if copy_dst:
            foreach_copy_(copy_dst, copy_src)

    def _bind_views(self, bucket: Bucket, globally_used: list[int] | None) -> None:
        """Note [gradients born in their bucket]: param.grad becomes (or stays) its
        view of the reduced bucket; a tensor the user gave as .grad gets a copy."""
        foreign, params = self._foreign, self.params
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
                    self._retired.append(grad)
                p.grad = view
        if copy_dst:
            foreach_copy_(copy_dst, copy_src)

    @property
    def nonfinite(self) -> NonFiniteReport | None:
        """Where the last synchronised backward's NaN/Inf gradients were (Note
        [check_finite] in finite.py); None when finite or not checked."""
        return None if self._check is None else self._check.report

    @property
    def nonfinite_steps(self) -> int:
        """Synchronised backwards that found non-finite gradients."""
        return 0 if self._check is None else self._check.steps_found

    # ------------------------------------------------------------------ fused step
    def set_stepper(self, stepper: BucketStepper | None) -> None:
        """Step the optimizer bucket by bucket at the end of each synchronised
        backward (Note [fused step] in fused.py); None: stop."""
        if self.state is not StepState.IDLE:
            raise RuntimeError("fuse_optimizer must be called between steps, not during a backward")
        self._stepper = stepper

    # ------------------------------------------------------------------ hooks
    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, GradBucket)`` instead of an
        all-reduce; see DistributedDataParallel.register_comm_hook."""
        if self._comm_hook is not None:
            raise RuntimeError(
                f"register_comm_hook can only be called once; a hook is already registered "
                f"({getattr(self._comm_hook, '__qualname__', self._comm_hook)!r})")
        if self.steps > 0 or self.state is not StepState.IDLE:
            raise RuntimeError(
                "register_comm_hook must be called before the first backward, as in torch: "
                "register the hook right after constructing DistributedDataParallel")
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {hook!r}")
        self._comm_hook, self._comm_hook_state = hook, state
        self._serialize_hooks = not issues_one_collective(hook)

    def _count_bytes(self, event: CollectiveEvent) -> None:
        tag = getattr(event, "tag", "")
        if tag.startswith("bucket") or tag.startswith("hook"):
            self._bytes += event.numel * (event.dtype.itemsize if event.dtype is not None else 0)

    def close(self) -> None:
        """Detach from the parameters for good: remove every hook, drop the step in
        progress (its reductions are abandoned, not waited for) and the gradients'
        views of the buckets. For a model that gets a new reducer over another
        group (an elastic job's next generation, Note [elastic membership])."""
        for handle in [*self._hooks, *self._context_hooks]:
            handle.remove()  # type: ignore[attr-defined]
        self._hooks, self._context_hooks = [], []
        if self._count_bytes in self.comm.observers:
            self.comm.observers.remove(self._count_bytes)
        for p in self.params:
            p.grad = None
        self.state = StepState.IDLE

    # ------------------------------------------------------------------ join
    def shadow_backward(self) -> None:
        """On a rank that has joined: issue the collectives of one synchronised
        backward with zero gradients (Note [join mirror] in join.py)."""
        works: list[Work | HookWork] = []
        for bucket in self.buckets:
            spec = bucket.spec
            if self._comm_hook is not None:
                # As torch: the hook runs on a zero bucket, one bucket after another
                # (the strictest Note [hook order] in grad_bucket.py); the flag follows below.
                bucket.ensure_data()
                bucket.grads.zero_()
                future = self._comm_hook(self._comm_hook_state, GradBucket(
                    bucket, bucket.index == len(self.buckets) - 1, self.comm))
                work = HookWork(future, bucket, getattr(self._comm_hook, "__qualname__", "hook"))
                work.settle()
                works.append(work)
                continue
            if self._zero:
                zeros = torch.zeros(spec.padded_numel, dtype=spec.dtype, device=spec.device)
                works.append(self.comm.reduce_scatter(self.grad_shards[bucket.index], zeros,
                                                      tag=f"bucket {bucket.index}", async_op=True))
                continue
            zeros = torch.zeros(spec.numel + spec.extra, dtype=spec.dtype, device=spec.device)
            works.append(self.comm.all_reduce(zeros, tag=f"bucket {bucket.index}", async_op=True))
        if self._tracks_used:
            used = torch.zeros(len(self.params), dtype=torch.int32, device=self.comm.device)
            works.append(self.comm.all_reduce(used, tag="used parameters", async_op=True))
        if self._comm_hook is not None:  # Note [check_finite] in finite.py: the flags grow to three
            flag = torch.zeros(1 if self._check is None else 3, device=self.comm.device)
            self.comm.all_reduce(flag, tag=_FLAGS_TAG if self._check is None else FLAGS_CHECKED_TAG)
        for pending in works:
            pending.wait()

    @property
    def _tracks_used(self) -> bool:
        """Whether this step all-reduces the map of locally used parameters."""
        return self._learning_static_graph or (
            self.options.find_unused_parameters and not self._static)

    # ------------------------------------------------------------------ errors
    def _raise_missing(self, mine: list[str]) -> None:
        if not self._name_ranks:
            # Inside tandem.join the joined ranks mirror only the reduction's
            # collectives: a gather here would meet theirs and hang. Name this rank's.
            raise RuntimeError(missing_gradients(self.comm.rank, None, mine))
        per_rank = self.comm.all_gather_object(mine, tag="missing gradients")
        raise RuntimeError(missing_gradients(self.comm.rank, per_rank))

    def _raise_unfinished(self) -> None:
        waiting = [n for b in self.buckets if b.state is BucketState.FILLING for n in b.missing()]
        raise RuntimeError(unfinished_backward(self.comm.rank, waiting))
