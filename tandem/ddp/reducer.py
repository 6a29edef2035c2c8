"""The gradient reducer: autograd tells it when each gradient is final; it hands
the gradient to its bucket group, and at the end of backward it waits for every
reduction, agrees on what went wrong anywhere, and delivers the averages.

Life of one synchronised step::

    forward ends   -> arm(outputs)        the step's inputs; buckets FILLING; unused params known
    grad of p lands-> _on_grad(p)         the bucket group takes it (here: Note [hook fast path])
    backward ends  -> _finish()           the rest launched, all waited on, the flag read,
                                          the averages delivered

A gradient's path, from its hook to ``param.grad``, in three files of
tandem/ddp/ and the collective's (tandem/comm/group.py)::

    reducer.py    _on_grad: the hook; the step's handler chosen when it was armed
    bucket.py     BucketGroup.take / ready: copied into its bucket (scaled) and marked;
                  launch_complete: complete buckets launched in bucket order
    reduction.py  AllReduce.launch (or ReduceScatter, HookReduce): the bucket
                  filled (Bucket.fill), the collective started
    ...
    reducer.py    _finish: the rest launched (BucketGroup.launch_rest), each bucket
                  waited for, the flag read
    reduction.py  AllReduce.deliver -> GradDelivery: the averages to param.grad
                  (bound as views, or copied back)

What each collaborator owns: :class:`~tandem.ddp.bucket.BucketGroup` the
plan, the flat buffer, the buckets and the launch order;
:class:`~tandem.ddp.bucket.Reduction` (one kind, chosen when the reducer is
built and again when a communication hook or a fused optimizer changes it) the
collective and the delivery; :class:`~tandem.ddp.reduction.GradDelivery` how
averages reach ``param.grad``; :class:`~tandem.ddp.static_graph.StaticGraph`
what a static graph learned; :class:`~tandem.ddp.finite.FiniteCheck` the
check_finite decision. The reducer owns the step: its state, the hooks, the end
of backward, and what it raises.

# Note [hook fast path]
The post-accumulate-grad hook runs once per parameter per backward, in Python,
where torch's reducer runs C++; on a model of 400 small tensors it is most of
what DDP costs. So which handler takes a gradient is chosen when a step is
armed, not per gradient: idle (no synchronised backward), the first step
(records the arrival order for the bucket rebuild), a static graph (counts the
hooks, Note [static graph] in static_graph.py), or the steady state, where a
gradient of a bucket that copies its gradients in one batch (Note [copy
granularity] in bucket.py) needs nothing but a mark: the group marks it and
launches the bucket when it is the last. Everything else (a second arrival, a
per-parameter copy, create_graph, a gradient before the end-of-backward
callback is queued) takes the general path through ``BucketGroup.ready``. Both
paths keep the same state, so either may take any gradient.

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
On a CUDA device the flag is read one step later, at the end of the next
backward, so that the host never waits for the GPU (Note [late flag] in late_flag.py).

# Note [recovered reduction failures]
In an elastic loop (Note [elastic prepare] in tandem/elastic/loop.py) a
peer that dies during backward fails this rank's reduction, and the exception
would leave ``loss.backward()`` in the user's own loop, which cannot catch it
without a try in every script. So the wrapper may carry a ``failure_handler``
(``DistributedDataParallel.set_failure_handler``): when a reduction fails at
the end of backward, the handler is asked whether it recovers from the error (it
records a peer's failure for the optimizer's step, which then drops the step
and regroups); if so, backward returns without delivering averages: the
gradients are left as they are, not to be stepped on, and the reducer is idle.
Anything the handler does not claim is raised as before.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from enum import Enum, auto

import torch

from tandem._compat import (accumulate_grad_node, dist_autograd_context_id, queue_backward_callback,
                            storage_use_count, will_execute_in_this_backward)
from tandem._tree import iter_tensors
from tandem.comm.group import CollectiveEvent, GroupComm, Work
from tandem.ddp.bucket import (Bucket, BucketGroup, GradBuffer, PendingReduction, ReducerOptions, Reduction,
                                StepInputs)
from tandem.ddp.checks import NonFiniteReport
from tandem.ddp.comm_stats import CommStats, gradient_bytes
from tandem.ddp.dist_autograd import ContextGrads, unsupported_under_context
from tandem.ddp.errors import missing_gradients, unfinished_backward
from tandem.ddp.finite import FLAGS_CHECKED_TAG, FiniteCheck
from tandem.ddp.fused import BucketStepper
from tandem.ddp.grad_bucket import CommHook, issues_one_collective
from tandem.ddp.graph import opaque_nodes, reachable_params
from tandem.ddp.late_flag import LateFlag
from tandem.ddp.plan import BucketPlan
from tandem.ddp.reduction import AllReduce, GradDelivery, HookReduce, ReduceScatter, foreign_grads, views_escaped
from tandem.ddp.static_graph import StaticGraph

__all__ = ["FLAGS_TAG", "CommStats", "GradReducer", "StepState"]

logger = logging.getLogger(__name__)

FLAGS_TAG = "missing gradients flag"
"""The tag of the flag's own all-reduce, where it cannot travel in the last bucket."""


