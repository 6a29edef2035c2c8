"""A rank that can no longer reach the job's store stops, saying so: :class:`CutOffWatch`.

# Note [cut off]
The job's store is where the ranks agree (Note [elastic membership] in
tandem/control/membership.py) and where each shows it is alive (Note [dead peers] in
peers.py). A rank whose beats stop landing there is dead to the others: they
judge it gone after the liveness window and go on without it (an elastic job)
or stop (any other job). The rank itself knows nothing of that while its link
is cut or the store's host is lost: its collectives and store calls just stall,
up to the group's timeout (30 minutes), and when a cut link comes back it
would wake up among peers that have moved on. So each rank watches its own
beats, from a thread that touches no store: when none has landed for
:func:`cut_off_after` seconds (twice the window the others judge by, and at
least :data:`MIN_CUT_OFF_S`), the rank writes why to its stderr and exits at
once with :data:`CUT_OFF_EXITCODE`; ``tandem run`` names that exit and does
not start a replacement for it (a replacement could not reach the store
either). The side of a partition that holds the store goes on; the other
stops within the window: with one store there is one place to agree, so there
is never a second group training the same run. A stalled thread cannot be
ended any other way: the call that waits is in C++, and the state it guards
is stale once the others have gone on.

A beat counts once the store has answered for it (a ``set`` is sent without
an answer; the ``check`` after it waits for one). The beats go through a
client of their own (``Store.clone``), so a store call
of the main thread that waits for a key (gloo's address exchange in a
``new_group``, a late peer) neither delays them nor can be mistaken for a cut
link. Only a TCP store is watched: a file store has no link to cut, and a
torch without ``Store.clone`` (before 2.7) beats through the shared client,
unwatched.

When the store's host is gone (not a cut link: its end of the connection is
closed, "Broken pipe"), the rank need not wait out the silence: a beat that
fails so stops it at once (:func:`connection_closed`), and so does an
uncaught exception caused by such a call (the exit hook, Note [exit on an
uncaught exception] in exit.py). Either way the rank says why in one line, in
place of the traceback, and asks nothing more of the store: each call to a
closed connection would print torch's warning with a C++ backtrace.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

__all__ = ["CUT_OFF_EXITCODE", "CutOffWatch", "MIN_CUT_OFF_S", "connection_closed", "cut_off_after",
           "lost_store_message"]

CUT_OFF_EXITCODE = 75
"""A rank's exit status when it was cut off from the job's store (EX_TEMPFAIL)."""
MIN_CUT_OFF_S = 4.0
"""The shortest silence that stops a rank, whatever its window: a store slow for
a moment on a loaded host must not end a rank."""


def cut_off_after(stale_after_s: float) -> float:
    """How long without a landed beat stops a rank whose peers judge by ``stale_after_s``."""
    return max(2 * stale_after_s, MIN_CUT_OFF_S)


def _network_error(error: BaseException) -> BaseException | None:
    """The store's network error behind ``error`` (itself, or in its chain of
    causes); None when there is none."""
    network = getattr(dist, "DistNetworkError", None)
    seen: BaseException | None = error
    while seen is not None:
        if network is not None and isinstance(seen, network):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def connection_closed(error: BaseException) -> bool:
    """``error`` says the store's end of the connection is gone (its host died
    or closed it: "Broken pipe", "Connection reset", "got 0 bytes"), not that
    an answer is late. A client's connection is never made again, so every
    later call on it fails the same way."""
    seen = _network_error(error)
    return seen is not None and "timeout" not in str(seen).lower() and "timed out" not in str(seen).lower()


def lost_store_message(rank: int, where: str, error: BaseException) -> str | None:
    """The line to print when ``error`` (uncaught) says the job's store at
    ``where`` is out of reach; None when it says something else."""
    seen = _network_error(error)
    if seen is None:
        return None
    first = str(seen).strip().splitlines()[0] if str(seen).strip() else type(seen).__name__
    return (f"tandem: rank {rank} is cut off from the job's store at {where}: a call to it failed "
            f"({type(seen).__name__}: {first[:200]}). Its host is gone or the link to it is cut; the "
            "ranks that still reach the store have gone on without this one (an elastic job) or "
            f"stopped. It stops here with exit status {CUT_OFF_EXITCODE}. If the store's host is "
            "lost, start the job again: it resumes from its last checkpoint.\n")


class CutOffWatch:
    """Stops this process when its beats have not landed for too long.

    Args:
        rank: this process's global rank, for the message.
        where: the store's address, for the message.
        landed: monotonic time of the last beat that landed.
        after_s: how long without one stops the process (read at each check,
            so a caller may change the window).
        exit: ends the process (a test passes its own).
    """

    def __init__(self, *, rank: int, where: str, landed: Callable[[], float], after_s: Callable[[], float],
                 exit: Callable[[int], None] = os._exit) -> None:
        self.rank = rank
        self.where = where
        self._landed = landed
        self._after_s = after_s
        self._exit = exit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ending = threading.Lock()   # held by the one thread that says why this process ends

    def claim(self) -> bool:
        """Take the saying of why this process ends (once per process: a rank
        that lost its store says so in one line, not from every thread that
        finds out); False when another thread has it."""
        return self._ending.acquire(blocking=False)

    def stop_now(self, error: BaseException) -> None:
        """The store's connection is gone (:func:`connection_closed`): say so and
        end the process now rather than after the silence of :meth:`check`."""
        message = lost_store_message(self.rank, self.where, error)
        if message is None or not self.claim():
            return
        try:
            os.write(2, message.encode())
        finally:
            self._exit(CUT_OFF_EXITCODE)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tandem-cut-off-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None

    def check(self) -> bool:
        """Stop the process if it is cut off; False while it is not."""
        silent = time.monotonic() - self._landed()
        limit = self._after_s()
        if silent <= limit:
            return False
        if not self.claim():
            return True   # another thread is ending the process, saying why
        message = (
            f"tandem: rank {self.rank} is cut off from the job's store at {self.where}: no heartbeat has "
            f"reached it for {silent:.1f} s (the limit is {limit:g} s, twice the window in which the other "
            "ranks count a silent rank as gone). Its link is cut or the store's host is lost; the ranks "
            "that still reach the store have gone on without this one (an elastic job) or stopped. It "
            f"stops here with exit status {CUT_OFF_EXITCODE} rather than train apart from them. When the "
            "link is back, start this node's `tandem run` again: under --elastic its workers rejoin the "
            "running job with its live state.\n")
        try:
            os.write(2, message.encode())
        finally:
            self._exit(CUT_OFF_EXITCODE)
        return True

    def _run(self) -> None:
        while not self._stop.wait(min(0.25, self._after_s() / 8)):
            if self.check():
                return
