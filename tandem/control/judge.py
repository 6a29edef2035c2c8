"""One member judges who is dead, for every member: :class:`Judge`, :class:`Verdict`.

# Note [judge once]
A step's decision waits (Note [elastic membership] in membership.py). If every
waiting member looked at every other member's beat and process between
slices, that would be two or three store operations per member, by every
member: N members waiting on a late decision would put about 8N² operations a
second on the store, which one core stops serving near N = 63 (BENCHMARKS.md
"Past this machine"). So one member judges for all, and tells the others by
deciding:

* the generation's first member (its rank 0) is the judge. Once a beat it reads
  every beat in one ``multi_get`` (a ``check`` first: the keys exist): the
  beats of the nodes whose launchers beat for their workers (Note [deaths seen
  at once] in tandem/comm/process_id.py: a worker that ended is named in its node's beat at
  once), and of the members that beat for themselves, whose process it asks
  when the beat is two beats old. It posts the verdict, with the time it was
  made, under one key of the generation, ``gen/<g>/verdict``, and when the
  verdict names a member dead it proposes ``abort`` for the step its own member
  is working on, which is the step the others wait on (no member starts a step
  before the previous one is decided). Waiting members wait on the decision's
  key, which the store answers when it is written: nothing is read a slice;
* the judge is not a single point: the members at the middle and last ranks are
  its deputies (spread, so that one node's loss, whose ranks are neighbours,
  rarely takes all three). A deputy reads the verdict once a beat; when it is
  two beats old it asks whether the seats before its own are dead (their
  process ended: its launcher tells at once), and judges if they are, or if the
  verdict is older than ``stale_after_s`` plus a beat for each seat before it
  (the seats before went silent with their node);
* a waiting member reads the verdict each time its wait times out (a slice of
  half ``stale_after_s``, 5 s at most) and proposes ``abort`` itself when it
  names another member dead (the judge may not know the step yet); one that
  sees no verdict newer than ``stale_after_s`` plus :data:`DEPUTIES` beats
  judges for itself when every judging seat is dead, or after three windows
  without a verdict whatever the seats. A late verdict from a living seat
  means a store that answers slowly, and a thousand members each reading
  every member's keys at once would keep it slow.

The store's load per beat is a few operations for the judge, one beat per node
and, while a decision is late, one read per member and slice: linear in
nodes, not quadratic in members. A death is in the verdict at the judge's next
beat after its process's end is known (its launcher's notice) or after its
beat is ``stale_after_s`` old, and in the decision every member waits on at
once.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from tandem.comm.thread_exit import join_before_exit
from tandem.store.job_secret import ForgedValueError

__all__ = ["DEPUTIES", "Judge", "Verdict", "judging_ranks"]

logger = logging.getLogger(__name__)

DEPUTIES = 3
"""How many members judge: the judge and its deputies (:func:`judging_ranks`)."""


def judging_ranks(world_size: int) -> tuple[int, ...]:
    """The ranks that judge a generation of ``world_size``, the judge first:
    the first, the middle and the last (Note [judge once])."""
    return tuple(dict.fromkeys((0, world_size // 2, world_size - 1)))[:DEPUTIES]


@dataclass(frozen=True)
class Verdict:
    """Who is dead, as one member judged it at ``at`` (wall-clock seconds)."""

    at: float
    by: str
    dead: dict[str, str]

    def encode(self) -> str:
        return json.dumps({"at": self.at, "by": self.by, "dead": self.dead})

    @classmethod
    def decode(cls, raw: bytes) -> Verdict | None:
        """The verdict in ``raw``; None for what is no verdict (junk: Note [a stranger asks to
        join] in join_requests.py)."""
        try:
            value = json.loads(raw.decode())
            dead = {str(k): str(v) for k, v in dict(value["dead"]).items()}
            return cls(float(value["at"]), str(value["by"]), dead)
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
            return None


class Judge:
    """This member's seat in judging one generation (Note [judge once]).

    Args:
        store: the job's store.
        key: the generation's verdict key.
        news: the generation's news key, written when a verdict names a death
            (Note [news of a generation] in news.py).
        member: this member's id.
        before: the members in the seats before this one (the judge first): none
            for the judge; None for a member that only reads.
        beat_s: how often the judge judges.
        stale_after_s: how old a verdict may be before a deputy takes over.
        clock: wall-clock time in seconds.
        sweep: the judgement itself: those of the given members (all the
            generation's when None) found dead, with why.
        abort: proposes ``abort`` for the step this member works on (when it
            knows it): called when a verdict names a death.
    """

    def __init__(self, store: dist.Store, key: str, member: str, before: tuple[str, ...] | None, *,
                 news: str, beat_s: float, stale_after_s: float, clock: Callable[[], float],
                 sweep: Callable[[Sequence[str] | None], dict[str, str]],
                 abort: Callable[[], None]) -> None:
        self._store = store
        self.key = key
        self._news = news
        self._member = member
        self._before = before
        self._beat_s = beat_s
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._sweep = sweep
        self._abort_step = abort
        self._said: set[str] = set()  # the deaths this judge logged
        self._since = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if before is not None:
            self._thread = threading.Thread(target=self._run, name=f"tandem-judge-{member}", daemon=True)
            self._thread.start()

    def read(self) -> Verdict | None:
        """The latest verdict, when one was made within ``stale_after_s`` plus a
        beat for each deputy; None when there is none that fresh (then the
        member judges for itself)."""
        verdict = self._latest()
        if verdict is None or self._clock() - verdict.at > self._stale_after_s + DEPUTIES * self._beat_s:
            return None
        return verdict

    def seated_s(self) -> float:
        """Seconds since this seat was taken: how long a verdict has had to come."""
        return time.monotonic() - self._since

    def _latest(self) -> Verdict | None:
        try:
            if not self._store.check([self.key]):
                return None
            return Verdict.decode(self._store.get(self.key))
        except ForgedValueError:
            return None

    def _judging(self) -> bool:
        """Whether this seat judges now: the judge always; a deputy when the
        seats before it are gone (Note [judge once])."""
        if not self._before:
            return True
        latest = self._latest()
        if latest is not None and latest.by == self._member:
            return True
        # no verdict yet: as old as this seat
        age = self._clock() - latest.at if latest is not None else time.monotonic() - self._since
        if age <= 2 * self._beat_s:
            return False  # judged a moment ago
        if age > self._stale_after_s + len(self._before) * self._beat_s:
            return True  # the seats before went silent
        return len(self._sweep(self._before)) == len(self._before)  # late: their processes may have ended

    def _run(self) -> None:
        while not self._stop.wait(self._beat_s):
            try:
                if not self._judging():
                    continue
                verdict = Verdict(self._clock(), self._member, self._sweep(None))
                self._store.set(self.key, verdict.encode())
                if verdict.dead:
                    self._abort(verdict)
            except Exception as e:  # noqa: BLE001 - the store is gone: the job is ending
                logger.debug("elastic: the judge %s stops: %s", self._member, e)
                return

    def _abort(self, verdict: Verdict) -> None:
        """Propose ``abort`` for the step this member works on: the members that
        wait on its decision learn of the death when it is written."""
        new = {m: why for m, why in verdict.dead.items() if m not in self._said}
        if new:
            self._store.set(self._news, "dead")  # Note [news of a generation] in news.py
            self._said.update(new)
            logger.warning("elastic: %s (judged by %s)", ", ".join(f"member {m} {why}" for m, why in new.items()),
                           self._member)
        self._abort_step()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            join_before_exit(self._thread, 5.0)  # Note [a store call in flight at exit]
