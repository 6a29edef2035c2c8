"""Which rank holds the others back, and in which phase of its step:
:class:`StepPhases`, :func:`judge`, :class:`StragglerWatch`.

# Note [naming a straggler]
In data-parallel training every rank waits for the slowest at each step's
collectives, so a slow rank shows up on the others as communication wait,
and on itself as a long phase of its own. Each rank splits its step into
four phases: waiting for its batch (data), forward and backward less the
time spent waiting on collectives (compute), that wait (comm, from the
collectives' statistics), and the optimizer's step. At the end of each
window of steps the ranks start an all-gather of their mean phases, four
floats each, and wait for it at the next step: the only communication this
costs, and its latency hides behind the step after. The gather
(:class:`PhaseGather`) is issued to torch directly and stays out of the
collective ledger: an in-flight gather written there would stand as the
collective every rank waits in, and a hang report would blame it for a hang
elsewhere (tests/launch/test_faults.py caught that when it was issued
through the model's group). Waiting for it at once, at the window's end,
made the watch cost 3% of an 8.7 ms step on two ranks of a 2-core machine.

A window is ``every`` steps, and longer where steps are short: at least
:data:`MIN_WINDOW_S`. Issuing a collective costs a fixed time (about 0.25 ms
on that machine, where the gloo thread that sends it takes the core from
the training thread), so a window of fixed steps would cost a share that
grows as steps shrink; a window of at least 0.1 s costs at most a few tenths
of a percent. The ranks pick the next window from the median step of the
window just gathered, which every rank has alike, so they agree on it
without a word.

:func:`judge` compares each rank's data, compute and optimizer phases with
the median of the other ranks' same phase: the median of the others, so
that with two ranks each is compared with the other, and one slow rank does
not raise the bar it is judged by. A phase is slow when it is at least
``ratio`` times that median and longer than it by at least ``min_excess``
of the median step (with a floor of :data:`MIN_EXCESS_S`): a busy machine
stretches steps by chance, and a straggler worth naming costs the job a
share of every step. Comm wait is never blamed: it is the symptom on the
ranks that wait. A rank is named only when the same phase is slow in
``confirm`` windows in a row, and is named in every window from then on
while it stays slow.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tandem._compat import all_gather_into_tensor

__all__ = ["PHASES", "MIN_EXCESS_S", "LoopPhases", "PhaseGather", "Slow", "StepPhases", "StragglerWatch", "judge"]

PHASES = ("data", "compute", "comm", "optimizer")
"""A step's phases, in the order they are gathered."""
_BLAMED = ("data", "compute", "optimizer")
MIN_EXCESS_S = 0.002
"""A phase must be at least this much longer than the others' (seconds per step) to be slow."""
MIN_WINDOW_S = 0.1
"""A window of steps compared lasts at least this long (seconds): longer windows for short steps."""


@dataclass(frozen=True)
class StepPhases:
    """Seconds of one step on this rank, by phase."""

    data: float
    compute: float
    comm: float
    optimizer: float


@dataclass(frozen=True)
class Slow:
    """Rank ``rank`` is slow in ``phase``: ``ratio`` times the other ranks' median."""

    rank: int
    phase: str
    ratio: float

    def describe(self) -> str:
        """``rank 2 slow: data 3.1x the median``."""
        return f"rank {self.rank} slow: {self.phase} {self.ratio:.1f}x the median"


def judge(phases: Sequence[Sequence[float]], *, ratio: float = 2.0, min_excess: float = 0.1) -> list[Slow]:
    """The slow ranks among ``phases[rank] = (data, compute, comm, optimizer)``
    (mean seconds per step), each with its slowest phase (Note [naming a
    straggler]); empty with fewer than two ranks."""
    if len(phases) < 2:
        return []
    step = statistics.median(sum(p) for p in phases)
    floor = max(MIN_EXCESS_S, min_excess * step)
    found = []
    for rank, mine in enumerate(phases):
        worst: Slow | None = None
        for name in _BLAMED:
            i = PHASES.index(name)
            others = statistics.median(p[i] for r, p in enumerate(phases) if r != rank)
            value = mine[i]
            if value - others < floor or value < ratio * others:
                continue
            times = value / others if others > 0 else float("inf")
            if worst is None or times > worst.ratio:
                worst = Slow(rank, name, times)
        if worst is not None:
            found.append(worst)
    return found


class PhaseGather:
    """The ranks' mean phases of a window, all-gathered outside the collective
    ledger (Note [naming a straggler]): started by :meth:`start`, waited for
    by :meth:`finish`. On the default group where it runs on the CPU with gloo;
    otherwise (NCCL alone) on a gloo group of its own, made at the first start
    (a collective of every rank) and destroyed by :meth:`close`.

    Args:
        size: the default group's size.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._own: dist.ProcessGroup | None = None
        self._work: Any = None
        self._out = torch.empty(0, dtype=torch.float64)

    def _group(self) -> dist.ProcessGroup | None:
        if "gloo" in str(dist.get_backend()):
            return None  # the default group: gloo takes CPU tensors
        if self._own is None:
            self._own = dist.new_group(backend="gloo")
        return self._own

    def start(self, mine: Sequence[float]) -> None:
        """Start gathering ``mine`` from every rank (call :meth:`finish` first)."""
        self._out = torch.empty(self.size * len(mine), dtype=torch.float64)
        self._work = all_gather_into_tensor(self._out, torch.tensor(mine, dtype=torch.float64),
                                            group=self._group(), async_op=True)

    def finish(self) -> list[list[float]] | None:
        """Every rank's values of the gather started last, by rank; None when none is under way."""
        if self._work is None:
            return None
        self._work.wait()
        self._work = None
        return self._out.view(self.size, -1).tolist()

    def close(self) -> None:
        """Wait for a gather under way and destroy a group of its own (every rank, at the same point)."""
        self.finish()
        if self._own is not None:
            dist.destroy_process_group(self._own)
            self._own = None


