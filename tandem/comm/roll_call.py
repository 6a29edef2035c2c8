"""Who has arrived at a point of an elastic world change, read by a few and
told to all: :class:`RollCall`.

# Note [a roll call]
A world change has two barriers in the store: the members of the generation
that ends arrive to agree on the next one (``Membership.next_generation``), and
the members of the next one arrive to build its group (Note [arrivals] in
membership.py). Each member used to look for every other member's key until
all were there or seen dead: N checks a poll by N members, which at thousands
of ranks is millions of operations a second. So:

* a member arrives with one ``add`` to a counter and one ``set`` of its id under
  the number it drew (``<base>/count``, ``<base>/at/<n>``);
* the few members that judge (the judging ranks: Note [judge once] in judge.py)
  read the arrivals new since their last look, in one ``multi_get``, and judge
  only the missing ones; the one that finds the roll complete, or a missing
  member dead, writes the outcome under one key (``compare_set``: the first
  stands);
* every other member waits on that key, which the store answers when it is
  written; one that has waited longer than the judges' window reads the roll
  itself (the judges are gone), once a wait slice, not often: every member may
  be doing the same.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from tandem.comm.job_secret import ForgedValueError

__all__ = ["RollCall"]


class RollCall:
    """The arrivals under ``base`` in the job's ``store``, in the order they came."""

    def __init__(self, store: dist.Store, base: str) -> None:
        self._store = store
        self._base = base
        self.outcome_key = f"{base}/outcome"
        self._seen: list[str] = []

    def arrive(self, member: str) -> int:
        """Put ``member`` on the roll; returns how many have arrived with it."""
        number = self._store.add(f"{self._base}/count", 1)
        self._store.set(f"{self._base}/at/{number}", member)
        return number

    def arrived(self) -> list[str]:
        """Every member that has arrived (and whose arrival can be read), in order."""
        count = self._store.add(f"{self._base}/count", 0)
        keys = [f"{self._base}/at/{n}" for n in range(len(self._seen) + 1, count + 1)]
        while keys and not self._store.check(keys):
            keys.pop()  # the last arrivals drew their number and have not written their id yet
        if keys:
            try:
                self._seen.extend(v.decode(errors="replace") for v in self._store.multi_get(keys))
            except ForgedValueError:  # a stranger's junk under one: read each (Note [a stranger asks to join])
                for key in keys:
                    try:
                        self._seen.append(self._store.get(key).decode(errors="replace"))
                    except ForgedValueError:
                        self._seen.append("")
        return list(self._seen)

    def outcome(self, timeout_s: float) -> str | None:
        """The outcome, once one is written within ``timeout_s``; None until then."""
        try:
            self._store.wait([self.outcome_key], datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            if "timeout" not in str(e).lower():
                raise
            return None
        return self._store.get(self.outcome_key).decode()

    def decide(self, outcome: str) -> str:
        """Write ``outcome`` unless one stands; returns the one that stands."""
        return self._store.compare_set(self.outcome_key, "", outcome).decode()
