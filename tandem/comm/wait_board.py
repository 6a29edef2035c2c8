"""Where each rank waits, posted in the job's store, so that ranks waiting on
each other in different operations are named instead of waiting out the timeout.

# Note [mismatched waits]
A rank in ``tandem.recv`` from rank 0 while rank 0 is in an ``all_reduce``
(or two ranks each receiving from the other) waits forever: both are alive
and beating, so no peer is lost (Note [dead peers] in peers.py), and the wait
ends only at the group's timeout with gloo's words, not the cause. So a
watched wait that outlasts its first slice posts what it waits in
(:class:`WaitNote`: the operation, the ranks it needs, since when) under
``tandem/waiting/<rank>``, and clears it when the wait ends; waits that end
within one slice, nearly all of them, touch the store not at all.

Once a wait is older than :data:`MISMATCH_AFTER_S`, each slice reads the
notes of the ranks it needs. A receive of a message's header needs its
sender to send; a sender that has itself been waiting that long in a
collective or a receive that needs this rank cannot: the two wait on each
other. Both see it (each reads the other's note) and raise
:class:`MismatchError`, naming every rank's operation. Only a wait for a
header counts: once a header arrived the sender is committed, and the spec
and data follow whatever else it does; and a send, or a slow collective that
every rank is in, is progress, not a mismatch. A pair is judged on two
consecutive readings that agree, so a note read in the instant between a
wait's end and its clearing cannot make one. A rank that raises leaves its
note posted, so that the other, which may read one slice later, names the
same mismatch; its next wait replaces the note.

The other may not get that slice: once the first has raised, its process may
end and close its connections, and the other's wait fails at once instead of
slicing on (on a loaded host, where the two judge seconds apart). A failed
wait therefore reads the board once before it looks for a lost peer
(:meth:`WaitBoard.left_waiting`): a peer whose note still says it waited on
this rank, long enough to be judged, left from the mismatch, and is named as
such instead of as a death 20 s later.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["MISMATCH_AFTER_S", "MismatchError", "WaitBoard", "WaitNote"]

MISMATCH_AFTER_S = 5.0
"""How long two ranks must have waited on each other before it is called a mismatch."""


@dataclass(frozen=True)
class WaitNote:
    """What one rank waits in, as posted on the board."""

    what: str                # "tandem.recv of the header of a message from rank 0", "#5 all_reduce ..."
    needs: tuple[int, ...]   # the ranks whose action would end the wait
    since: float             # wall clock (time.time()) when the wait began
    header: bool = False     # a receive of a message's header (the only wait judged)

    def waited(self, now: float) -> float:
        return now - self.since


class MismatchError(RuntimeError):
    """Ranks wait on each other in operations that cannot match (Note [mismatched waits]).

    Attributes:
        rank: this rank.
        waits: every rank of the mismatch and what it waits in.
    """

    def __init__(self, rank: int, waits: dict[int, WaitNote]) -> None:
        self.rank = rank
        self.waits = dict(waits)
        now = time.time()
        who = "; ".join(f"rank {r} waits in {n.what} (for {n.waited(now):.1f} s)" for r, n in sorted(waits.items()))
        super().__init__(
            f"rank {rank}: mismatched calls: {who}. Neither can go on: a tandem.recv needs a tandem.send "
            "from its peer, and every rank must issue the same collectives in the same order. Find where "
            "these ranks' code took different paths (a rank-dependent branch, an early return, a receive "
            "posted on both sides)")


class WaitBoard:
    """This rank's note on the board, and the reading of its peers' notes.

    Args:
        store: the job's c10d store.
        rank: this process's global rank.
    """

    def __init__(self, store: Any, rank: int) -> None:
        self.store = store
        self.rank = rank
        self._last: dict[int, WaitNote] | None = None

    def post(self, note: WaitNote) -> None:
        self._last = None
        self.store.set(_key(self.rank), json.dumps(asdict(note)))

    def clear(self) -> None:
        self.store.set(_key(self.rank), "")

    def mismatch(self, mine: WaitNote) -> dict[int, WaitNote]:
        """The ranks (this one included) that wait on each other with ``mine``,
        seen in two consecutive calls; empty while there is none."""
        now = time.time()
        if mine.waited(now) < MISMATCH_AFTER_S:
            return {}
        found: dict[int, WaitNote] = {}
        for peer, note in self._read(mine.needs).items():
            if (note.waited(now) >= MISMATCH_AFTER_S and self.rank in note.needs
                    and (mine.header or note.header)):
                found[peer] = note
        if not found:
            self._last = None
            return {}
        agreed = found == self._last
        self._last = found
        return {self.rank: mine, **found} if agreed else {}

    def left_waiting(self, mine: WaitNote) -> dict[int, WaitNote]:
        """After this rank's wait ``mine`` failed: the mismatch its peers judged
        and left (this rank included), read once; empty when there is none."""
        now = time.time()
        found = {peer: note for peer, note in self._read(mine.needs).items()
                 if note.waited(now) >= MISMATCH_AFTER_S and self.rank in note.needs
                 and (mine.header or note.header)}
        return {self.rank: mine, **found} if found else {}

    def _read(self, ranks: tuple[int, ...]) -> dict[int, WaitNote]:
        notes: dict[int, WaitNote] = {}
        for r in ranks:
            if r == self.rank or not self.store.check([_key(r)]):
                continue
            raw = self.store.get(_key(r)).decode()
            if raw:
                fields = json.loads(raw)
                notes[r] = WaitNote(fields["what"], tuple(fields["needs"]), fields["since"], fields["header"])
        return notes


def _key(rank: int) -> str:
    return f"tandem/waiting/{rank}"