class StragglerWatch:
    """Gathers every rank's step phases at the end of each window of steps
    and names the ranks that are consistently slow (Note [naming a straggler]).

    Args:
        gather: the ranks' gather; every rank must call :meth:`end_step` at the same steps.
        every: steps a window has at least.
        confirm: windows in a row a rank must be slow in, in the same phase, to be named.
        ratio: how many times the others' median a phase must be, to be slow.
        min_excess: by how much (a share of the median step) it must exceed that median.
        min_window_s: seconds a window lasts at least (by the median step of the last window).
    """

    def __init__(self, gather: PhaseGather, *, every: int = 4, confirm: int = 3, ratio: float = 2.0,
                 min_excess: float = 0.1, min_window_s: float = MIN_WINDOW_S) -> None:
        if every < 1 or confirm < 1:
            raise ValueError(f"StragglerWatch: every={every} and confirm={confirm} must be >= 1")
        self.gather, self.every, self.confirm = gather, every, confirm
        self.ratio, self.min_excess, self.min_window_s = ratio, min_excess, min_window_s
        self.window = every
        """Steps in the window under way: ``every``, or more when steps are short."""
        self._sums = [0.0] * len(PHASES)
        self._steps = 0
        self._streaks: dict[tuple[int, str], int] = {}
        self.named: list[Slow] = []
        """The ranks named at the last judgement (empty: none is slow)."""
        self.last: list[list[float]] = []
        """Every rank's mean phases in the last window judged, by rank."""

    def end_step(self, phases: StepPhases) -> list[Slow] | None:
        """Count one step. When a window ends, start gathering its phases; at
        the step after, judge them: the ranks named then (maybe none). None at
        the other steps."""
        sums = self._sums
        sums[0] += phases.data
        sums[1] += phases.compute
        sums[2] += phases.comm
        sums[3] += phases.optimizer
        self._steps += 1
        gathered = self.gather.finish()
        if gathered is not None:
            self._judge(gathered)
        if self._steps >= self.window:
            self.gather.start([s / self._steps for s in sums])
            self._sums = [0.0] * len(PHASES)
            self._steps = 0
        return None if gathered is None else self.named

    def _judge(self, gathered: list[list[float]]) -> None:
        self.last = gathered
        slow = judge(gathered, ratio=self.ratio, min_excess=self.min_excess)
        now = {(s.rank, s.phase) for s in slow}
        self._streaks = {key: self._streaks.get(key, 0) + 1 for key in now}
        self.named = [s for s in slow if self._streaks[(s.rank, s.phase)] >= self.confirm]
        # Every rank has the same numbers, so every rank picks the same next window.
        step = statistics.median(sum(p) for p in gathered)
        self.window = max(self.every, math.ceil(self.min_window_s / step)) if step > 0 else self.every

    def close(self) -> None:
        """Wait for the gather under way and free its group (every rank, at the same point)."""
        self.gather.close()


class LoopPhases:
    """The step phases of a training loop the user writes (``tandem.prepare``),
    from hooks rather than from inside the loop: a step ends when the
    optimizer's step does; its data phase lasts until the model's first forward
    after that, its compute phase until the optimizer's step begins (less the
    model's communication wait), its optimizer phase until the step ends. Rank 0
    says on stderr when the ranks named slow change.

    Args:
        model: the prepared model (its ``comm_stats`` give the wait, where it has them).
        optimizer: the optimizer the loop steps.
        watch: where each step's phases go.
        rank: this process's rank.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, watch: StragglerWatch,
                 rank: int) -> None:
        self.model, self.watch, self.rank = model, watch, rank
        self._step_end = time.perf_counter()
        self._first_forward: float | None = None
        self._step_start = 0.0
        self._said: list[tuple[int, str]] = []
        # The hooks hold this object for the life of the model and the optimizer.
        model.register_forward_pre_hook(self._forward)
        optimizer.register_step_pre_hook(self._step_begins)
        optimizer.register_step_post_hook(self._step_ends)

    def _forward(self, *_: Any) -> None:
        if self._first_forward is None:
            self._first_forward = time.perf_counter()

    def _step_begins(self, *_: Any) -> None:
        self._step_start = time.perf_counter()

    def _step_ends(self, *_: Any) -> None:
        now = time.perf_counter()
        first = self._first_forward if self._first_forward is not None else self._step_start
        stats = getattr(self.model, "comm_stats", None)
        comm = float(stats.wait_s) if stats is not None else 0.0
        named = self.watch.end_step(StepPhases(
            data=first - self._step_end, compute=max(0.0, self._step_start - first - comm), comm=comm,
            optimizer=now - self._step_start))
        self._first_forward = None
        self._step_end = time.perf_counter()
        if named is not None and self.rank == 0:
            who = [(s.rank, s.phase) for s in named]
            if who != self._said:  # said when who is slow changes, not at every window
                text = "; ".join(s.describe() for s in named) or "no rank is slow any more"
                print(f"tandem: {text} (the ranks compare their steps every {self.watch.every} or more, "
                      f"{self.watch.min_window_s:g} s at least)",
                      file=sys.stderr, flush=True)
            self._said = who
