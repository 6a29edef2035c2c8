"""Run a function on N ranks in separate processes, with a deadline that kills.

The harness is what tandem's own tests use, and users can use it for theirs::

    def check(rank, world_size, scale):
        t = torch.full((2,), float(rank))
        dist.all_reduce(t)
        return t * scale

    results = run_distributed(check, world_size=2, args=(3.0,))  # one value per rank

Each rank is a fresh process forked from a forkserver (torch and tandem imported once, no
OpenMP threads inherited), joined into a gloo process group through a file store
in a private temporary directory, so there are no ports to race for. Each rank
runs with one intra-op thread, as a rank of a real job on a shared host would.

If any rank raises, :class:`RankFailure` is raised in the caller with that rank's
traceback, and every other rank is killed. If the ranks do not all finish within
``timeout`` seconds (a hang in a collective, say), every rank is killed and
:class:`TimeoutError` names the ranks that had not finished. A test can therefore
fail, but never hang CI.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["RankFailure", "run_distributed", "still_running"]

# How long surviving ranks get to report their own error after the first failure.
# Peers of a dead rank usually fail fast in gloo ("connection closed"), and their
# messages help to tell cause from consequence.
_GRACE_AFTER_FAILURE_S = 3.0
_POLL_S = 0.02


class RankFailure(RuntimeError):
    """A rank raised. ``rank`` is the first failing rank; ``tracebacks`` maps every
    rank that reported an error to its formatted traceback."""

    def __init__(self, rank: int, tracebacks: dict[int, str]) -> None:
        self.rank = rank
        self.tracebacks = tracebacks
        others = sorted(r for r in tracebacks if r != rank)
        msg = f"rank {rank} failed:\n{tracebacks[rank]}"
        if others:
            msg += f"\n(ranks {others} also failed, probably as a consequence)"
        super().__init__(msg)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    backend: str = "gloo",
    init_process_group: bool = True,
    env: dict[str, str] | None = None,
    may_die: Collection[int] = (),
    replace: Collection[int] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks and return
    the list of their return values (which must be picklable by ``torch.save``).

    Args:
        fn: a module-level function (it is pickled by name into each rank).
        world_size: number of ranks.
        args: extra positional arguments, pickled into each rank.
        timeout: seconds for the whole run, process start-up included.
        backend: process-group backend for the default group.
        init_process_group: when False the ranks get no process group; the
            variables ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
            ``LOCAL_WORLD_SIZE`` and ``TANDEM_TEST_STORE`` (a file path) are
            set so that ``fn`` can build one itself.
        env: extra environment variables for the ranks.
        may_die: ranks a fault-injection test kills on purpose: their death is
            not a failure, and their result is None.
        replace: ranks among ``may_die`` whose death starts a replacement: a
            new process running ``fn(rank, world_size, *args)`` with
            ``TANDEM_ELASTIC_JOIN=1`` that joins the elastic job through
            ``tandem.init`` instead of the first process group; with ``init_process_group=False``
            ``fn`` calls ``tandem.init`` itself (``init_method`` from
            ``TANDEM_TEST_STORE``). Its result follows the ranks' in the returned
            list, in the order the replacements started; its slot number
            (``world_size``, then up) in ``may_die`` lets it die too.

    Raises:
        RankFailure: a rank raised; carries its rank and traceback.
        TimeoutError: not every rank finished within ``timeout``.
    """
    # A replacement joins as Note [elastic membership] in tandem/control/membership.py says.
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    workdir = Path(tempfile.mkdtemp(prefix="tandem-test-"))
    procs: list[Any] = []
    unknown = set(replace) - set(may_die)
    if unknown:
        raise ValueError(f"replace={sorted(replace)}: ranks {sorted(unknown)} are not in may_die")

    def start(slot: int, rank: int, joining: bool) -> None:
        rank_env = dict(env or {})
        if joining:
            rank_env["TANDEM_ELASTIC_JOIN"] = "1"
        p = ctx.Process(
            target=_rank_main,
            args=(fn, slot, rank, world_size, tuple(args), str(workdir), backend,
                  init_process_group, rank_env, timeout, joining),
            name=f"tandem-rank-{slot}",
            daemon=True,
        )
        p.start()
        procs.append(p)

    try:
        for rank in range(world_size):
            start(rank, rank, False)
        return _collect(procs, workdir, timeout, frozenset(may_die), frozenset(replace), start)
    finally:
        stop_all(procs, workdir)


