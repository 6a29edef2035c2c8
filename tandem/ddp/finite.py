"""``check_finite``: every rank agrees whether a synchronised backward's
gradients hold NaN or Inf, and raises or drops the step together.

# Note [check_finite]
With ``check_finite`` (ReducerOptions.check_finite), every rank decides on the
same data whether this step's gradients hold a NaN or an Inf, so that every rank
raises, or every rank drops the step, together. On the plain path this needs no
collective: a sum all-reduce leaves every rank with the same reduced bucket, and
a NaN/Inf in any rank's bucket (or an overflow of the sum) makes it non-finite,
so the reduced buckets are checked (one pass each, after the wait). Under a
communication hook the reduced values are the hook's output, which a compressing
or non-communicating hook (noop_hook) need not make identical across ranks, and
under ZeRO each rank holds only its shard of the sum: there the decision rides on
the missing-gradient flag's all-reduce, which exists anyway (Note [zero
reduction] in reduction.py) and grows to three elements: missing, any bucket non-finite on this
rank before launch, any reduced bucket (or shard) non-finite here. It is then
issued after the buckets are waited on, in the same place in the issue order.
Where the local gradients will be gone or needed for the flags (hooks, ZeRO,
gradient_as_bucket_view), every rank records before each launch one scalar per
bucket (NaN if its local bucket is non-finite; no device sync); on the plain
path param.grad still holds them. Only on the failure path, which every rank
takes together, are names looked up and exchanged in one all_gather_object:
per rank, the parameters whose local gradient was non-finite (from param.grad,
or from the bucket where param.grad is a view of it, or under ZeRO, where the
bucket keeps the local gradients it scattered), and those non-finite after
reduction. Inside tandem.join the joined ranks do not take part in that
exchange, so the report then names parameters only. "skip" leaves the step as
if its backward had never run after ``zero_grad(set_to_none=True)``: every
param.grad is None (torch's optimizers step no parameter), ZeRO's gradient
shards are zeros and ``steps`` is not advanced (so ZeroOptimizer binds no new
gradients). With check_finite off, none of this runs: one attribute test per
bucket launch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from tandem.comm.group import GroupComm
from tandem.ddp.bucket import Bucket, GradBuffer
from tandem.ddp.checks import NonFinite, NonFiniteReport, nonfinite_mark, nonfinite_names
from tandem.dtensor import local_grad

__all__ = ["CheckedReducer", "FLAGS_CHECKED_TAG", "FiniteCheck"]

logger = logging.getLogger(__name__)

FLAGS_CHECKED_TAG = "missing gradients and non-finite flags"


class _ZeroStageOption(Protocol):
    @property
    def zero_stage(self) -> int: ...


class CheckedReducer(Protocol):
    """What the check reads of the reducer that owns it
    (:class:`tandem.ddp.reducer.GradReducer`, which imports this module)."""

    @property
    def comm(self) -> GroupComm: ...
    @property
    def options(self) -> _ZeroStageOption: ...
    @property
    def names(self) -> Sequence[str]: ...
    @property
    def params(self) -> Sequence[torch.Tensor]: ...
    @property
    def buckets(self) -> Sequence[Bucket]: ...
    @property
    def grad_shards(self) -> Sequence[torch.Tensor]: ...
    @property
    def buffer(self) -> GradBuffer: ...
    @property
    def steps(self) -> int: ...


class FiniteCheck:
    """The check_finite state of one reducer, step by step (Note [check_finite])."""

    def __init__(self, mode: NonFinite, reducer: CheckedReducer) -> None:
        self.mode = mode
        self._r = reducer
        self.report: NonFiniteReport | None = None  # of the last synchronised backward
        self.steps_found = 0                         # synchronised backwards that found some
        self._local_marks: list[torch.Tensor] | None = None  # per bucket, when recorded
        self._name_ranks = True

    def arm(self, *, marked: bool, name_ranks: bool) -> None:
        """A new synchronised backward: record per-bucket marks when the local
        gradients will be gone (``marked``); ``name_ranks``: every rank takes part
        in the report's exchange (False under join)."""
        self.report = None
        self._local_marks = [torch.zeros(())] * len(self._r.buckets) if marked else None
        self._name_ranks = name_ranks

    def mark(self, bucket: Bucket) -> None:
        """Before ``bucket`` is launched: NaN if its local gradients are non-finite."""
        if self._local_marks is not None:
            self._local_marks[bucket.index] = nonfinite_mark(bucket.grads)

    def agree(self, flag_alone: bool, missing_flag: float) -> tuple[torch.Tensor | None, bool]:
        """Whether this step's gradients are non-finite on any rank: the same answer
        on every rank. When the missing-gradient flag travels alone, it travels
        with the answer, and is returned reduced; else None."""
        r = self._r
        reduced = r.grad_shards if r.options.zero_stage else [b.grads for b in r.buckets]
        reduced_bad = torch.stack([nonfinite_mark(t) for t in reduced]).isnan().any()
        if not flag_alone:
            return None, bool(reduced_bad)  # identical reduced buckets: no collective
        assert self._local_marks is not None, "recorded for hooks and ZeRO"
        flags = torch.zeros(3, device=r.comm.device)
        flags[0] = missing_flag
        flags[1] = torch.stack(self._local_marks).isnan().any()
        flags[2] = reduced_bad
        r.comm.all_reduce(flags, tag=FLAGS_CHECKED_TAG)
        _, local_bad, after_bad = flags.tolist()
        return flags[:1], local_bad + after_bad > 0

    def handle(self) -> None:
        """Raise on every rank, or drop this step's gradients on every rank."""
        r = self._r
        report = self._report()
        self.report = report
        self.steps_found += 1
        if self.mode is NonFinite.RAISE:
            raise RuntimeError(
                f"rank {r.comm.rank}: DistributedDataParallel(check_finite='raise') found NaN/Inf "
                f"gradients: {report.describe()}. Every rank raises this error and no averaged gradient "
                "was written to param.grad. Find where the NaN/Inf comes from on the named rank "
                "(torch.autograd.set_detect_anomaly(True), a lower learning rate, a clipped "
                "loss), or pass check_finite='skip' to drop such steps on every rank")
        if r.comm.rank == 0:
            logger.warning("DDP: check_finite='skip' dropped the gradients of this step: %s",
                           report.describe())
        for p in r.params:
            p.grad = None
        if r.options.zero_stage:  # Note [zero reduction] in reduction.py
            for shard in r.grad_shards:
                shard.zero_()
            for bucket in r.buckets:  # Note [zero buckets] in reduction.py
                bucket.give_back_memory()

    def _report(self) -> NonFiniteReport:
        """Which ranks and parameters; a collective unless inside join."""
        r = self._r
        step = r.steps + self.steps_found
        local_bad = ([True] * len(r.buckets) if self._local_marks is None
                     else torch.stack(self._local_marks).isnan().tolist())
        mine = [n for b, bad in zip(r.buckets, local_bad) if bad for n in self._local_nonfinite(b)]
        after = self._reduced_nonfinite()
        position = {n: i for i, n in enumerate(r.names)}

        def in_model_order(names: Iterable[str]) -> tuple[str, ...]:
            return tuple(sorted(set(names), key=position.__getitem__))

        if not self._name_ranks:
            return NonFiniteReport(step=step, before=None, after=in_model_order(after))
        everyone = r.comm.all_gather_object((mine, after), tag="non-finite gradients")
        return NonFiniteReport(step=step, before=tuple(in_model_order(m) for m, _ in everyone),
                               after=in_model_order(n for _, a in everyone for n in a))

    def _local_nonfinite(self, bucket: Bucket) -> list[str]:
        """This rank's parameters in ``bucket`` whose own gradient is non-finite."""
        zero = bool(self._r.options.zero_stage)
        named = []
        for pos, (name, p) in enumerate(zip(bucket.names, bucket.params)):
            if zero or bucket.grad_is_view(pos):
                # ZeRO: the bucket still holds the local gradients it scattered.
                # gradient_as_bucket_view: the local ones are gone, the reduced
                # ones stand in for them.
                named.append((name, bucket.views[pos]))
            else:
                grad = local_grad(p)
                if grad is not None:
                    named.append((name, grad))
        return nonfinite_names(named)

    def _reduced_nonfinite(self) -> list[str]:
        """The parameters whose reduced gradient on this rank is non-finite."""
        r = self._r
        if not r.options.zero_stage:
            return nonfinite_names([(n, v) for b in r.buckets for n, v in zip(b.names, b.views)])
        named = []
        for bucket, shard in zip(r.buckets, r.grad_shards):
            lo = r.comm.rank * shard.numel()
            hi = lo + shard.numel()
            for name, offset, p in zip(bucket.names, bucket.spec.offsets, bucket.params):
                start, end = max(offset, lo), min(offset + p.numel(), hi)
                if start < end:
                    named.append((name, shard.narrow(0, start - lo, end - start)))
        return nonfinite_names(named)
