"""Which peer is gone: heartbeats in the job's store, and waits that watch them.

# Note [a peer gone to regroup]
In an elastic job a peer can leave a collective alive: it saw another member
die and went to regroup (Note [elastic membership] in tandem/control/membership.py), so what
this rank waits for from it never comes. Its heartbeat goes on, so the watch
below would wait for gloo's timeout (a ZeRO-2 rank whose parameter all-gather
completed before a death commits its step alone, then waits in the buddy
copies' receive from a peer that waits for it in the regroup). So the
membership tells the watch which peers have asked for the next generation
(``PeerWatch.departed``), and a peer seen so for :data:`LEFT_GRACE_S` counts
as gone, for this wait: a message it sent before it left arrives within it.
The rank then regroups too.

# Note [a departure names the dead]
The peers that leave first are the ones a death failed at once: gloo closed
their connection to the dead rank, and its launcher's notice named it. A
rank that the death failed no connection of waits on (its ring neighbours
did) until its slice ends, and then read the verdict, which names the death
only at the judge's next beat: in a soak, one member of four saw a kill
0.5 s after the others, and they waited for it in their regroup. So a member
that leaves names the deaths it saw (what its watch found: a process ended,
a beat gone silent), and a watch that finds a peer departed reads them
(:class:`Departures`): a named death among the ranks it waits on is a loss
at once, as the verdict's is, with no slice's grace (a dead rank sends
nothing more). Who left is read only once one has (Note [a watch reads the
verdict]); what they named, in one more read.

# Note [a quick look]
A death is seen by a waiting rank when its slice ends and it looks, so the
slice bounds how late the last member knows, and the others wait that long
for it in their regroup: slices of a beat (0.25 s) made every loss in a soak
0.25 s longer than the first member's notice. Where a look reads nothing
until something happened (an elastic job over a TCP store, whose news thread
waits on the store for it: Note [news of a generation] in
tandem/control/news.py), a slice costs no store operation, and is
:data:`QUICK_SLICE_S`; elsewhere (a file store, etcd) each look reads the
verdict and the roll call, and slices stay a beat long. A wait says where it
waits after the slices of :data:`_NOTE_AFTER_S` whatever their length (two
store operations, which a wait of a few quick slices, a straggler's, should
not cost).

# Note [dead peers]
When a rank dies inside a collective, gloo tells only the ranks connected to it
on that collective's step ("Connection closed by peer [127.0.0.1]:35735", an
address, not a rank); the others wait until their neighbours give up, or until
the collective timeout (10 minutes). tandem makes every survivor name the dead
rank within a few seconds:

- each rank's monitor thread beats: it bumps ``tandem/alive/<rank>`` in the
  job's c10d store every :data:`HEARTBEAT_INTERVAL_S`. The store is the
  launcher's (``tandem run``, torchrun) or the harness's file, so it outlives any
  worker; a rank that ends cleanly writes ``exited``;
- tandem waits for a gloo collective in slices of :data:`WAIT_SLICE_S`
  (``Work.wait(timeout)`` leaves the collective running when a slice ends).
  Between slices, and at once when gloo raises, it reads the peers' beats: a
  peer whose beat has not moved for :data:`STALE_AFTER_S` is gone, and the wait
  raises :class:`PeerLostError` naming it.

A peer with no beat at all is not evidence of a death while the collective is
still running: the monitor of a group that torch initialised starts at the
rank's first tandem call, so a peer still loading its data has not beaten yet
(a 2.8 s gap flaked CI before this rule). It counts as gone only once gloo has
failed the collective and the beat is still missing :data:`STALE_AFTER_S` later.

An elastic job may ask for a shorter window (``ElasticConfig.stale_after_s``
and ``beat_s`` below the defaults): its monitor then beats, and its waits
judge, by that :class:`Liveness` (Note [elastic membership] in tandem/control/membership.py).

Most deaths are seen before the window ends: a peer whose process has ended
on this kernel, or whose launcher posted its exit, is gone at once (Note
[deaths seen at once] in process_id.py).

In an elastic job the window is the job's, and a slice does not read every
peer: Note [a watch reads the verdict].

# Note [a watch reads the verdict]
A slice that read every peer's beat and process would cost each waiting rank
two store operations a peer: N ranks waiting in one collective (a straggler,
a long save) put about 2N² operations a slice on the store, which at a
thousand nodes no server answers. An elastic job judges its members once
already (Note [judge once] in tandem/control/judge.py): the generation's judge
posts a verdict every beat, from the node beats and the processes' ends. So
its membership gives the watch that verdict (``PeerWatch.judged``): a slice
reads one key, and the peers the verdict names dead are gone; and whether any
peer has left to regroup (Note [a peer gone to regroup]) is one more read,
which looks at each peer only once one has; over a TCP store not even those
two while nothing happened (Note [news of a generation] in
tandem/control/news.py). Where there is no verdict to read
(before the generation's first step, during a world change) or it is stale (its
judges are gone), and after gloo failed the collective (a rare event, which the
peers' own beats and processes name at once), the watch looks at every peer
itself, as above.

A peer that is alive but stuck (a hang, not a death) keeps beating: that is the
launcher watchdog's case (``tandem run --hang-timeout``). NCCL has its own
watchdog and blocking semantics, so NCCL waits are not sliced.

# Note [how a rank left]
A peer waiting on a rank that is gone says what happened to it from what is
known, never a guess worded as a fact. First the rank's own last beat
(:func:`last_beat`): it called tandem.shutdown(), or its script ended without
it, or it raised (only the rank knows that, and its exit hook knows which
exception: Note [exit on an uncaught exception] in exit.py), each worded by
:func:`departure` ("has left the job", "crashed: it raised an uncaught
ValueError"). Then its process's end as its kernel or its launcher saw it: an
exit code or a signal, where one of them can tell (Note [deaths seen at once]
in process_id.py). Last the silence of its beat. Only for those two does the
error add a guess at the cause (killed, out of memory, or crashed).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from tandem.store.job_secret import ForgedValueError
from tandem.comm.process_id import PostedProcesses, ProcessId
from tandem.comm.wait_board import MismatchError, WaitBoard, WaitNote

__all__ = ["DEFAULT_LIVENESS", "Departures", "HEARTBEAT_INTERVAL_S", "LEFT_TO_REGROUP", "Liveness", "PeerLostError",
           "PeerWatch", "QUICK_SLICE_S", "STALE_AFTER_S", "SliceEnded", "ThreadedWait", "WAIT_SLICE_S", "Waiter",
           "departure", "heartbeat_key", "last_beat", "drain_at_exit", "wait_watching_peers"]

HEARTBEAT_INTERVAL_S = 0.25
"""How often a rank's monitor thread beats."""
STALE_AFTER_S = 2.5
"""A beat unchanged for this long means the rank is gone (ten missed beats)."""
WAIT_SLICE_S = 0.5
"""How long one slice of a watched wait lasts before the peers are looked at."""
QUICK_SLICE_S = 0.05
"""A slice where a look reads nothing until something happened (Note [a quick look])."""
LEFT_GRACE_S = 0.25
"""How long a peer seen gone to regroup is still waited for: what it sent
before it left arrives within it (Note [a peer gone to regroup])."""
_NOTE_AFTER_S = 0.25
"""A wait longer than this says where it waits (Note [mismatched waits] in wait_board.py)."""
EXITED = "exited"
"""The first word of a rank's last beat; alone, it called tandem.shutdown()."""
_ENDED = "ended"
_RAISED = "raised "


