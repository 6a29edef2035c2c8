"""How a process of the job ends when its script raises: :func:`install_clean_exit`.

# Note [exit on an uncaught exception]
A script that raises with a collective in flight (a bucket's all-reduce
launched in backward, say) would, left to the interpreter, end depending on
timing with SIGABRT and "terminate called without an active exception" instead
of exit code 1, and wait for its peers before ending at all. The exception is
not the cause; the interpreter's shutdown after it is:

1. ``Py_FinalizeEx`` clears the modules' globals, and with them drops the last
   reference to the default process group. ``~ProcessGroupGloo`` joins its
   worker threads, and a worker thread inside a collective stays there until
   every peer has issued the same collective or died, or the collective timeout
   has passed. The main thread waits with it: the hang.
2. When that collective ends, its worker thread completes the collective's
   future and runs, then releases, the Python callbacks chained on it
   (``Future.then``, ``add_done_callback``: communication hooks, the ledger),
   which takes the GIL. CPython ends a thread that takes the GIL while the
   interpreter finalizes with ``pthread_exit``; the forced unwind reaches a
   destructor (``noexcept``), and libstdc++ calls ``std::terminate``: the
   SIGABRT. gdb shows it: the main thread in ``_PyModule_ClearDict`` ->
   ``~ProcessGroupGloo`` -> ``std::thread::join``; the ``pt_gloo_runloop``
   thread in ``Future::markCompleted`` -> ``~PythonFunctionGuard`` ->
   ``gil_scoped_acquire`` -> ``take_gil`` -> ``PyThread_exit_thread`` ->
   ``_Unwind_ForcedUnwind`` -> ``std::terminate``. A daemon thread that comes
   back from torch in that window (one polling the store) aborts the same way.

Plain torch under torchrun does the same. Destroying the group earlier, in an
``atexit`` handler, removes the abort but not the hang: gloo cannot cancel a
collective (``ProcessGroupGloo`` keeps ``Backend::abort``, a no-op), so the
destructor still waits for the peers. The interpreter's teardown of the group is
what must not run. So the hook installed by :func:`tandem.init` does what
Python's shutdown does up to that point, and then ends the process:

- the previous ``sys.excepthook`` prints the traceback, once (torch's prefixes
  its lines with ``[rankN]:``); or, where the exception says the job's store is
  out of reach, one line says so in its place and nothing more is asked of the
  store (Note [cut off] in cut_off.py), and the exit status is 75;
- non-daemon threads are joined (``threading._shutdown``), then the ``atexit``
  handlers run, in Python's order: the user's, ``logging.shutdown``,
  multiprocessing's cleanup of its children, ``weakref.finalize``;
- files left open, stdout and stderr are flushed, as the modules' teardown
  would have done;
- last, the monitor leaves this rank's last beat in the job's store, saying
  that it raised and what (Note [how a rank left] in peers.py), which peers
  waiting on it read as "crashed: it raised an uncaught ValueError" and fail
  with. Python's own order would mark it among the ``atexit`` handlers, before
  the others and the scan for open files had run: on a loaded host a peer then failed, exited and was
  reported by ``tandem run`` as the rank that failed first, while this rank, the
  cause, was still exiting and was "stopped by the launcher". Marked last, its
  traceback is written and its exit a moment away when a peer learns of it;
- ``os._exit(1)``, or death by SIGINT after a ``KeyboardInterrupt``, as Python
  itself ends then. The kernel closes the sockets, so a peer waiting in a
  collective with this rank gets "connection closed" at once.

It acts only on an uncaught exception in the main thread of the process that
called :func:`tandem.init`, with a process group still initialised, when the
interpreter is on its way out: not in an interactive session (``python -i``,
the REPL), not when a running program reports an error through
``sys.excepthook`` (``code.interact``), not inside an outer hook that collects
the output to rewrite it (torch's, when a later ``init_process_group`` wraps
this hook; the one the later :func:`tandem.init` installs outside acts). Everything else
is left to Python: a normal exit
and ``sys.exit(n)`` (which never reaches ``sys.excepthook``) still tear the
group down, which is why a script should call :func:`tandem.shutdown` when it is
done. What the hook skips is the finalisation of modules: ``__del__`` of objects
still alive then does not run, which Python never promised either.
"""

from __future__ import annotations

import atexit
import gc
import inspect
import io
import itertools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import NoReturn

import torch.distributed as dist

from tandem.comm.cut_off import CUT_OFF_EXITCODE
from tandem.comm.monitor import current_monitor_if_any, leave_at_exit, stop_monitor
from tandem.comm.peers import last_beat

__all__ = ["install_clean_exit", "uninstall_clean_exit"]

logger = logging.getLogger(__name__)

_ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], object]


