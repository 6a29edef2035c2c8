"""One member judges who is dead, for every member: :class:`Judge`, :class:`Verdict`.

# Note [judge once]
A step's decision waits in slices (Note [elastic membership] in
membership.py), and between slices a member looked at every other member's
beat and process: two or three store operations per member, by every member,
so N members waiting on a late decision put about 8N² operations a second on
the store, which one core stops serving near N = 63 (BENCHMARKS.md "Past this
machine"). So one member judges for all:

* the generation's first member (its rank 0) is the judge. Once a beat it reads
  every member's beat in one ``multi_get`` (a ``check`` first: the keys exist),
  asks the process of a member whose beat is two beats old whether it has
  ended (its kernel, or its launcher's exit notice: Note [deaths seen at once]
  in process_id.py), and posts the verdict, with the time it was made, under
  one key of the generation: ``gen/<g>/verdict``;
* a member waiting on a decision reads that one key a slice (one operation),
  and proposes ``abort`` when the verdict names another member dead;
* the judge is not a single point: ranks 1 and 2 are its deputies. A deputy
  judges while the verdict is older than ``stale_after_s`` plus a beat for
  each place it stands behind the judge (so it takes over when the judge is
  gone, and the judge's death is in its verdict); a member that sees no
  verdict newer than ``stale_after_s`` plus :data:`DEPUTIES` beats judges for
  itself, as before, until one comes.

The store's load per beat becomes a few operations for the judge and one per
waiting member: linear in members, not quadratic. A death is in the verdict
at the judge's next beat after its process's end is known (its launcher's
notice) or after its beat is ``stale_after_s`` old, and every waiting member
reads it within a slice.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from tandem.comm.job_secret import ForgedValueError

__all__ = ["DEPUTIES", "Judge", "Verdict"]

logger = logging.getLogger(__name__)

DEPUTIES = 3
"""The judge and its deputies: the generation's first members, in rank order."""


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
        """The verdict in ``raw``; None for what is no verdict (junk: Note [a stranger asks to join])."""
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
        member: this member's id.
        seat: its rank in the generation: 0 judges, 1..DEPUTIES-1 are deputies,
            the others only read.
        beat_s: how often the judge judges.
        stale_after_s: how old a verdict may be before a deputy takes over.
        clock: wall-clock time in seconds.
        sweep: the judgement itself: every other member found dead, with why.
    """

    def __init__(self, store: dist.Store, key: str, member: str, seat: int, *, beat_s: float,
                 stale_after_s: float, clock: Callable[[], float], sweep: Callable[[], dict[str, str]]) -> None:
        self._store = store
        self.key = key
        self._member = member
        self._seat = seat
        self._beat_s = beat_s
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._sweep = sweep
        self._since = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if seat < DEPUTIES:
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

    def waited_long(self) -> bool:
        """Long enough since this seat was taken for a verdict to have come."""
        return time.monotonic() - self._since > self._stale_after_s

    def _latest(self) -> Verdict | None:
        try:
            if not self._store.check([self.key]):
                return None
            return Verdict.decode(self._store.get(self.key))
        except ForgedValueError:
            return None

    def _run(self) -> None:
        while not self._stop.wait(self._beat_s):
            try:
                if self._seat > 0:
                    latest = self._latest()
                    if latest is not None and latest.by != self._member and \
                            self._clock() - latest.at <= self._stale_after_s + self._seat * self._beat_s:
                        continue  # the judge (or a deputy before this one) is judging
                verdict = Verdict(self._clock(), self._member, self._sweep())
                self._store.set(self.key, verdict.encode())
            except Exception as e:  # noqa: BLE001 - the store is gone: the job is ending
                logger.debug("elastic: the judge %s stops: %s", self._member, e)
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