def last_beat(*, raised: type[BaseException] | None = None, shut_down: bool = True) -> str:
    """The beat a rank leaves behind, which its peers word (Note [how a rank left]).

    Args:
        raised: its process is ending on this uncaught exception (the exit hook:
            Note [exit on an uncaught exception] in exit.py).
        shut_down: it called tandem.shutdown(); False: its process ended without.
    """
    if raised is not None:
        return f"{EXITED}: {_RAISED}{raised.__name__}"
    return EXITED if shut_down else f"{EXITED}: {_ENDED}"


LEFT = "has left the job"
"""How a peer words a rank that left the job (it reached tandem.shutdown() or the end of its script)."""
CRASHED = "crashed"
"""How a peer words a rank that raised an uncaught exception."""
LEFT_TO_REGROUP = "has left generation"
"""How a peer words a rank that left its generation alive, to regroup (Note [a peer gone to regroup])."""


@dataclasses.dataclass(frozen=True)
class Departures:
    """The peers that left this generation to regroup (``left``), and the deaths
    they named as they left (``named_dead``), by rank, with why (Note [a
    departure names the dead])."""

    left: dict[int, str] = dataclasses.field(default_factory=dict)
    named_dead: dict[int, str] = dataclasses.field(default_factory=dict)


def departure(value: str) -> str | None:
    """What a rank's last beat ``value`` says of its end, in words; None when
    ``value`` is an ordinary beat."""
    if value == EXITED:
        return f"{LEFT} (it called tandem.shutdown())"
    if not value.startswith(f"{EXITED}: "):
        return None
    how = value[len(EXITED) + 2:]
    if how.startswith(_RAISED):
        return f"{CRASHED}: it raised an uncaught {how[len(_RAISED):]} (its traceback is in its log)"
    return f"{LEFT}: its process ended without calling tandem.shutdown() (its script returned, or called sys.exit)"



