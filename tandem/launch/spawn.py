"""``tandem.spawn(fn, args, nprocs)``: a job of ``nprocs`` processes from inside a
script or notebook, like ``torch.multiprocessing.spawn``, on the same engine as
``tandem run``.

The processes are started by torch's elastic agent on this machine, meet on a
free port, and get torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...);
each calls :func:`tandem.init` before ``fn(rank, *args)`` and
:func:`tandem.shutdown` after it. Their output appears in the caller's
stdout/stderr with rank prefixes (in a notebook too, where a child's own output
would go to the server's terminal). The first failure is raised in the caller as
:class:`SpawnError`, with its rank and traceback, after the others were stopped.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from tandem.launch.agent import quiet_torch_launch_logs, run_workers
from tandem.launch.config import LaunchConfig
from tandem.launch.config import threads_per_worker
from tandem.launch.logs import WorkerLogs
from tandem.launch.machine import loopback_interface_env, usable_cpus
from tandem.launch.output import RankOutput
from tandem.launch.summary import collect_failures, in_order_of_failure
from tandem.store.job_secret import secret_for_workers

__all__ = ["SpawnError", "spawn"]


class SpawnError(RuntimeError):
    """A spawned process failed; the others were stopped.

    Attributes:
        rank: the rank that failed first.
        exitcode: its exit status (negative: killed by that signal).
        traceback: its traceback as text ("" if it died without one).
    """

    def __init__(self, rank: int, exitcode: int, how: str, traceback: str) -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.traceback = traceback
        detail = f":\n{traceback.rstrip()}" if traceback.strip() else " (no traceback)"
        super().__init__(f"rank {rank} failed with {how}{detail}")


def spawn(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 1,
          backend: str | None = None, *, init: bool = True,
          start_method: str = "spawn") -> list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes joined in one process group.

    Args:
        fn: a function importable by name (defined at the top level of a module).
        args: more arguments for ``fn``, after the rank.
        nprocs: the number of processes.
        backend: process-group backend for :func:`tandem.init`; None picks NCCL
            with GPUs, gloo without.
        init: call :func:`tandem.init` before ``fn`` and :func:`tandem.shutdown`
            after it. With False, ``fn`` does it (the rendezvous variables are
            set either way).
        start_method: ``"spawn"`` (fresh interpreters), ``"forkserver"`` or
            ``"fork"``.

    Returns:
        ``fn``'s return values, by rank (they must be picklable).

    Raises:
        SpawnError: a process raised or died; the others were stopped.
        ValueError: ``nprocs`` is not positive, or ``fn`` cannot reach a
            process started with ``start_method``.

    Warning:
        With ``"spawn"`` (the default, and what CUDA needs) every process
        imports ``fn`` by name: a function defined in a notebook cell or under
        ``if __name__ == "__main__":`` cannot be found. Put it in a module, or
        pass ``start_method="fork"`` on a CPU-only job. A script that calls
        ``spawn`` at its top level must do so under ``if __name__ == "__main__":``,
        as with ``torch.multiprocessing.spawn``.
    """
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r} must be a positive int")
    _check_reachable(fn, start_method)
    config = LaunchConfig(
        nproc_per_node=nprocs, rdzv_id=f"tandem-spawn-{uuid.uuid4().hex}",
        start_method=start_method,
        omp_num_threads=threads_per_worker(nprocs, cpus=usable_cpus(), environ=os.environ),
        rdzv_reason="spawn")
    log_root = tempfile.mkdtemp(prefix="tandem-spawn-")
    output = RankOutput(sys.stdout, sys.stderr)
    logs = WorkerLogs(log_root, worker_env={**config.worker_env, **secret_for_workers(1), **loopback_interface_env()},
                      on_attempt=output.follow)
    output.start()
    try:
        with quiet_torch_launch_logs():
            result = run_workers(config, _spawned, (fn, init, backend, tuple(args)), logs)
        output.stop()
        if result.is_failed():
            last = logs.attempts[-1] if logs.attempts else None
            failures = collect_failures(result.failures, last, host=socket.gethostname())
            first = in_order_of_failure(failures)[0]
            raise SpawnError(first.rank, first.exitcode, first.how, first.text)
        return [result.return_values[rank] for rank in range(nprocs)]
    finally:
        output.stop()
        shutil.rmtree(log_root, ignore_errors=True)


def _spawned(fn: Callable[..., Any], init: bool, backend: str | None, args: tuple) -> Any:
    """What each process runs (by name, so it must stay at module level)."""
    rank = int(os.environ["RANK"])
    if not init:
        return fn(rank, *args)
    from tandem.control import init as tandem_init
    from tandem.control import shutdown as tandem_shutdown

    tandem_init(backend)
    try:
        return fn(rank, *args)
    finally:
        tandem_shutdown()


def _check_reachable(fn: Callable[..., Any], start_method: str) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    if start_method == "fork":
        return
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    main = sys.modules.get("__main__")
    interactive = module == "__main__" and not getattr(main, "__file__", None)
    if "<locals>" in qualname or "<lambda>" in qualname or interactive:
        where = "a notebook or the REPL" if interactive else f"{module}.{qualname}"
        raise ValueError(
            f"fn {where} cannot be imported by processes started with {start_method!r}: "
            "define it at the top level of a .py module and import it from there, or pass "
            "start_method='fork' (CPU only)")