class StepState(Enum):
    IDLE = auto()        # no synchronised backward expected (no_sync, eval, or done)
    ARMED = auto()       # forward armed the reducer; gradients may arrive
    FINISHING = auto()   # end of backward: launching the rest, waiting, writing back


class GradReducer:
    """Averages the gradients of ``params`` across ``comm`` during backward."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], comm: GroupComm,
                 options: ReducerOptions) -> None:
        zero = options.zero_stage > 0
        if zero and options.rebuild_buckets:
            raise ValueError("ZeRO needs a fixed bucket plan: pass rebuild_buckets=False")
        self.comm = comm
        self.options = options
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        self._check = None if options.check_finite is None else FiniteCheck(options.check_finite, self)
        self.group = BucketGroup(named_params, comm, options)
        # Note [gradients born in their bucket] in reduction.py: where param.grad may stay its view.
        born = not (zero or options.gradient_as_bucket_view or self._check is not None) \
            and storage_use_count(torch.zeros(1)) is not None
        self._delivery = GradDelivery(self.params, as_view=options.gradient_as_bucket_view, born=born)
        self._static = StaticGraph(len(self.params)) if options.static_graph else None
        self._hook: tuple[CommHook, object] | None = None   # a communication hook and its state
        self._stepper: BucketStepper | None = None          # Note [fused step] in fused.py
        self._choose_reduction()

        self.state = StepState.IDLE
        self.steps = 0                       # synchronised backwards whose gradients were delivered
        self._step = StepInputs(1.0 / comm.size)
        self._take: Callable[[int], None] = self._ignore  # Note [hook fast path]
        self._callback_queued = False
        self._output_nodes: list[object] = []  # Note [end of backward]
        self._pending_unused: list[int] = []   # marked ready when backward starts
        self._arrival: list[int] = []          # param indices in order of first readiness (step one)
        self._rebuild_pending = False
        self._name_ranks = True                # every rank takes part in error paths (not inside join)
        self._late_flag = LateFlag()           # the flag on its way to the host (CUDA: Note [late flag])
        self._used_counts: list[int] | None = None
        self.last_stats: CommStats | None = None
        self._bytes = 0
        comm.observers.append(self._count_bytes)
        # Note [recovered reduction failures]: set by the DDP wrapper.
        self.failure_handler: Callable[[BaseException], bool] | None = None

        # Note [end of backward]: which passes compute parameter gradients.
        self._acc_nodes = [accumulate_grad_node(p) for p in self.params]
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                       for i, p in enumerate(self.params)]
        # Note [distributed autograd] in dist_autograd.py: hooks on the AccumulateGrad
        # nodes, added by the first forward that runs inside a context.
        self._context_hooks: list[object] = []
        self._context_id: int | None = None
        self._context_grads: ContextGrads | None = None
        logger.info("DDP: %s, world %d", self.plan.describe(), comm.size)

    # ------------------------------------------------------------------ what others read
    @property
    def plan(self) -> BucketPlan:
        return self.group.plan

    @property
    def buckets(self) -> list[Bucket]:
        return self.group.buckets

    @property
    def buffer(self) -> GradBuffer:
        return self.group.buffer

    @property
    def grad_shards(self) -> list[torch.Tensor]:
        """ZeRO: this rank's shard of each bucket's averaged gradients (Note [zero reduction] in reduction.py)."""
        return self.group.grad_shards

    @property
    def nonfinite(self) -> NonFiniteReport | None:
        """Where the last synchronised backward's NaN/Inf gradients were (Note
        [check_finite] in finite.py); None when finite or not checked."""
        return None if self._check is None else self._check.report

    def _count_bytes(self, event: CollectiveEvent) -> None:
        self._bytes += gradient_bytes(event)

    # ------------------------------------------------------------------ how buckets are reduced
    def _choose_reduction(self) -> None:
        """Build the reduction the options, the hook and the fused optimizer call for."""
        reduction: Reduction
        if self._hook is not None:
            hook, state = self._hook
            reduction = HookReduce(self.comm, hook, state, self._delivery, serialize=not issues_one_collective(hook),
                                   check=self._check, stepper=self._stepper)
        elif self.options.zero_stage:
            reduction = ReduceScatter(self.comm, self.group.grad_shards, self.options.zero_stage, check=self._check)
        else:
            reduction = AllReduce(self.comm, self._delivery, check=self._check, stepper=self._stepper)
        self.group.use(reduction)
        # Note [check_finite] in finite.py: whether the local gradients are gone once launched.
        self._marks_locals = bool(self.options.zero_stage) or self.options.gradient_as_bucket_view \
            or self._hook is not None

    def set_stepper(self, stepper: BucketStepper | None) -> None:
        """Step the optimizer bucket by bucket at the end of each synchronised
        backward (Note [fused step] in fused.py); None: stop."""
        if self.state is not StepState.IDLE:
            raise RuntimeError("fuse_optimizer must be called between steps, not during a backward")
        self._stepper = stepper
        self._choose_reduction()

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, GradBucket)`` instead of an
        all-reduce; see DistributedDataParallel.register_comm_hook."""
        if self._hook is not None:
            raise RuntimeError(
                f"register_comm_hook can only be called once; a hook is already registered "
                f"({getattr(self._hook[0], '__qualname__', self._hook[0])!r})")
        if self.steps > 0 or self.state is not StepState.IDLE:
            raise RuntimeError(
                "register_comm_hook must be called before the first backward, as in torch: "
                "register the hook right after constructing DistributedDataParallel")
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {hook!r}")
        self._hook = (hook, state)
        self._choose_reduction()

    # ------------------------------------------------------------------ forward
    def before_forward(self) -> None:
        """Called before a forward with grad enabled, on every rank in step."""
        self.comm.ledger.mark_step(self.steps)
        self._output_nodes = []  # the previous forward's graph: Note [end of backward]
        self._delivery.retired = []  # Note [gradients born in their bucket] in reduction.py: freed now
        if self.state is StepState.ARMED and self.group.armed():
            raise RuntimeError(unfinished_backward(self.comm.rank, self.group.waiting_for()))
        self.state = StepState.IDLE
        self._take = self._ignore
        if self._rebuild_pending:
            self._rebuild_pending = False
            self._rebuild()

    def _rebuild(self) -> None:
        # Note [bucket order] in plan.py: every rank adopts rank 0's arrival order.
        seen = set(self._arrival)
        order = self._arrival + [i for i in reversed(range(len(self.params))) if i not in seen]
        t = torch.tensor(order, dtype=torch.int64, device=self.comm.device)
        if self.comm.size > 1:
            self.comm.broadcast(t, 0, tag="bucket order")
        order = t.tolist()
        if order == self.group.order():
            return
        self.group.build(order)
        logger.info("DDP: buckets rebuilt in gradient arrival order: %s", self.plan.describe())

    def arm(self, output: object, divisor: int | None = None, name_ranks: bool = True) -> None:
        """Prepare for the synchronised backward of the forward that produced ``output``.

        ``divisor``: how many ranks the gradients are averaged over (default: the
        group size; fewer under join with divide_by_initial_world_size=False).
        ``name_ranks``: every rank takes part in this step's error paths (False
        under join, Note [check_finite] in finite.py)."""
        self._take = self._ignore  # until this step is armed
        # With a comm hook, buckets hold plain sums: the hook divides (as torch).
        div = 1.0 if self._hook is not None else 1.0 / (divisor or self.comm.size)
        self._step = StepInputs(div, [False] * len(self.params))
        self.group.start(self._step)
        self._bytes = 0
        self._callback_queued = False
        self._name_ranks = name_ranks
        if self._static is not None:
            self._static.start_step()
        if self._check is not None:
            self._check.arm(marked=self._marks_locals, name_ranks=name_ranks)
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
        self._delivery.arm(self.group.buckets, rebind=self._stepper is None and self._context_id is None)
        # Note [hook fast path]: the handler of this step's gradients.
        self._take = (self._take_static if self._static is not None
                      else self._take_first if self.steps == 0 else self._take_steady)

    def _find_unused(self, outputs: list[torch.Tensor]) -> list[int]:
        """Parameters known to get no gradient in this backward. They are marked
        ready when backward starts, not now: a forward whose output is dropped
        must not launch reductions (torch behaves the same)."""
        if self._static is not None:
            return [] if self._static.learning else self._static.unused()
        if self.options.find_unused_parameters:
            reach = reachable_params(outputs, self._index_of)
            if not reach.opaque:
                # Parameters hidden behind an opaque node (reentrant checkpointing)
                # may still get gradients: then unreached ones wait for the end of
                # backward instead (see _finish_step).
                return [i for i in range(len(self.params)) if i not in reach.params]
        return []

    def _hook_context_grads(self) -> None:
        """Note [distributed autograd] in dist_autograd.py: this forward runs inside a
        distributed autograd context, so its backward may leave the gradients there."""
        what = "ZeRO" if self.options.zero_stage else "fuse_optimizer" if self._stepper is not None else None
        if what is not None:
            self.state = StepState.IDLE
            raise RuntimeError(unsupported_under_context(self.comm.rank, what))
        if not self._context_hooks:
            self._context_hooks = [node.register_hook(functools.partial(self._on_context_grad, i))
                                   for i, node in enumerate(self._acc_nodes)]

    # ------------------------------------------------------------------ backward: the hooks
    def _on_grad(self, i: int, param: torch.Tensor | None = None) -> None:
        # Hot path: the post-accumulate-grad hook, once per parameter per backward.
        self._take(i)

    def _ignore(self, i: int) -> None:
        pass  # no_sync, or a backward that no synchronised forward armed

    def _take_steady(self, i: int) -> None:
        if self._callback_queued and not torch.is_grad_enabled():  # Note [hook fast path]
            self._step.used[i] = True
            if self.group.take(i):
                return
        self._take_any(i)

    def _take_first(self, i: int) -> None:
        if self._take_any(i):
            self._arrival.append(i)  # Note [bucket order] in plan.py

    def _take_any(self, i: int) -> bool:
        """The general path; returns whether the gradient was newly marked."""
        if torch.is_grad_enabled():  # backward(create_graph=True): Note [end of backward]
            with torch.no_grad():
                return self._take_any(i)
        if not self._callback_queued:
            self._queue_finish()
        self._step.used[i] = True
        return self.group.ready(i)

    def _take_static(self, i: int) -> None:
        if torch.is_grad_enabled():  # backward(create_graph=True): Note [end of backward]
            with torch.no_grad():
                self._take_static(i)
            return
        if not self._callback_queued:
            self._queue_finish()
        self._step.used[i] = True
        static = self._static
        assert static is not None
        if static.count(i):
            self.group.ready(i)
        elif static.learning and static.first_arrival(i):
            self._arrival.append(i)  # every gradient waits for the end of this step

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
        if self._callback_queued:
            return
        self._callback_queued = True
        self._output_nodes = []
        queue_backward_callback(self._finish)
        if self._delivery.rebind and views_escaped(self.group.buffer, self.group.buckets):
            self.group.rebase()
            self._delivery.foreign = foreign_grads(self.group.buckets)
        for i in self._pending_unused:
            self._mark_unused(i)
        self.group.launch_complete()

    def _mark_unused(self, i: int) -> None:
        """Parameter i gets no gradient in this backward: it contributes its current
        .grad (zeros when None, as torch), and is not counted as used."""
        self.group.ready_unused(i, keep_grad=self._delivery.rebind)

    def _on_context_grad(self, i: int, grad_inputs: object, grad_outputs: object) -> None:
        # The AccumulateGrad node's post hook (Note [distributed autograd] in dist_autograd.py).
        if self.state is not StepState.ARMED or self._step.used[i] or self._context_id is None:
            return  # no synchronised backward, or a local one: _on_grad took the gradient
        if self._context_grads is None:
            # The engine's thread does not expose the backward's context to Python
            # (torch's reducer reads a C++ thread-local): the forward's context it is.
            self._context_grads = ContextGrads(self._context_id, self.params, self.names, self.comm.rank)
        self._context_grads.bind(i)
        self._on_grad(i)

    # ------------------------------------------------------------------ backward: the end
    @property
    def _tracks_used(self) -> bool:
        """Whether this step all-reduces the map of locally used parameters."""
        if self._static is not None:
            return self._static.learning
        return self.options.find_unused_parameters

    def _finish(self) -> None:
        if self.state is not StepState.ARMED:
            return
        if torch.is_grad_enabled():  # backward(create_graph=True): Note [end of backward]
            with torch.no_grad():
                self._finish()
            return
        self.state = StepState.FINISHING
        self._take = self._ignore
        context_grads, self._context_grads = self._context_grads, None
        self._used_counts = None
        try:
            self._finish_step()
            if self._delivery.rebind:  # after _finish_step: its locals hold views of the buffer
                self.group.buffer.count_views()  # Note [gradients born in their bucket] in reduction.py
            if context_grads is not None:  # Note [distributed autograd] in dist_autograd.py
                context_grads.deliver(self._used_counts, self.comm.size)
        except Exception as e:
            if self.failure_handler is None or not self.failure_handler(e):
                raise
            # Note [recovered reduction failures]: the caller drops this step.
        finally:
            if context_grads is not None:
                context_grads.restore()
            self.state = StepState.IDLE
            self._callback_queued = False

    def _finish_step(self) -> None:
        group, step, static = self.group, self._step, self._static
        learning = static is not None and static.learning
        track_used = self._tracks_used
        if learning:
            assert static is not None
            for i in static.learn():
                group.ready(i)
        missing = group.missing()
        if missing and not track_used:
            step.missing_flag = 1.0  # Note [missing-gradient flag]
        for i in missing:
            self._mark_unused(i)
        group.launch_rest()
        reduction = group.reduction
        assert reduction is not None

        used_work: Work | None = None
        used = None
        if track_used:
            used = torch.tensor(step.used, dtype=torch.int32, device=self.comm.device)
            used_work = self.comm.all_reduce(used, tag="used parameters", async_op=True)
        flag = None
        if reduction.flag_alone and self._check is None:
            # A hook reduces only the parameters' region, a reduce-scatter leaves the flag on
            # one rank: the flag travels alone. torch.full fills on the device (no wait on CUDA).
            flag = torch.full((1,), step.missing_flag, device=self.comm.device)
            self.comm.all_reduce(flag, tag=FLAGS_TAG)
        # Note [fused step] in fused.py: step each bucket as soon as it lands, unless
        # a decision needs every bucket first (dropping the step, the used map).
        stepper = self._stepper
        pipelined = stepper is not None and self._check is None and used_work is None
        if stepper is not None and pipelined:
            stepper.begin_step()
        waited = 0.0
        for bucket in group.buckets:
            started = time.perf_counter()
            bucket.wait()
            waited += time.perf_counter() - started
            if pipelined:
                self._deliver(reduction, bucket, None)
        if used_work is not None:
            started = time.perf_counter()
            used_work.wait()
            waited += time.perf_counter() - started
        self.last_stats = CommStats(self._bytes, waited)
        nonfinite = False
        if self._check is not None:
            flag, nonfinite = self._check.agree(reduction.flag_alone, step.missing_flag)
        if flag is None:
            last = group.buckets[-1]
            flag = last.data[last.spec.numel]
        if isinstance(flag, torch.Tensor) and flag.is_cuda:  # Note [late flag] in late_flag.py
            late = self._late_flag.take()  # the previous backward's
            self._late_flag.post(flag, [self.names[i] for i in missing])
            if late is not None:
                self._raise_missing(late, late=True)
        elif float(flag) > 0:
            self._raise_missing([self.names[i] for i in missing])

        globally_used = None if used is None else used.tolist()
        if static is not None:
            if learning:
                static.used = globally_used
            else:
                globally_used = static.used
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
            for bucket in group.buckets:
                self._deliver(reduction, bucket, globally_used)
        if stepper is not None:
            stepper.end_step()
        reduction.end_step(self.params, group.buckets)
        self.steps += 1

    def _deliver(self, reduction: Reduction, bucket: Bucket, globally_used: list[int] | None) -> None:
        """Hand a reduced bucket over: its averages to param.grad (not under ZeRO),
        and to the fused optimizer's step."""
        reduction.deliver(bucket, globally_used)
        if self._stepper is not None:
            self._stepper.step_bucket(bucket)

    def _raise_missing(self, mine: list[str], late: bool = False) -> None:
        if not self._name_ranks:
            # Inside tandem.join the joined ranks mirror only the reduction's
            # collectives: a gather here would meet theirs and hang. Name this rank's.
            raise RuntimeError(missing_gradients(self.comm.rank, None, mine, late=late))
        per_rank = self.comm.all_gather_object(mine, tag="missing gradients")
        raise RuntimeError(missing_gradients(self.comm.rank, per_rank, late=late))

    # ------------------------------------------------------------------ the end of a reducer
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
        self._take = self._ignore

    # ------------------------------------------------------------------ join
    def shadow_backward(self) -> None:
        """On a rank that has joined: issue the collectives of one synchronised
        backward with zero gradients (Note [join mirror] in join.py)."""
        works: list[PendingReduction] = self.group.shadow()
        if self._tracks_used:
            used = torch.zeros(len(self.params), dtype=torch.int32, device=self.comm.device)
            works.append(self.comm.all_reduce(used, tag="used parameters", async_op=True))
        if self._hook is not None:  # Note [check_finite] in finite.py: the flags grow to three
            flag = torch.zeros(1 if self._check is None else 3, device=self.comm.device)
            self.comm.all_reduce(flag, tag=FLAGS_TAG if self._check is None else FLAGS_CHECKED_TAG)
        for pending in works:
            pending.wait()
