"""The asks to join an elastic job, as its members read them, and the refusal
of a stranger's: :class:`JoinRequests`.

# Note [a stranger asks to join]
Under a job secret the membership's keys have secret names (Note [signed
store] in tandem/store/job_secret.py), so a process without the secret that asks to join
writes under the plain names (``joiners``, ``join/j<n>``), where no member
looks for a request; one with another secret, under names no member reads. So
a replacement under a secret also asks under the plain names, with its
secret's mark (:func:`~tandem.store.job_secret.secret_mark`: it tells nothing
of the secret) as the request. The member that decides a step also reads the
plain ``joiners`` counter (one store call a step), and for each new ask that
is not marked with the job's own secret (whose replacement asks under the
secret names too, and is admitted there) logs a warning (on stderr too; the
first member to see it, by a counter) and sets the plain ``refused/j<n>`` to
why: no secret, or another secret. The process that asked learns at once that
it was refused and why ("this job's secret differs from yours"), instead of
waiting out its timeout. It is never admitted, and nothing it wrote is read.

The plain names are anyone's to write, and a stranger who lists the store's
keys can overwrite the secret names too (with junk: it cannot sign). A beat
read as junk is skipped and the member's last good beat stands (never a
member's crash; a member whose beats are all junk is dead once its last good
one is stale), a refused value is logged once a key, and what is read under
the plain names costs the members little whatever it holds: the counter is read, not added to (an
``add`` to a value that is no number closes the connection of the one who
adds), a value that is no number is skipped with one warning, and a counter
that jumps by more than ``_ASKS_AT_ONCE`` is taken as junk: its asks are
skipped, with one line that says how many.
"""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist

from tandem.control.generation import PREFIX
from tandem.store.job_secret import SECRET_ENV, SECRET_FILE_ENV, SignedStore

__all__ = ["JoinRequests"]

logger = logging.getLogger(__name__)

_REFUSED = "no job secret"
_ANOTHER_SECRET = "another secret"
_ASKS_AT_ONCE = 64  # Note [a stranger asks to join]


class JoinRequests:
    """The counter of asks to join in the job's ``store``, read against junk, and
    the refusals of the asks made without the job's secret, said by ``member``
    (Note [a stranger asks to join])."""

    def __init__(self, store: dist.Store, member: str) -> None:
        self._store = store
        self._member = member
        self._strangers_seen = 0  # asks to join without the secret, refused
        self._junk_said = False   # the plain counter held junk, and this member said so (once)
        self._joiners_seen = 0  # the counter of asks to join, as last read well
        self._plain_ask: int | None = None  # a replacement's number under the plain names

    def count(self) -> int:
        """How many replacements asked to join; under a job secret, the strangers'
        asks are refused first (Note [a stranger asks to join])."""
        store = self._store
        if isinstance(store, SignedStore):
            self._refuse_strangers(store)
        raw, key = (store.inner, store.name(f"{PREFIX}/joiners")) if isinstance(store, SignedStore) else \
            (store, f"{PREFIX}/joiners")
        self._joiners_seen = self._count(raw, key, self._joiners_seen, "the counter of asks to join")
        return self._joiners_seen

    def _refuse_strangers(self, store: SignedStore) -> None:
        """Tell each process that asked to join without the job secret that it is
        refused, and log it (Note [a stranger asks to join])."""
        plain = store.inner
        count = self._plain_count(plain, store.where)
        if count - self._strangers_seen > _ASKS_AT_ONCE:
            if not self._junk_said:  # once: a stranger may write it every step
                self._junk_said = True
                self._say(f"elastic: the plain counter of asks to join jumped from {self._strangers_seen} to "
                          f"{count} (in {store.where}): not asks, junk written by a process without this job's "
                          "secret; skipped, and any more such junk silently; the members go on")
            self._strangers_seen = count
        for number in range(self._strangers_seen + 1, count + 1):
            key = f"{PREFIX}/join/j{number}"
            if not plain.check([key]):
                if count - number < 8:  # its request may be on its way: look again at the next step
                    count = number - 1
                    break
                continue  # a number added and nothing asked: no one to tell
            mark = plain.get(key).decode(errors="replace")
            if mark == store.mark:
                continue  # a replacement with this job's secret: it asks under the secret names too
            won = plain.compare_set(f"{PREFIX}/refusals/j{number}", "", self._member)
            if won != self._member.encode():
                continue  # another member refused it already (or a stranger wrote there)
            another = len(mark) == len(store.mark) and mark != "waiting"
            self._say(f"elastic: refused a process that asked to join as j{number} "
                      f"{'with another secret than this job' if another else 'without this job'}'s secret "
                      f"(in {store.where}); the members go on")
            plain.set(f"{PREFIX}/refused/j{number}", _ANOTHER_SECRET if another else _REFUSED)
        self._strangers_seen = max(self._strangers_seen, count)

    def _plain_count(self, plain: dist.Store, where: str) -> int:
        """The plain ``joiners`` counter (Note [a stranger asks to join])."""
        return self._count(plain, f"{PREFIX}/joiners", self._strangers_seen,
                           f"the plain counter of asks to join (in {where})")

    def _count(self, raw: dist.Store, key: str, last: int, what: str) -> int:
        """The counter under ``key``, read, not added to (an add to a value that
        is no number, a stranger's junk, would close this member's connection);
        ``last`` when it is missing or junk, which is said once a member."""
        if not raw.check([key]):
            return last
        text = raw.get(key).decode(errors="replace")
        try:
            return int(text)
        except ValueError:
            if not self._junk_said:
                self._junk_said = True
                self._say(f"elastic: {what} holds {text[:40]!r}, not a number: junk written by a process outside "
                          "the job; skipped, and any more such junk silently; the members go on")
            return last

    def _say(self, line: str) -> None:
        logger.warning("%s", line)
        # Worth seeing without logging set up: on stderr, as the launcher shows it.
        print(f"tandem: member {self._member}: {line}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ a replacement's side
    def ask_plainly(self) -> None:
        """A replacement's ask under the plain names too, with its secret's mark,
        where the store is signed (a replacement with no secret asks there anyway)."""
        store = self._store
        if isinstance(store, SignedStore):
            self._plain_ask = store.inner.add(f"{PREFIX}/joiners", 1)
            store.inner.set(f"{PREFIX}/join/j{self._plain_ask}", store.mark)

    def refusal(self) -> str | None:
        """Why the members refused this replacement's ask, once one of them did; None until then."""
        store = self._store
        if not isinstance(store, SignedStore) and store.check([f"{PREFIX}/refused/{self._member}"]):
            return (f"the job has a job secret and this process has none; start it with the job's {SECRET_ENV} "
                    f"or {SECRET_FILE_ENV} (docs: Who can join a job)")
        if (self._plain_ask is not None and isinstance(store, SignedStore)
                and store.inner.check([f"{PREFIX}/refused/j{self._plain_ask}"])):
            return (f"this job's secret differs from yours; start every process of the job with the same "
                    f"{SECRET_ENV} or {SECRET_FILE_ENV} (made once with `tandem secret`, shared by a file each "
                    "node can read; docs: Who can join a job)")
        return None
