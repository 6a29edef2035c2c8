"""A barrier in the job's store that thousands of members can pass:
:class:`RollCall` (Note [a roll call]), and :func:`waited`, a wait on keys
that ends after a timeout without raising."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from tandem.store.job_secret import ForgedValueError

__all__ = ["RollCall", "waited"]


# Note [a roll call]
# A world change has two barriers in the store: the members of the generation
# that ends arrive to agree on the next one (``Membership.next_generation``), and
# the members of the next one arrive to build its group (Note [arrivals] in
# elastic_group.py). If each member looked for every other member's key until all
# were there or seen dead, that would be N checks a poll by N members: at
# thousands of ranks, millions of operations a second. So:
#
# - a member arrives with one ``add`` to a counter and one ``set`` of its id under
#   the number it drew (``<base>/count``, ``<base>/at/<n>``);
# - the few members that judge (the judging ranks: Note [judge once] in judge.py)
#   read the arrivals new since their last look, in one ``multi_get``, and judge
#   only the missing ones; the one that finds the roll complete, or a missing
#   member dead, writes the outcome under one key (``compare_set``: the first
#   stands);
# - the member whose ``add`` completes the roll (its count is the number of
#   members called) writes the outcome itself, at once: the judges would
#   see the roll complete only at their next read, a poll later, and each
#   world change would wait that long;
# - every other member waits on that key, which the store answers when it is
#   written; one that has waited longer than the judges' window reads the roll
#   itself when the judges are dead, or after three windows whatever they are,
#   once a wait slice, not often: every member may be doing the same (a judge
#   that is late because the store answers slowly is not helped by a thousand
#   members reading every arrival).


def waited(store: dist.Store, keys: list[str], timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``keys``: True once they are all set, False when the time is up."""
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        if "timeout" not in str(e).lower():
            raise
        return False
    return True


class RollCall:
    """The arrivals under ``base`` in the job's ``store`` (Note [a roll call])."""

    def __init__(self, store: dist.Store, base: str) -> None:
        self._store = store
        self._base = base
        self.outcome_key = f"{base}/outcome"
        self.count_key = f"{base}/count"  # how many have arrived (one add each)
        self._seen: list[str] = []
        self._next = 1  # the first number not looked at yet
        self._unwritten: list[int] = []  # numbers drawn whose id was not there yet

    def arrive(self, member: str) -> int:
        """Put ``member`` on the roll; returns how many have arrived with it."""
        number = self._store.add(self.count_key, 1)
        self._store.set(self._at(number), member)
        return number

    def arrived(self) -> list[str]:
        """Every member that has arrived and whose id can be read. A number drawn
        whose id is not written yet (its member is about to write it, or died
        between the two calls) is looked at again next time, and hides no other."""
        count = self._store.add(self.count_key, 0)
        numbers = [*self._unwritten, *range(self._next, count + 1)]
        self._next = count + 1
        keys = [self._at(n) for n in numbers]
        if keys and self._store.check(keys):
            self._unwritten = []
            self._seen.extend(self._read(keys))
        else:
            self._unwritten = [n for n, key in zip(numbers, keys) if not self._store.check([key])]
            self._seen.extend(self._read([self._at(n) for n in numbers if n not in self._unwritten]))
        return list(self._seen)

    def _at(self, number: int) -> str:
        return f"{self._base}/at/{number}"

    def _read(self, keys: list[str]) -> list[str]:
        if not keys:
            return []
        try:
            return [v.decode(errors="replace") for v in self._store.multi_get(keys)]
        except ForgedValueError:  # junk under one: read each (Note [a stranger asks to join] in join_requests.py)
            out = []
            for key in keys:
                try:
                    out.append(self._store.get(key).decode(errors="replace"))
                except ForgedValueError:
                    out.append("")
            return out

    def outcome(self, timeout_s: float) -> str | None:
        """The outcome, once one is written within ``timeout_s``; None until then."""
        if not waited(self._store, [self.outcome_key], timeout_s):
            return None
        return self._store.get(self.outcome_key).decode()

    def outcome_now(self) -> str | None:
        """The outcome if one is written, without waiting."""
        if not self._store.check([self.outcome_key]):
            return None
        return self._store.get(self.outcome_key).decode()

    def decide(self, outcome: str) -> str:
        """Write ``outcome`` unless one stands; returns the one that stands."""
        return self._store.compare_set(self.outcome_key, "", outcome).decode()
