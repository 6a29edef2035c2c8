"""Stopping a daemon thread that calls the job's store: :func:`join_before_exit`.

# Note [a store call in flight at exit]
tandem's daemon threads (the monitor's heartbeat, an elastic member's beat, its
judge) call the store with the GIL released and wait for its answer. Their
``stop`` joins the thread for a few seconds; on a loaded host, or with a slow
store, the answer can come later than that. Were the script to end meanwhile,
the call would come back from torch while the interpreter finalizes, CPython
would end the thread with ``pthread_exit`` inside torch's C++ frames, and the
process would abort with SIGABRT, "terminate called without an active
exception", after its work was done (Note [exit on an uncaught exception] in
exit.py). So a thread still running after its ``stop`` gave up on it is joined
once more at exit, before the interpreter finalizes, for at most
:data:`EXIT_JOIN_S` for all of them together (a process that changed worlds
many times with a store out of reach does not wait that long for each). A
call to a store that is gone fails at once, and one to a live store returns
when the store answers. A script that goes on after ``tandem.shutdown()``
does not wait.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time

__all__ = ["EXIT_JOIN_S", "join_before_exit"]

logger = logging.getLogger(__name__)

EXIT_JOIN_S = 30.0
"""How long the interpreter waits at exit, in all, for the threads that their ``stop`` gave up on."""

_left: list[threading.Thread] = []   # given up on by their stop and still running when last looked at


def join_before_exit(thread: threading.Thread, timeout_s: float) -> None:
    """Join ``thread`` for ``timeout_s``; if it is still running, join it again
    at exit, before the interpreter finalizes (Note [a store call in flight at exit])."""
    thread.join(timeout=timeout_s)
    if thread.is_alive():
        if not _left:
            atexit.register(_join_at_exit)
        _left[:] = [t for t in _left if t.is_alive() and t is not thread] + [thread]


def _join_at_exit() -> None:
    deadline = time.monotonic() + EXIT_JOIN_S
    for thread in _left:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    waiting = [t.name for t in _left if t.is_alive()]
    _left.clear()
    if waiting:
        logger.warning("tandem: %s still wait(s) for the job's store after %g s at exit; the process exits "
                       "without the answer", ", ".join(waiting), EXIT_JOIN_S)
