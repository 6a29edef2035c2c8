"""A spare worker: an interpreter started ahead, that has imported torch and waits
to become an elastic job's next replacement (:class:`Spares`).

# Note [spare workers]
A replacement started when a worker dies (``python -u script.py``) spends its
first seconds importing torch and tandem: 1.7 s of CPU alone, 4 s of wall time
on two cores that four workers share, during which the world trains one rank
short (the soak's "a smaller world": 7% of the samples at a failure every
10 s; Note [soak] in tandem/testing/soak.py). So under ``--elastic`` with
replacements to give, the launcher keeps one spare per node: a new process of
the workers' interpreter, with their environment, started through torch's own
subprocess handler (so that torch's process context watches it, signals it
and waits on it like any worker once it is one), which imports torch,
``torch.distributed``, ``torch._dynamo`` (which torch's first optimizer would
import) and tandem's elastic path and then waits, blocked on a FIFO of its own.
When a worker dies, the launcher writes the replacement's command, environment,
working directory and log files into that FIFO and puts
the spare in the dead worker's place; the spare takes them (the environment
whole, its output to the replacement's files) and runs the script or module as
``__main__``, as ``python -u`` would (``runpy``: an uncaught exception reaches
``sys.excepthook`` and exits with 1, ``sys.exit`` gives its code, ``atexit``
runs). The launcher then starts the next spare, which waits
:data:`NEXT_SPARE_AFTER_S` before it imports: the replacement it follows is
admitted tenths of a second after its loss (the soak: started 0.12 s after
the kill, admitted 0.11 to 0.28 s later), and an import beside that
admission, even under ``SCHED_IDLE`` (below), made it stop the members about
twice as long: 45 to 52 ms, against 20 ms with the import 2 s later (DDP,
steps of 28 ms, 2 cores; both against a pace the import slowed, as the soak
measured it then: docs/benchmarks/failures.md). A failure within that second
and the import's finds no spare ready, as before.

A spare imports under Linux's ``SCHED_IDLE``, on CPU time no worker wants, and
is scheduled as any process again when it becomes a worker (where it may: as
root, or with ``RLIMIT_NICE`` allowing it; else it imports at the workers'
priority, and on a machine whose cores the workers fill, slows them while it
does). A spare is a fresh interpreter, not a fork: nothing of another process's
threads, locks or heap (a fork of an interpreter that had imported torch ran
DDP 8% slower than a new process, and once deadlocked in torch's teardown).
A spare that is not ready yet (still importing: its FIFO not open) or gone is
passed over, and the replacement starts as a new process, as before. A spare
dies with its launcher (``PR_SET_PDEATHSIG``) until it becomes a worker, which
then outlives it as any worker does. ``--no-spare`` turns spares off; a
program run with ``--no-python`` has none.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import select
import signal
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Spares", "python_target"]

PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "tandem", "tandem.train", "tandem.elastic.run",
           "tandem.checkpoint.one_rank")
"""What a spare imports while it waits: what every replacement of a Trainer or
``prepare`` job imports before it can ask to join. ``torch._dynamo`` among them:
torch's optimizers import it as the first one is built (``torch._disable_dynamo``
on their methods), 1.1 s of CPU more."""

_PR_SET_PDEATHSIG = 1
NEXT_SPARE_AFTER_S = 1.0
"""How long a spare started as another is taken waits before it imports (Note [spare workers])."""


def python_target(args: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """``("script", path, rest)`` or ``("module", name, rest)`` for the Python
    arguments ``tandem run`` gives its workers (``-u script.py ...`` or ``-u -m
    module ...``: tandem.launch.cli.worker_command); None for any other."""
    args = list(args)
    if args[:2] == ["-u", "-m"] and len(args) >= 3:
        return "module", args[2], args[3:]
    if args[:1] == ["-u"] and len(args) >= 2 and not args[1].startswith("-"):
        return "script", args[1], args[2:]
    return None


class Spares:
    """This node's spare worker (Note [spare workers]): :meth:`take` makes it a
    replacement and starts the next."""

    def __init__(self, python: str, env: Mapping[str, str], *, count: int) -> None:
        """Start a spare of ``python`` with ``env`` added to the launcher's
        environment; ``count`` spares at most in all (the replacements allowed)."""
        self._python = python
        self._env = dict(env)
        self._left = count
        self._directory = Path(tempfile.mkdtemp(prefix="tandem-spares-"))
        self._started = 0
        self._spare: tuple[Any, Path] | None = None
        self._start()

    @property
    def pid(self) -> int | None:
        """The waiting spare's process id (None when there is none)."""
        return self._spare[0].proc.pid if self._spare is not None else None

    def ready(self) -> bool:
        """The spare has imported and waits (its FIFO open: Linux's ``/proc``)."""
        if self._spare is None or self._spare[0].proc.poll() is not None:
            return False
        handler, fifo = self._spare
        try:
            fds = os.listdir(f"/proc/{handler.proc.pid}/fd")
            return any(os.readlink(f"/proc/{handler.proc.pid}/fd/{fd}") == str(fifo) for fd in fds)
        except OSError:
            return False

    def take(self, program_args: Sequence[str], env: Mapping[str, str], stdout: str | None,
             stderr: str | None, local_rank: int) -> Any:
        """Hand the spare a replacement's command (the worker's Python arguments),
        its whole environment ``env`` and its log files; returns the spare's
        subprocess handler, now the replacement's, and starts the next spare.
        None when no spare is ready: start the replacement as a new process."""
        target = python_target(program_args)
        if target is None or self._spare is None:
            return None
        handler, fifo = self._spare
        if handler.proc.poll() is not None:  # it died waiting: start another for the next time
            self._spare = None
            self._start()
            return None
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno == errno.ENXIO:  # still importing: not yet reading its FIFO
                return None
            raise
        kind, name, rest = target
        request = {"kind": kind, "target": name, "argv": rest, "env": dict(env), "cwd": os.getcwd(),
                   "stdout": stdout or None, "stderr": stderr or None}
        os.set_blocking(fd, True)
        try:
            os.write(fd, json.dumps(request).encode())
        finally:
            os.close(fd)
        handler.local_rank_id = local_rank
        self._spare = None
        self._start(after_s=NEXT_SPARE_AFTER_S)
        return handler

    def close(self) -> None:
        """Stop the waiting spare, if any."""
        if self._spare is not None:
            handler, _ = self._spare
            if handler.proc.poll() is None:
                handler.close(signal.SIGKILL)
                handler.proc.wait()
            self._spare = None
        shutil.rmtree(self._directory, ignore_errors=True)

    def _start(self, *, after_s: float = 0.0) -> None:
        if self._left <= 0:
            return
        from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler
        self._left -= 1
        self._started += 1
        fifo = self._directory / f"spare-{self._started}"
        os.mkfifo(fifo, 0o600)
        # Its output, until it is a worker, is the launcher's: an import that fails shows.
        # Run as a file, not a module: importing tandem.launch.spare would import tandem, and so
        # torch, before main() could tie it to the launcher and lower its priority.
        handler = get_subprocess_handler(entrypoint=self._python,
                                         args=("-u", __file__, str(fifo), str(os.getpid()), f"{after_s:g}"),
                                         env=self._env, stdout="", stderr="", local_rank_id=-1)
        self._spare = (handler, fifo)