class _CleanExitHook:
    """``sys.excepthook`` that lets ``previous`` print, then ends the process
    (Note [exit on an uncaught exception])."""

    def __init__(self, previous: _ExceptHook) -> None:
        self.previous = previous
        self.pid = os.getpid()

    def __call__(self, exc_type: type[BaseException], exc: BaseException,
                 tb: TracebackType | None) -> None:
        leaving = self._leaving()
        lost = _lost_store(exc) if leaving else None
        if lost is not None:  # Note [cut off] in cut_off.py: one line says it all
            _say(lost)
        else:
            try:
                self.previous(exc_type, exc, tb)
            except BaseException:  # noqa: BLE001 - a broken hook must not hide the error
                sys.__excepthook__(exc_type, exc, tb)
        if leaving:
            _leave(exc_type, 1 if lost is None else CUT_OFF_EXITCODE)

    def _leaving(self) -> bool:
        """Whether the interpreter is about to shut down because of this exception."""
        if os.getpid() != self.pid or threading.current_thread() is not threading.main_thread():
            return False  # a forked child, or a hook called by hand from a thread
        if sys.flags.inspect or sys.flags.interactive or hasattr(sys, "ps1"):
            return False  # the REPL goes on after the traceback
        if not (dist.is_available() and dist.is_initialized()):
            return False  # tandem.shutdown() already ran: nothing to tear down
        if isinstance(sys.stderr, io.StringIO):
            return False  # an outer hook is collecting the text to rewrite it (torch's does)
        # At the top level the script's frames are gone: what calls the hook is
        # the interpreter itself, or other hooks wrapping this one. A program
        # that is still running (code.interact) has its "<module>" frame below.
        frame = inspect.currentframe()
        while frame is not None:
            if frame.f_code.co_name == "<module>":
                return False
            frame = frame.f_back
        return True


def install_clean_exit() -> None:
    """Make an uncaught exception end this process with exit code 1 after its
    traceback, without the interpreter tearing down the process group
    (Note [exit on an uncaught exception]). Idempotent.
    """
    hook = sys.excepthook
    # A child forked after its parent's init has the parent's hook, which passes
    # its exceptions through: it gets one of its own.
    if not (isinstance(hook, _CleanExitHook) and hook.pid == os.getpid()):
        sys.excepthook = _CleanExitHook(hook)


def uninstall_clean_exit() -> None:
    """Undo :func:`install_clean_exit`, if its hook is still the outermost one
    (a hook installed later on top of it stays, and it then passes exceptions
    through, since no process group is left)."""
    hook = sys.excepthook
    if isinstance(hook, _CleanExitHook):
        sys.excepthook = hook.previous


def _lost_store(exc: BaseException) -> str | None:
    """The one line to print in place of the traceback when ``exc`` says the
    job's store is out of reach (Note [cut off] in cut_off.py); None otherwise."""
    monitor = current_monitor_if_any()
    return monitor.lost_store(exc) if monitor is not None else None


def _say(line: str) -> None:
    try:
        sys.stderr.write(line)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _leave(exc_type: type[BaseException], code: int = 1) -> NoReturn:
    """Python's shutdown without the finalisation of modules, then the exit."""
    logger.debug("rank %s: uncaught %s: leaving without tearing down the process group",
                 dist.get_rank() if dist.is_initialized() else "?", exc_type.__name__)
    # Each step may fail or be interrupted (a second Ctrl-C while joining a
    # thread): it is skipped, and the process still ends. atexit._run_exitfuncs
    # is the interpreter's own way into the handlers (private; CPython 3.0 to
    # 3.13): it runs them once, last registered first, and forgets them.
    atexit.unregister(leave_at_exit)  # this rank leaves last, below, saying it raised

    def leave() -> None:
        stop_monitor(left=True, beat=last_beat(raised=exc_type))

    for step in (_join_threads, atexit._run_exitfuncs, _flush_open_files, leave):
        try:
            step()
        except BaseException:  # noqa: BLE001, S110 - see above
            pass
    if issubclass(exc_type, KeyboardInterrupt):
        # As CPython ends after an unhandled KeyboardInterrupt: killed by SIGINT,
        # so that a shell or launcher sees the interrupt.
        try:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except (OSError, ValueError):
            pass
        os._exit(128 + signal.SIGINT)
    os._exit(code)


def _join_threads() -> None:
    # What the interpreter does first on its way out: wait for non-daemon threads
    # and run threading's own exit callbacks (concurrent.futures' executors).
    # A private function of threading, present in CPython 3.4 to 3.13.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()


def _flush_open_files() -> None:
    # The modules' teardown would close (and so flush) files the script left
    # open; os._exit would drop their buffered writes. Types are tested, not
    # objects (isinstance reads __class__, which some objects turn into a
    # warning: torch.distributed.reduce_op), and the scan runs in C (a fraction
    # of a second per million objects).
    objects = gc.get_objects()
    file_types = {kind for kind in set(map(type, objects)) if issubclass(kind, io.IOBase)}
    for f in itertools.compress(objects, map(file_types.__contains__, map(type, objects))):
        try:
            if not f.closed and f.writable():
                f.flush()
        except Exception:  # noqa: BLE001, S110 - a pipe to a dead reader, a detached buffer
            pass
    del objects
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001, S110
            pass