@dataclasses.dataclass(frozen=True)
class Liveness:
    """How often every rank beats, and how long an unchanged beat means a rank is
    gone; the same on every rank of a group (a watcher judges its peers' beats)."""

    beat_s: float = HEARTBEAT_INTERVAL_S
    stale_after_s: float = STALE_AFTER_S
    slice_s: float = WAIT_SLICE_S
    """How long one slice of a watched wait lasts: a death that fails no
    connection of this rank (Note [deaths seen at once]) is seen within one."""

    def __post_init__(self) -> None:
        if not 0 < 4 * self.beat_s <= self.stale_after_s:
            raise ValueError(f"Liveness: stale_after_s={self.stale_after_s} must be at least four beats "
                             f"(beat_s={self.beat_s} > 0), or a slow beat reads as a death")


DEFAULT_LIVENESS = Liveness()
"""Every group's, unless an elastic job asks for a shorter window."""


def heartbeat_key(rank: int) -> str:
    return f"tandem/alive/{rank}"


def process_key(rank: int) -> str:
    return f"tandem/process/{rank}"


class PeerLostError(RuntimeError):
    """A peer died or left while this rank waited for it in a collective.

    Attributes:
        rank: this rank.
        lost: the peers that are gone (global rank to what was seen).
    """

    def __init__(self, rank: int, lost: dict[int, str], during: str) -> None:
        self.rank = rank
        self.lost = dict(lost)
        who = ", ".join(f"rank {r} {why}" for r, why in sorted(lost.items()))
        names = ", ".join(str(r) for r in sorted(lost))
        # Note [how a rank left]: a rank that said how it left needs no guess.
        said = all(why.startswith((LEFT, CRASHED)) for why in lost.values())
        guess = "" if said else " (killed, out of memory, or crashed)"
        super().__init__(
            f"rank {rank}: peer lost during {during}: {who}. The collective cannot complete; "
            f"the cause is in the log of rank {names}{guess}. "
            "Under `tandem run --max-restarts K` the group restarts and resumes from the "
            "last checkpoint")


class SliceEnded(RuntimeError):
    """A :class:`ThreadedWait` slice ended with the work still running: nothing failed."""