def _parent_death_signal(sig: int) -> None:
    """Linux's ``PR_SET_PDEATHSIG``: ``sig`` when the launcher exits (0: none)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _idle_if_it_can_come_back() -> bool:
    """Import under ``SCHED_IDLE`` (Note [spare workers]), where this process may
    leave it again: as root, or with ``RLIMIT_NICE`` allowing its nice value."""
    import resource
    try:
        allowed = (os.geteuid() == 0 or
                   resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - os.getpriority(os.PRIO_PROCESS, 0))
        if allowed:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return allowed
    except (AttributeError, OSError):
        return False


def _scheduled_as_any_process() -> None:
    """Back to ``SCHED_OTHER``, every thread (a library may have started one while importing)."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(task), os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            pass


def _run_as_main(request: dict[str, Any]) -> None:
    """Become the process ``python -u script.py`` would have started, and run it:
    the interpreter then exits as that one would."""
    import runpy
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        if path:
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
        sys.modules["torch"].set_num_threads(int(threads))  # what torch reads at its first use
    sys.argv = [request["target"], *request["argv"]]
    if request["kind"] == "module":
        sys.path[0] = os.getcwd()
        runpy.run_module(request["target"], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(request["target"]))
        runpy.run_path(request["target"], run_name="__main__")



def main() -> None:
    """A spare (``python -u .../tandem/launch/spare.py FIFO LAUNCHER_PID AFTER_S``):
    wait AFTER_S seconds, import, wait for a replacement's request on FIFO, and
    become it (Note [spare workers])."""
    import importlib
    import time
    sys.path[0] = os.getcwd()  # not this file's directory: as ``python -m`` has it
    fifo, launcher, after_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    _parent_death_signal(signal.SIGKILL)
    if os.getppid() != launcher:
        return  # the launcher exited before the signal was set
    time.sleep(after_s)  # the admission of the replacement taken before this spare goes first
    idle = _idle_if_it_can_come_back()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the replacement imports it itself, and fails there
            pass
    # Opened without waiting for a writer, so that the launcher sees it ready (:meth:`Spares.ready`);
    # Linux's select then waits for the launcher's request (a FIFO never written to is not at its end).
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    select.select([fd], [], [])
    os.set_blocking(fd, True)
    with os.fdopen(fd) as f:
        text = f.read()
    if not text:
        return
    _parent_death_signal(0)  # a worker now: it outlives the launcher as any worker does
    if idle:
        _scheduled_as_any_process()
    _run_as_main(json.loads(text))


if __name__ == "__main__":
    main()