def stop_all(procs: Sequence[Any], workdir: Path) -> None:
    """Kill the ranks still running, reap them all, remove their directory."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)
    shutil.rmtree(workdir, ignore_errors=True)


def _context() -> Any:
    """The forkserver context. The server imports, once, what every rank would
    otherwise import for itself: torch, torch._dynamo (imported by the first
    ``optimizer.step()``), tandem's parts (``import tandem`` alone imports them
    lazily), about 3 s of CPU per rank, and pytest when the caller runs under it (the
    ranks unpickle test functions by importing their modules, which import
    pytest). A rank forked from it starts in about 0.1 s instead of 3 to 10 s on
    a loaded two-core host. The list takes effect when the server starts (the
    first call in a process) and names only modules that import no threads."""
    import sys

    ctx = multiprocessing.get_context("forkserver")
    preload = ["torch", "torch.distributed", "torch._dynamo", "tandem", "tandem.ddp", "tandem.fsdp",
               "tandem.train", "tandem.zero", "tandem.checkpoint", "tandem.testing"]
    if "pytest" in sys.modules:
        preload.append("pytest")
    ctx.set_forkserver_preload(preload)
    return ctx


def _collect(procs: list[Any], workdir: Path, timeout: float, may_die: frozenset[int],
             replace: frozenset[int], start: Callable[[int, int, bool], None]) -> list[Any]:
    deadline = time.monotonic() + timeout
    first_failure: int | None = None
    failure_deadline = float("inf")
    replaced: set[int] = set()
    while True:
        world_size = len(procs)
        errors = {r: (workdir / f"{r}.err").read_text() for r in range(world_size)
                  if (workdir / f"{r}.err").exists()}
        done = [r for r in range(world_size) if (workdir / f"{r}.ok").exists()]
        if errors and first_failure is None:
            first_failure = min(errors)
            failure_deadline = time.monotonic() + _GRACE_AFTER_FAILURE_S
        dead = [r for r, p in enumerate(procs)
                if not p.is_alive() and r not in errors and r not in done]
        done += [r for r in dead if r in may_die]
        for r in dead:
            if r in replace and r not in replaced:
                replaced.add(r)
                start(len(procs), r, True)
        dead = [r for r in dead if r not in may_die]
        for r in dead:
            # Died without writing a report: killed by a signal, os._exit, segfault.
            code = procs[r].exitcode
            errors[r] = f"process exited with code {code} without reporting a result"
            if first_failure is None:
                first_failure = r
                failure_deadline = time.monotonic() + _GRACE_AFTER_FAILURE_S
        if first_failure is not None and (
            len(errors) + len(done) == len(procs) or time.monotonic() > failure_deadline
        ):
            raise RankFailure(first_failure, errors)
        if len(done) == len(procs):
            return [_load((workdir / f"{r}.ok").read_bytes()) if (workdir / f"{r}.ok").exists()
                    else None for r in range(world_size)]
        if time.monotonic() > deadline:
            pending = [r for r in range(world_size) if r not in done]
            raise TimeoutError(
                f"ranks {pending} of {world_size} did not finish within {timeout:.0f}s "
                f"(finished: {done}); all ranks were killed")
        time.sleep(_POLL_S)


def _load(payload: bytes) -> Any:
    return torch.load(io.BytesIO(payload), weights_only=False)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _rank_main(fn: Callable[..., Any], slot: int, rank: int, world_size: int, args: tuple,
               workdir: str, backend: str, init_pg: bool, env: dict[str, str],
               timeout: float, joining: bool) -> None:

    from tandem._compat import bind_group_defaults_before_init

    bind_group_defaults_before_init()
    out = Path(workdir)
    # This process is the harness's own child: setting its environment is local to it.
    os.environ.update(env)
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "TANDEM_TEST_STORE": str(out / "store"),
    })
    torch.set_num_threads(1)

    def call() -> Any:
        if joining and init_pg:
            import tandem
            tandem.init(backend, init_method=f"file://{out / 'store'}",
                        timeout=datetime.timedelta(seconds=timeout))
        elif init_pg:
            join_group(backend, out / "store", rank, world_size, timeout)
        return fn(rank, world_size, *args)

    run_and_report(call, out / f"{slot}.ok", out / f"{slot}.err")


def join_group(backend: str, store: Path, rank: int, world_size: int, timeout: float) -> None:
    """Join the default process group over the file ``store``, and wait until every
    rank has.

    Why the barrier: gloo's ``init_process_group`` can return on one rank while a
    peer is still finishing its handshake with it (torch has no barrier at the end
    of init by default). A function that issues no collective would then end and
    destroy its group under that peer, whose init fails with "Connection closed by
    peer" (seen under load, in a case without a collective).
    """
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    dist.barrier()


def run_and_report(call: Callable[[], Any], ok: Path, err: Path) -> None:
    """Run ``call()`` in a rank; write its result (``torch.save``) to ``ok`` or its
    traceback to ``err``, atomically, and leave the default group either way."""
    import torch.distributed as dist

    try:
        result = call()
        buf = io.BytesIO()
        torch.save(result, buf)
        _write_atomic(ok, buf.getvalue())
    except BaseException:
        _write_atomic(err, traceback.format_exc().encode())
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def still_running(pids: Sequence[int], *, wait: float = 5.0) -> list[int]:
    """The processes among ``pids`` that are still alive after up to ``wait``
    seconds, read from /proc (zombies count as gone: they hold nothing but a
    process-table slot). A fault-injection test asserts this is empty: no rank
    outlives its group."""
    deadline = time.monotonic() + wait
    while True:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)