class PeerWatch:
    """Reads the peers' heartbeats and remembers when each last moved.

    Args:
        store: the job's c10d store.
        rank: this process's global rank (never reported as lost).
        liveness: the group's beat and staleness window.
        clock: monotonic seconds (a test injects its own).
    """

    def __init__(self, store: dist.Store, rank: int, liveness: Liveness = DEFAULT_LIVENESS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.rank = rank
        self.liveness = liveness
        self._clock = clock
        self._seen: dict[int, tuple[str | None, float]] = {}
        self._processes = PostedProcesses(store, process_key)  # Note [deaths seen at once]
        self.board = WaitBoard(store, rank)  # where each rank waits (Note [mismatched waits])
        # Note [a peer gone to regroup]: set in an elastic job, by its membership.
        self.departed: Callable[[Sequence[int]], Departures] | None = None
        # Note [a watch reads the verdict]: set in an elastic job, by its membership; None
        # from it when there is no fresh verdict.
        self.judged: Callable[[Sequence[int]], dict[int, str] | None] | None = None
        self._departed_at: dict[int, float] = {}

    def post_process(self) -> None:
        """Tell the peers which process this rank is (Note [deaths seen at once])."""
        process = ProcessId.this_process()
        if process is not None:
            self.store.set(process_key(self.rank), process.encode())

    def observe(self, ranks: Sequence[int], *, failed: bool = False) -> dict[int, str]:
        """Read the beats of ``ranks`` now; returns the ones that are gone, with why.

        Args:
            ranks: the peers to read.
            failed: the collective has already failed, so a peer that has never
                beaten counts as gone too (Note [dead peers]).

        Raises:
            RuntimeError: the store cannot be reached (its host is gone).
        """
        now = self._clock()
        if not failed and self.judged is not None:
            judged = self.judged(ranks)  # Note [a watch reads the verdict]: one read, not two a peer
            if judged is not None:
                return self._with_departed(judged, ranks, now)
        lost: dict[int, str] = {}
        for r, value in zip(ranks, self._read(ranks)):
            if r == self.rank:
                continue
            said = departure(value) if value is not None else None
            if said is not None:
                lost[r] = said
                continue
            try:
                ended = self._processes.ended(r)
            except Exception as e:  # noqa: BLE001 - any store failure means the same thing here
                raise self._store_gone(e) from e
            if ended is not None:
                lost[r] = f"has died: {ended}"
                continue
            previous = self._seen.get(r)
            if previous is None or previous[0] != value:
                self._seen[r] = (value, now)
            elif now - previous[1] >= self.liveness.stale_after_s and (value is not None or failed):
                lost[r] = (f"stopped beating {now - previous[1]:.1f} s ago" if value is not None
                           else f"has not beaten in {now - previous[1]:.1f} s")
        return self._with_departed(lost, ranks, now)

    def _with_departed(self, lost: dict[int, str], ranks: Sequence[int], now: float) -> dict[int, str]:
        """``lost``, the deaths that peers named as they left to regroup (Note [a
        departure names the dead]) and the peers of ``ranks`` that left at least
        a slice ago (Note [a peer gone to regroup])."""
        if self.departed is None:
            return lost
        departures = self.departed([r for r in ranks if r != self.rank and r not in lost])
        lost.update(departures.named_dead)  # of the ranks asked about: not this one, none lost yet
        for r, why in departures.left.items():
            since = self._departed_at.setdefault(r, now)
            if now - since >= LEFT_GRACE_S and r not in lost:
                lost[r] = why
        return lost

    def diagnose(self, ranks: Sequence[int], window_s: float | None = None) -> dict[int, str]:
        """Watch ``ranks`` for up to ``window_s`` (default: the staleness window
        and half a second); returns as soon as one is seen gone."""
        if window_s is None:
            window_s = self.liveness.stale_after_s + 0.5
        end = self._clock() + window_s
        while True:
            lost = self.observe(ranks, failed=True)
            if lost or self._clock() >= end:
                return lost
            time.sleep(min(self.liveness.beat_s, self.liveness.slice_s))

    def _read(self, ranks: Sequence[int]) -> list[str | None]:
        """Each rank's beat (None: it has none), in one read where every rank has one."""
        out: list[str | None] = []
        try:
            keys = [heartbeat_key(r) for r in ranks]
            if keys and self.store.check(keys):
                try:
                    return [v.decode() for v in self.store.multi_get(keys)]
                except ForgedValueError:
                    pass  # a stranger's junk under one: read each, below
            for r in ranks:
                key = heartbeat_key(r)
                try:
                    out.append(self.store.get(key).decode() if self.store.check([key]) else None)
                except ForgedValueError:  # a stranger's junk: the beat seen last stands (Note [a stranger asks
                    out.append(self._seen.get(r, (None, 0.0))[0])  # to join] in tandem/control/membership.py)
        except Exception as e:  # noqa: BLE001 - any store failure means the same thing here
            raise self._store_gone(e) from e
        return out

    def _store_gone(self, error: Exception) -> RuntimeError:
        return RuntimeError(
            f"rank {self.rank}: the job's store cannot be reached ({type(error).__name__}: {error}); "
            "its host (the launcher, or rank 0 without one) has probably died")


def wait_watching_peers(work: Any, watch: PeerWatch, ranks: Sequence[int],
                        during: Callable[[], str], *, header: bool = False) -> None:
    """``work.wait()`` for a gloo collective or send or receive, raising
    :class:`PeerLostError` within seconds when a peer in ``ranks`` dies (Note
    [dead peers]), and :class:`MismatchError` when it waits on this rank in
    another operation (Note [mismatched waits] in wait_board.py; ``header``:
    this is the receive of a message's header).

    Other failures of the collective are re-raised unchanged.
    """
    note: WaitNote | None = None
    started, slices = time.time(), 0
    before_note = max(1, round(_NOTE_AFTER_S / watch.liveness.slice_s))  # Note [a quick look]
    try:
        while True:
            try:
                work.wait(datetime.timedelta(seconds=watch.liveness.slice_s))
                return
            except RuntimeError as e:
                # A slice of a ThreadedWait says so by its type; a gloo collective's own
                # wait(timeout) only by its text (torch 2.4 to 2.13).
                sliced = isinstance(e, SliceEnded) or "Operation timed out" in str(e)
                waits = _left_waiting(watch, note) if not sliced and note is not None else {}
                if waits:
                    note = None  # stays posted, as below
                    raise MismatchError(watch.rank, waits) from e
                try:
                    lost = watch.observe(ranks) if sliced else watch.diagnose(ranks)
                except RuntimeError as store_error:
                    if sliced:
                        # Its cause (the store's error) stays: it tells the exit hook that this
                        # rank is cut off (Note [cut off] in cut_off.py); the slice is no news.
                        raise store_error  # noqa: B904
                    raise e from store_error
                if lost:
                    raise PeerLostError(watch.rank, lost, during()) from (None if sliced else e)
                if not sliced:
                    raise
            slices += 1
            if note is None:
                if slices >= before_note:  # a long wait: say where this rank waits
                    note = WaitNote(during(), tuple(r for r in ranks if r != watch.rank), started, header)
                    watch.board.post(note)
            else:
                waits = watch.board.mismatch(note)
                if waits:
                    note = None  # stays posted: the peers read it to name the mismatch too
                    raise MismatchError(watch.rank, waits)
    finally:
        if note is not None:
            try:
                watch.board.clear()
            except Exception:  # noqa: BLE001 - the store is gone: what is propagating says more
                pass


def _left_waiting(watch: PeerWatch, note: WaitNote) -> dict[int, WaitNote]:
    """The mismatch a peer judged this failed wait part of before it left (Note
    [mismatched waits] in wait_board.py); empty when none, or the store is gone."""
    try:
        return watch.board.left_waiting(note)
    except Exception:  # noqa: BLE001 - the store is gone: the peers' diagnosis says so
        return {}


class ThreadedWait:
    """A work whose own ``wait(timeout)`` cannot be sliced, waited on by a
    :class:`Waiter` thread so that a watched wait's slices still end.

    gloo's reduce-scatter (``reduce_scatter_single``/``reduce_scatter_tensor``,
    torch 2.4 to 2.13) blocks in ``wait(timeout)`` until it completes or fails,
    and its ``is_completed()`` stays False: a rank whose reduce-scatter waits on
    a live peer that has given up (the dead rank was the peer's neighbour, not
    this rank's) would wait for the group's timeout, not the seconds of Note
    [dead peers]. gloo's send and receive are worse: ``wait(timeout)`` that
    times out closes the connection, so a peer late by one slice was lost
    (Note [late peers] in p2p.py); their ``is_completed()`` stays False until
    waited on.
    """

    __slots__ = ("_work", "_done", "_error")

    def __init__(self, work: Any) -> None:
        self._work = work
        self._done = threading.Event()
        self._error: BaseException | None = None
        _IN_FLIGHT.add(self)  # until run() returns; made to be run at once, by a Waiter or a thread of its own

    def run(self) -> None:
        """Wait for the work (in the waiter thread)."""
        try:
            self._work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self._error = e
        self._done.set()
        _IN_FLIGHT.discard(self)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise SliceEnded("Operation timed out (tandem's threaded wait)")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def get_future(self) -> Any:
        return self._work.get_future()


_IN_FLIGHT: set[ThreadedWait] = set()  # the threaded waits of this process not returned yet
_DRAIN_S = 5.0


def drain_at_exit() -> None:
    """Have the interpreter, before it finalizes, let the threaded waits in
    flight now return, for :data:`_DRAIN_S` at most: their group's connections
    were just cut (Note [severing a forgotten group] in connections.py), so
    each fails in a moment; one that came back from torch while the interpreter
    finalizes would abort the process (SIGABRT), as a process whose script ends
    right after a world change could. Nothing waits while they return in time."""
    waits = list(_IN_FLIGHT)
    if waits:
        atexit.register(_drain, waits)


def _drain(waits: list[ThreadedWait]) -> None:
    deadline = time.monotonic() + _DRAIN_S
    for wait in waits:
        if not wait._done.wait(max(0.0, deadline - time.monotonic())):
            return


class Waiter:
    """One daemon thread that waits, in issue order, on the :class:`ThreadedWait`
    works of one process group (collectives of a group complete in that order).
    A thread per group, not per work: starting a thread costs about a
    millisecond on a loaded host. A work that never completes (a peer died)
    holds up only its own group's thread, which a new group does not use."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[ThreadedWait] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, work: Any) -> ThreadedWait:
        """Start waiting on ``work`` now; wait on what this returns."""
        threaded = ThreadedWait(work)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tandem-waiter", daemon=True)
            self._thread.start()
        self._queue.put(threaded)
        return threaded

    def _run(self) -> None:
        while True:
            self._queue.get().run()
