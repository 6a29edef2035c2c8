"""The collective ledger: each process's short memory of its recent collectives.

Every collective tandem issues passes through :class:`~tandem.comm.group.GroupComm`,
which writes an entry here when it is issued and marks it when it completes.
The entries carry what a person needs to find a hang or a mismatch: a sequence
number that is the same on every rank for the same collective, the op, a tag
saying who issued it and why (``bucket 3``, ``unit layers.2``, ``buffers``),
the element count and dtype, and the training step.

# Note [ledger cost]
The ledger is on by default, so its cost is bounded by design: one small slotted
object and two clock reads per collective, a bounded ring (old entries fall
off), no locks (CPython's deque append and attribute writes are atomic; the
monitor thread only copies). ``benchmarks/bench_ledger.py`` measures it against
the DDP step (BENCHMARKS.md).

# Note [sequence numbers]
``seq`` counts this process's collectives across all its groups, from 1. Every
rank issues tandem's collectives in the same program order (that is what makes
collectives match at all), so the same ``seq`` names the same collective on
every rank, and a hang report can say "rank 1 completed #5321; ranks 0, 2 wait
in #5322". Collectives a user issues through ``torch.distributed`` directly are
not seen, and do not disturb the numbering as long as every rank issues them.

# Note [step numbers]
Step N, in what tandem prints of a training run (a collective's "of step N" in
a peer's error, a hang report or a trace; an elastic change's "going on with
step N"; the Trainer's progress, records and checkpoints), is the N-th
optimizer step of the run, counted from 1 and across resumes and changes of
world: the Trainer's ``state.step`` once that step has committed. A loop that
counts its steps so (the Trainer, a prepared elastic loop) numbers the entries
with :meth:`Ledger.loop_step` as each step begins. Without one, a DDP model
numbers them with its own count (:meth:`Ledger.mark_step`): the synchronised
backwards it has done since it was built or regrouped, from 0. Where a loop
numbers the steps, that count is ignored: it restarts at each change of world,
and one line must not mix it with the run's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["DEFAULT_CAPACITY", "Ledger", "LedgerEntry"]

DEFAULT_CAPACITY = 64
"""Entries kept per process: enough to see a hang's context, small enough to
write out several times a second."""

_MAX_DESCRIPTIONS = 4096


class LedgerEntry:
    """One collective as this rank issued it."""

    __slots__ = ("seq", "op", "tag", "numel", "dtype", "nbytes", "group", "step", "issued_at",
                 "completed_at")

    def __init__(self, seq: int, op: str, tag: str, numel: int, dtype: str, group: str,
                 step: int, nbytes: int = 0) -> None:
        self.seq = seq
        self.op = op
        self.tag = tag
        self.numel = numel
        self.dtype = dtype
        self.nbytes = nbytes
        """The payload this rank handed to the collective (its input's bytes)."""
        self.group = group
        self.step = step
        self.issued_at = time.time()
        self.completed_at: float | None = None

    @property
    def completed(self) -> bool:
        return self.completed_at is not None

    def describe(self) -> str:
        """``#12 all_reduce 'bucket 3' (4096 x float32)``."""
        tag = f" '{self.tag}'" if self.tag else ""
        return f"#{self.seq} {self.op}{tag} ({self.numel} x {self.dtype})"

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


class Ledger:
    """A ring of this process's last ``capacity`` collectives, plus counters.

    Progress, for the launcher's watchdog, is a collective completing or a step
    starting: :attr:`last_progress` is the wall-clock time of the latest.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"Ledger capacity must be >= 1, got {capacity}")
        self._ring: deque[LedgerEntry] = deque(maxlen=capacity)
        self._descriptions: dict[str, str] = {}
        self.issued = 0
        """Collectives issued by this process (the last ``seq``)."""
        self.completed = 0
        """Collectives this process has seen complete."""
        self.bytes_issued = 0
        """Payload bytes of every collective issued by this process (each one's input)."""
        self.step = 0
        """The training step the next entries carry (Note [step numbers])."""
        self._loop_numbers = False
        self.last_progress = time.time()
        """Wall-clock time of the last completion or step."""

    @property
    def capacity(self) -> int:
        return self._ring.maxlen or 0

    def resize(self, capacity: int) -> None:
        """Keep the last ``capacity`` entries from now on (tests keep a whole run)."""
        if capacity < 1:
            raise ValueError(f"Ledger capacity must be >= 1, got {capacity}")
        self._ring = deque(self._ring, maxlen=capacity)

    def issue(self, op: str, tag: str, numel: int, dtype: str, group: str, nbytes: int = 0) -> LedgerEntry:
        """Record a collective about to be issued, of ``nbytes`` of payload; returns its entry."""
        self.issued += 1
        self.bytes_issued += nbytes
        entry = LedgerEntry(self.issued, op, tag, numel, dtype, group, self.step, nbytes)
        self._ring.append(entry)
        return entry

    def complete(self, entry: LedgerEntry) -> None:
        """Mark ``entry`` completed (again is a no-op)."""
        if entry.completed_at is None:
            entry.completed_at = time.time()
            self.completed += 1
            self.last_progress = entry.completed_at

    def mark_step(self, step: int | None = None) -> None:
        """A training step begins: ``step``, or the next one, unless a loop numbers
        the steps (:meth:`loop_step`). Counts as progress."""
        if not self._loop_numbers:
            self.step = self.step + 1 if step is None else int(step)
        self.last_progress = time.time()

    def loop_step(self, step: int) -> None:
        """A training loop begins its step ``step``, the run's N-th (Note [step
        numbers]): the number the entries carry from now on, whatever
        :meth:`mark_step` says. Counts as progress."""
        self._loop_numbers = True
        self.step = int(step)
        self.last_progress = time.time()

    def describe_tag(self, tag: str, text: str) -> None:
        """Say what a tag covers (a bucket's parameter names, say), for hang reports."""
        if len(self._descriptions) < _MAX_DESCRIPTIONS or tag in self._descriptions:
            self._descriptions[tag] = text

    def describe_params(self, tag: str, names: Sequence[str], shown: int = 4) -> None:
        """Say which parameters a tag's collectives carry (the first ``shown`` names)."""
        more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
        self.describe_tag(tag, f"params: {', '.join(names[:shown])}{more}")

    def entries(self) -> list[LedgerEntry]:
        """The kept entries, oldest first (a copy)."""
        return list(self._ring)

    def in_flight(self) -> list[LedgerEntry]:
        """Kept entries issued but not yet completed, oldest first."""
        return [e for e in self.entries() if e.completed_at is None]

    def snapshot(self, last: int = 16) -> dict[str, Any]:
        """A JSON-able picture: counters, the last ``last`` entries, every kept
        entry still in flight, and the descriptions of their tags."""
        entries = self.entries()
        shown = entries[-last:]
        flying = [e for e in entries[:-last] if e.completed_at is None] + shown
        tags = {e.tag for e in flying if e.completed_at is None}
        return {
            "issued": self.issued, "completed": self.completed, "step": self.step,
            "last_progress": self.last_progress,
            "entries": [e.to_dict() for e in _unique(flying)],
            "descriptions": {t: self._descriptions[t] for t in tags if t in self._descriptions},
        }


def _unique(entries: Iterable[LedgerEntry]) -> list[LedgerEntry]:
    seen: set[int] = set()
    out = []
    for e in sorted(entries, key=lambda e: e.seq):
        if e.seq not in seen:
            seen.add(e.seq)
            out.append(e)
    return out
