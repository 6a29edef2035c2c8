"""Which rank holds the others back, and in which phase of its step:
:class:`StepPhases`, :func:`judge`, :class:`StragglerWatch`.

# Note [naming a straggler]
In data-parallel training every rank waits for the slowest at each step's
collectives, so a slow rank shows up on the others as communication wait,
and on itself as a long phase of its own. Each rank splits its step into
four phases: waiting for its batch (data), forward and backward less the
time spent waiting on collectives (compute), that wait (comm, from the
collectives' statistics), and the optimizer's step. Every ``every`` steps the
ranks all-gather their mean phases, four floats each: the only
communication this costs, one small collective every few steps.

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

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.comm.group import GroupComm

__all__ = ["PHASES", "MIN_EXCESS_S", "Slow", "StepPhases", "StragglerWatch", "judge"]

PHASES = ("data", "compute", "comm", "optimizer")
"""A step's phases, in the order they are gathered."""
_BLAMED = ("data", "compute", "optimizer")
MIN_EXCESS_S = 0.002
"""A phase must be at least this much longer than the others' (seconds per step) to be slow."""


@dataclass(frozen=True)
class StepPhases:
    """Seconds of one step on this rank, by phase."""

    data: float
    compute: float
    comm: float
    optimizer: float

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (self.data, self.compute, self.comm, self.optimizer)


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


class StragglerWatch:
    """Gathers every rank's step phases every ``every`` steps and names the
    ranks that are consistently slow (Note [naming a straggler]).

    Args:
        comm: the ranks' group; every rank must call :meth:`end_step` at the same steps.
        every: steps between gathers.
        confirm: windows in a row a rank must be slow in, in the same phase, to be named.
    """

    def __init__(self, comm: GroupComm, *, every: int = 5, confirm: int = 3, ratio: float = 2.0,
                 min_excess: float = 0.1) -> None:
        if every < 1 or confirm < 1:
            raise ValueError(f"StragglerWatch: every={every} and confirm={confirm} must be >= 1")
        self.comm, self.every, self.confirm = comm, every, confirm
        self.ratio, self.min_excess = ratio, min_excess
        self._sums = [0.0] * len(PHASES)
        self._steps = 0
        self._streaks: dict[tuple[int, str], int] = {}
        self.named: list[Slow] = []
        """The ranks named at the last gather (empty: none is slow)."""
        self.last: list[list[float]] = []
        """Every rank's mean phases at the last gather, by rank."""

    def end_step(self, phases: StepPhases) -> list[Slow] | None:
        """Count one step; at every ``every``-th, gather and judge: the ranks named
        now (maybe none). None between gathers."""
        for i, value in enumerate(phases.as_tuple()):
            self._sums[i] += value
        self._steps += 1
        if self._steps < self.every:
            return None
        mine = torch.tensor([s / self._steps for s in self._sums], dtype=torch.float64)
        self._sums = [0.0] * len(PHASES)
        self._steps = 0
        self.last = [t.tolist() for t in self.comm.all_gather(mine, tag="step phases")]
        slow = judge(self.last, ratio=self.ratio, min_excess=self.min_excess)
        now = {(s.rank, s.phase) for s in slow}
        self._streaks = {key: self._streaks.get(key, 0) + 1 for key in now}
        self.named = [s for s in slow if self._streaks[(s.rank, s.phase)] >= self.confirm]
        return self.named
