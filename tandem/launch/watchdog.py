"""``tandem run --hang-timeout``: notice that a job stopped making progress, and
say where each rank is.

# Note [progress without a collective]
Each worker's monitor thread rewrites its progress file (``progress.json`` in
the rank's log directory) a few times a second while the rank makes progress:
a collective completed or a step began (:mod:`tandem.comm.monitor`). A stuck
collective cannot stop that file from being read, and the launcher needs no
collective or store to read it: it looks at the files' modification times.
When the newest is older than the timeout, no rank has progressed. A worker
that has not yet completed a collective or begun a step is still starting:
importing torch and tandem takes seconds of CPU each, tens of seconds on a
loaded host, and many scripts import more after ``tandem.init()`` (which writes
the first progress) and before their first collective. While any of this node's
workers is still starting, the attempt has not hung before ``max(timeout,
STARTUP_GRACE_S)`` from its start: a rank waiting in its first collective for a
peer still importing is not stuck. (Counting from the first file, rank 0 was
reported hung under a 4 s timeout while rank 1 was still importing, on a
two-core host running three test processes; before any file, a restarted attempt
on a busy host was reported hung before its workers had started.) The price: a
rank stuck before its first collective is reported after the grace, not the
timeout. Each node's watchdog judges by its own workers (for the ranks of
other nodes in the report, see Note [a hang on another node]). Once
progressed: the watchdog sends SIGUSR1 to the workers that wrote a file
(their ``faulthandler`` dumps every thread's stack; a worker that wrote none
has no handler, and SIGUSR1 would kill it), reads the files
and builds the report (:mod:`tandem.launch.hang`).

# Note [finishing]
A rank that has done its work leaves: ``tandem.shutdown()`` or the exit hook
stops its monitor, which writes its progress file once more, whole (the
periodic writes may be up to a beat behind: a fast job's last steps), with
``finished_at``. From then on the rank makes no progress by design: it
destroys its process group and the interpreter exits, which on a loaded host
takes seconds (two ranks that had both printed their last line took more than
4.5 s to exit, beside two other jobs and two busy loops on two cores, and a
4 s watchdog reported the finished attempt hung and gave up on the job). Once
any of this node's ranks has finished, the attempt is finishing: its other
ranks are past their last collective or about to be, and the attempt has hung
only after ``max(timeout, FINISH_GRACE_S)`` without progress. The price, as for
starting: a rank stuck while another has already left is reported after the
grace, not the timeout.

# Note [whole dumps]
``faulthandler`` writes a dump thread by thread, line by line, from the signal
handler, while the watchdog polls the file. A dump read halfway (the monitor
thread's block written, the main thread's not yet) would report no stack for
that rank. So a dump counts once it holds the block of the rank's main thread
(whose ident the progress file gives) and has not changed for one poll; after
STACKS_WAIT_S whatever is there is used.

# Note [a hang on another node]
The launcher on each node watches its own workers. In a job on several nodes,
the ranks waiting on a stuck rank elsewhere stop progressing too, so every
node's watchdog fires, and from its own files alone each would see only ranks
waiting. So each worker also posts a short snapshot of its progress (counters,
its last two collectives and those in flight) in the job's store, below its
prefixes, under ``tandem/progress/<rank>``, when it changed and at most once a
second (tandem/comm/monitor.py); a stalled rank's last snapshot stays. When the
watchdog fires, it reads the snapshots of the ranks of other nodes from the
workers' store, and the report names every rank, on this node or another, that
has not issued the collective the others wait in. A store it cannot reach
leaves the report to this node's ranks, saying so.

The nodes' watchdogs fire within about a check interval of each other (their
ranks stopped together), and each then waits up to STACKS_WAIT_S for stacks. A
node that stopped its workers as soon as its report was written would end the
others' ranks (they see a peer die) before their watchdogs fired: their logs
would hold a lost peer instead of the report. So in
a job of several nodes, a node that reported waits OTHER_NODES_GRACE_S before
its workers are stopped (:meth:`Watchdog.let_other_nodes_report`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sysconfig
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tandem.store.job_secret import SignedStore
from tandem.comm.monitor import progress_key
from tandem.store.store_address import StoreAddress, connect, describe
from tandem.launch.hang import format_hang_report
from tandem.launch.logs import Attempt

__all__ = ["HANG_EXITCODE", "Watchdog"]

logger = logging.getLogger(__name__)

HANG_EXITCODE = -int(signal.SIGUSR1)
"""What a hung worker's failure records: the watchdog's signal (it is then stopped)."""
CHECK_INTERVAL_S = 0.5
"""How often the progress files are looked at."""
STACKS_WAIT_S = 2.0
"""How long the workers get to dump their stacks."""
STARTUP_GRACE_S = 60.0
"""Before any worker wrote progress, how long an attempt may take to start (at least)."""
FINISH_GRACE_S = 60.0
"""Once a worker has finished, how long the others may take to finish (at least)."""
OTHER_NODES_GRACE_S = 2 * CHECK_INTERVAL_S + STACKS_WAIT_S
"""After a hang report, how long the other nodes get to write theirs (Note [a hang on another node])."""


class Watchdog:
    """Decides when an attempt has hung, and writes its report.

    Args:
        timeout_s: how long without progress counts as a hang.
    """

    def __init__(self, timeout_s: float, *, secret: bytes | None = None) -> None:
        self.timeout_s = timeout_s
        self._secret = secret  # the ranks' posted progress is signed with it (Note [signed store])
        self._attempt: int | None = None
        self._started = time.time()
        self._next_check = 0.0

    def stalled_for(self, attempt: Attempt, now: float | None = None) -> float | None:
        """Seconds without progress in ``attempt`` when that exceeds the timeout, else None."""
        now = time.time() if now is None else now
        if attempt.number != self._attempt:
            self._attempt, self._started, self._next_check = attempt.number, now, 0.0
        if now < self._next_check:
            return None
        self._next_check = now + CHECK_INTERVAL_S
        written: list[float] = []
        for logs in attempt.ranks.values():
            try:
                written.append(logs.progress.stat().st_mtime)
            except OSError:
                continue
        stalled = now - max([*written, self._started])
        if stalled < self.timeout_s:
            return None
        snapshots = [_read_json(logs.progress) for logs in attempt.ranks.values()]
        if now - self._started < max(self.timeout_s, STARTUP_GRACE_S) and not all(
                map(_has_progressed, snapshots)):
            return None  # a worker is still starting: Note [progress without a collective]
        if stalled < max(self.timeout_s, FINISH_GRACE_S) and any(
                s is not None and "finished_at" in s for s in snapshots):
            return None  # a worker has finished: Note [finishing]
        return stalled

    def rearm(self) -> None:
        """Count a stall from now on: a hung rank was stopped, and the others
        need the time to go on without it."""
        self._started = time.time()
        self._next_check = 0.0

    def let_other_nodes_report(self, attempt: Attempt) -> None:
        """After this node's report, before its workers are stopped: in a job of
        several nodes, give the others' watchdogs the time to write theirs (Note
        [a hang on another node])."""
        if attempt.world_size > len(attempt.ranks):
            time.sleep(OTHER_NODES_GRACE_S)

    def snapshots(self, attempt: Attempt) -> dict[int, dict[str, Any] | None]:
        """This node's workers' last progress, by global rank."""
        return {rank: _read_json(logs.progress) for rank, logs in attempt.ranks.items()}

    def report(self, attempt: Attempt, pids: Mapping[int, int], stalled_s: float,
               store_address: StoreAddress | None = None) -> str:
        """Ask the workers for their stacks, then build the report text; with
        ``store_address`` (the workers' store), with the ranks of other nodes
        too (Note [a hang on another node])."""
        snapshots: dict[int, dict[str, Any] | None] = {
            rank: _read_json(logs.progress) for rank, logs in attempt.ranks.items()}
        asked = []
        for rank, snap in snapshots.items():
            pid = pids.get(rank)
            if snap is not None and pid is not None and snap.get("pid") == pid:
                try:
                    os.kill(pid, signal.SIGUSR1)
                    asked.append(rank)
                except OSError as e:
                    logger.debug("rank %d: cannot signal pid %d: %s", rank, pid, e)
        main_threads = {rank: (snapshots[rank] or {}).get("main_thread") for rank in asked}
        stacks = _await_stacks(attempt, main_threads)
        others = [r for r in range(attempt.world_size) if r not in attempt.ranks]
        note = ""
        if others and store_address is not None:
            try:
                snapshots.update(_posted_progress(store_address, others, self._secret))
            except Exception as e:  # noqa: BLE001 - the store is gone: report this node's ranks
                where = describe(store_address)
                note = f"\n  (the ranks of other nodes could not be read from the workers' store at {where}: {e})"
        text = format_hang_report(snapshots, stacks, now=time.time(), stalled_s=stalled_s,
                                  timeout_s=self.timeout_s, library_paths=_library_paths(),
                                  remote=[r for r in others if r in snapshots])
        return text + note


def _posted_progress(address: StoreAddress, ranks: list[int],
                     secret: bytes | None) -> dict[int, dict[str, Any] | None]:
    """The progress ``ranks`` posted in the workers' store (Note [a hang on another node])."""
    client = connect(address, 5.0)
    where = f"the workers' store at {describe(address)}"
    store = client if secret is None else SignedStore(client, secret, where)
    out: dict[int, dict[str, Any] | None] = {}
    for rank in ranks:
        key = progress_key(rank)
        out[rank] = json.loads(store.get(key).decode()) if store.check([key]) else None
    return out


def _await_stacks(attempt: Attempt, main_threads: Mapping[int, int | None]) -> dict[int, str]:
    """Each asked rank's dump, once it is whole (Note [whole dumps]), or what
    there is of it after STACKS_WAIT_S."""
    deadline = time.monotonic() + STACKS_WAIT_S
    stacks: dict[int, str] = {}
    seen: dict[int, str] = {}
    while True:
        late = time.monotonic() > deadline
        for rank, main in main_threads.items():
            if rank in stacks:
                continue
            text = _read_text(attempt.ranks[rank].stacks)
            if "most recent call first" in text and (late or (text == seen.get(rank) and _has_thread(text, main))):
                stacks[rank] = text
            seen[rank] = text
        if len(stacks) == len(main_threads) or late:
            return stacks
        time.sleep(0.05)


def _has_thread(dump: str, ident: int | None) -> bool:
    """Whether ``dump`` has the block of thread ``ident`` (any block when unknown)."""
    return ident is None or f"hread 0x{ident:016x} (most recent call first)" in dump


def _library_paths() -> tuple[str, ...]:
    # The standard library, installed packages (torch) and tandem itself (the
    # package this module sits in, found without importing its top level).
    found = sysconfig.get_paths()
    tandem_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = {found["stdlib"], found["purelib"], found["platlib"], tandem_dir}
    return tuple(sorted(p for p in paths if p))


def _has_progressed(snapshot: Mapping[str, Any] | None) -> bool:
    """Whether the worker has completed a collective or begun a step (its
    progress file says so), which a worker still starting has not."""
    return snapshot is not None and (snapshot.get("completed", 0) > 0 or snapshot.get("step", 0) > 0)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
