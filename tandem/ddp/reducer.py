"""The gradient reducer: readiness hooks, in-order bucket launches, and the end of
backward.

Life of one synchronised step::

    forward ends   -> arm(outputs)           buckets FILLING; unused params marked
    grad of p lands-> _on_grad(p)            copy p.grad/world into its bucket view;
                                             launch every complete bucket in order
    backward ends  -> _finish()              launch the rest, wait all, write
                                             averaged grads to param.grad

A gradient's path, file by file (all in tandem/ddp/)::

    plan.py            which bucket and offset a parameter gets (pure)
    reducer.py         arm: each forward readies the step (here)
    autograd_hooks.py  _on_grad: backward says a gradient is final; the end is queued
    readiness.py       _ready: the gradient copied into its bucket (scaled) and marked
    launch.py          _launch: every complete bucket's reduction, in bucket order
    finish.py          _finish_step: the rest launched, all waited on, the flag read
    write_back.py      the averages to param.grad: copied, or bound as views
    bucket.py          the bucket's views, its state, the copy in (scaled)
    grad_bucket.py     what a communication hook sees, and its pending result
    fused.py           the optimizer step per bucket, when one is fused
    finite.py          check_finite: one NaN/Inf decision on every rank
    errors.py          what the reducer says when the model or the loop is wrong

:class:`GradReducer` is built in layers, one stage of that path per file, each
class on the one before: ``ReducerState`` (reducer_state.py: the options, the
step's state, the buckets) <- ``Launching`` <- ``Readiness`` <- ``Finishing``
<- ``AutogradHooks`` <- ``GradReducer`` (here: arming each forward, the bucket
rebuild, communication hooks, the fused step and join's mirrored backward).
Every attribute is set in ``ReducerState.__init__`` (the hooks' in
``AutogradHooks.__init__``), so the state is read in one place.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

from tandem._compat import dist_autograd_context_id
from tandem._tree import iter_tensors
from tandem.comm.group import GroupComm, Work
from tandem.ddp.autograd_hooks import AutogradHooks
from tandem.ddp.checks import NonFiniteReport
from tandem.ddp.comm_stats import CommStats
from tandem.ddp.dist_autograd import unsupported_under_context
from tandem.ddp.finish import FLAGS_TAG
from tandem.ddp.finite import FLAGS_CHECKED_TAG
from tandem.ddp.fused import BucketStepper
from tandem.ddp.grad_bucket import CommHook, GradBucket, HookWork, issues_one_collective
from tandem.ddp.graph import reachable_params
from tandem.ddp.reducer_state import ReducerOptions, StepState
from tandem.ddp.write_back import foreign_grads

__all__ = ["CommStats", "GradReducer", "ReducerOptions", "StepState"]

logger = logging.getLogger(__name__)


class GradReducer(AutogradHooks):
    """Averages the gradients of ``params`` across ``comm`` during backward."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], comm: GroupComm,
                 options: ReducerOptions) -> None:
        super().__init__(named_params, comm, options)
        logger.info("DDP: %s, world %d", self.plan.describe(), comm.size)

    def before_forward(self) -> None:
        """Called before a forward with grad enabled, on every rank in step."""
        self.comm.ledger.mark_step(self.steps)
        self._output_nodes = []  # the previous forward's graph: Note [end of backward] in autograd_hooks.py
        self._retired = []  # Note [gradients born in their bucket] in write_back.py: freed now, as torch frees them
        if self.state is StepState.ARMED and any(b.num_ready for b in self.buckets):
            self._raise_unfinished()
        self.state = StepState.IDLE
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
        if order == [i for b in self.plan.buckets for i in b.params]:
            return
        self._build(order)
        logger.info("DDP: buckets rebuilt in gradient arrival order: %s", self.plan.describe())

    def arm(self, output: object, divisor: int | None = None, name_ranks: bool = True) -> None:
        """Prepare for the synchronised backward of the forward that produced ``output``.

        ``divisor``: how many ranks the gradients are averaged over (default: the
        group size; fewer under join with divide_by_initial_world_size=False).
        ``name_ranks``: every rank takes part in this step's error paths (False
        under join, Note [check_finite] in finite.py)."""
        # With a comm hook, buckets hold plain sums: the hook divides (as torch).
        self._div = 1.0 if self._comm_hook else 1.0 / (divisor or self.comm.size)
        # Note [in-place reduction] in launch.py: only where param.grad is what the plain path writes.
        self._in_place = not (self._zero or self._as_view or self._comm_hook is not None
                              or self._check is not None)
        self._bytes = 0
        if self.buffer.released:  # Note [zero reduction] in launch.py
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
        # Note [end of backward] in autograd_hooks.py: held until the synchronised pass starts (or the
        # next forward), released before the next forward builds its graph.
        self._output_nodes = [t.grad_fn for t in outputs if t.grad_fn is not None]
        if self.steps == 0:
            self._arrival = []  # an earlier first step may have failed half-way
        self._pending_unused = self._find_unused(outputs)
        self._context_grads = None
        self._context_id = dist_autograd_context_id()
        if self._context_id is not None:
            self._hook_context_grads()
        # Note [gradients born in their bucket] in write_back.py
        self._rebind = self._born and self._stepper is None and self._context_id is None
        # Note [hook fast path] in autograd_hooks.py: no hook counts (static graph), no arrival order to record.
        self._fast = not self._static and self.steps > 0
        if self._rebind:
            self._foreign = foreign_grads(self.buckets)

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
            self.comm.all_reduce(flag, tag=FLAGS_TAG if self._check is None else FLAGS_CHECKED_TAG)
        for pending in works:
            pending.wait()
