"""This process's watch over its collectives: the ledger, the heartbeat, the
progress file the launcher's watchdog reads, and debug mode.

# Note [one monitor per process]
The ledger answers "where is this process?", a question about the whole
process: every group, every wrapper (DDP, ZeRO, fully_shard, metrics) and every
layer of the library issue collectives into the same sequence. So the monitor
is per process, not per object: :func:`start_monitor` (called by
:func:`tandem.init`) builds it for the default process group,
:func:`stop_monitor` (called by :func:`tandem.shutdown`) ends it, and
:func:`current_monitor` returns it, building one on first use when the group
was initialised by torch directly. This is the one module-level holder in
tandem; it holds no configuration of its own, only what the process group and
the launcher's variables decide.

Variables it reads (set by ``tandem run`` for its workers, or by a user):

``TANDEM_PROGRESS_FILE``  where to write this rank's progress (JSON), a few
                          times a second while it makes progress, and once
                          more, marked finished, when the rank leaves (Note
                          [finishing] in tandem/launch/watchdog.py); in a job of
                          several ranks it is also posted in the job's store,
                          at most once a second (Note [a hang on another node]
                          in tandem/launch/watchdog.py)
``TANDEM_STACKS_FILE``    where ``faulthandler`` writes every thread's Python
                          stack when the process gets SIGUSR1
``TANDEM_DEBUG``          ``collectives``: compare fingerprints before each
                          collective (:mod:`tandem.comm.fingerprint`)
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch.distributed as dist

from tandem._compat import default_store, own_tcp_client
from tandem.comm.cut_off import CutOffWatch, connection_closed, cut_off_after, lost_store_message
from tandem.comm.fingerprint import FingerprintCheck, debug_flags
from tandem.store.job_secret import signed, signed_like
from tandem.comm.ledger import Ledger
from tandem.store.store_address import etcd_client
from tandem.comm.thread_exit import join_before_exit
from tandem.comm.timeouts import DEFAULT_TIMEOUT
from tandem.comm.peers import (DEFAULT_LIVENESS, EXITED, HEARTBEAT_INTERVAL_S, Liveness, PeerWatch, Waiter,
                               heartbeat_key, last_beat)

__all__ = ["Monitor", "PROGRESS_POST_S", "current_monitor", "current_monitor_if_any", "progress_key", "start_monitor",
           "stop_monitor"]

logger = logging.getLogger(__name__)

_PROGRESS_ENV = "TANDEM_PROGRESS_FILE"
_STACKS_ENV = "TANDEM_STACKS_FILE"
_EARLY_S = 0.001  # a tick that wakes this early still beats: the wait's own jitter


class Monitor:
    """The ledger, plus a daemon thread that beats in the store and writes the
    progress file (both only when there is somewhere to write).

    Args:
        rank: this process's global rank.
        world_size: the number of processes.
        store: the job's store for heartbeats and fingerprints (None: neither).
        progress_file: where to write progress snapshots (None: nowhere).
        stacks_file: where SIGUSR1 dumps the Python stacks (None: not installed).
        debug: compare fingerprints before each collective.
        timeout_s: the collective timeout, which bounds debug-mode waits.
        liveness: how often to beat, and when a silent peer is gone.
    """

    def __init__(self, *, rank: int, world_size: int, store: dist.Store | None,
                 progress_file: str | None = None, stacks_file: str | None = None,
                 debug: bool = False, timeout_s: float = 600.0, liveness: Liveness = DEFAULT_LIVENESS) -> None:
        self.rank = rank
        self.world_size = world_size
        self.pid = os.getpid()
        self.ledger = Ledger()
        # Under a job secret every key the monitor writes or reads is signed (Note [signed store]).
        raw, store = store, (signed(store) if store is not None else None)
        self.store = store
        self.liveness = liveness
        self.peers = PeerWatch(store, rank, liveness) if store is not None and world_size > 1 else None
        self.fingerprints = (FingerprintCheck(store, rank, self.peers, timeout_s)
                             if debug and self.peers is not None and store is not None else None)
        self._progress_file = Path(progress_file) if progress_file else None
        self._stacks_path = stacks_file
        self._stacks: IO[str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store_gone = threading.Event()  # no call goes to the store any more (Note [cut off])
        self._beats = 0
        self._landed = time.monotonic()   # when the last beat reached the store
        # Note [cut off] in cut_off.py: the beats have a connection of their own, and a
        # rank whose beats stop landing on a TCP store stops.
        own = ((own_tcp_client(raw) or etcd_client(raw))
               if self.peers is not None and raw is not None else None)
        self._beat_store = signed_like(store, own[0]) if own is not None and store is not None else store
        self._cut_off = (CutOffWatch(rank=rank, where=own[1], landed=lambda: self._landed,
                                     after_s=lambda: cut_off_after(self.liveness.stale_after_s))
                         if own is not None else None)
        self._written: tuple[int, int, int] | None = None
        self._posted: tuple[tuple[int, int, int] | None, float] = (None, 0.0)
        # Note [a hang on another node] in tandem/launch/watchdog.py: progress posted in the
        # store (below its prefixes), for the launchers of other nodes.
        posting = ((own_tcp_client(raw, below_prefixes=True) or etcd_client(raw, below_prefixes=True))
                   if progress_file and self.peers is not None and raw is not None else None)
        self._progress_store = signed_like(store, posting[0]) if posting is not None and store is not None else None
        self._p2p_waiters: dict[tuple[int, str, int], Waiter] = {}

    @property
    def store_address(self) -> str | None:
        """``host:port`` of the job's TCP store, watched for a cut (Note [cut off]); None otherwise."""
        return self._cut_off.where if self._cut_off is not None else None

    def lost_store(self, error: BaseException) -> str | None:
        """The line to print when ``error`` says the job's store is out of reach
        (Note [cut off] in cut_off.py), after which nothing more is asked of the
        store and the cut-off watch stays quiet (the caller ends the process,
        saying why); None when ``error`` says something else, or when another
        thread is already ending the process for it."""
        if self._cut_off is None:
            return None
        message = lost_store_message(self.rank, self._cut_off.where, error)
        if message is None:
            return None
        self._store_gone.set()
        return message if self._cut_off.claim() else None

    @property
    def debug(self) -> bool:
        return self.fingerprints is not None

    def p2p_waiter(self, peer: int, direction: str, group: Any = None) -> Waiter:
        """The thread that waits on this rank's sends to (``direction="send"``)
        or receives from ``peer`` in ``group``, in the order they complete (Note
        [late peers] in p2p.py): one per peer, direction and group, started on
        first use."""
        key = (peer, direction, id(group))
        if key not in self._p2p_waiters:
            self._p2p_waiters[key] = Waiter()
        return self._p2p_waiters[key]

    def start(self) -> None:
        if self._stacks_path:
            self._stacks = open(self._stacks_path, "w")  # noqa: SIM115 - held until stop()
            faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True)
        if self.peers is None and self._progress_file is None:
            return
        if self.peers is not None:
            try:
                self.peers.post_process()  # Note [deaths seen at once] in process_id.py
            except Exception as e:  # noqa: BLE001 - a lost store is reported by the waits
                logger.debug("rank %d: could not post its process id: %s", self.rank, e)
        self._beat()
        self._write_progress()
        self._thread = threading.Thread(target=self._run, name="tandem-monitor", daemon=True)
        self._thread.start()
        if self._cut_off is not None:
            self._cut_off.start()

    def stop(self, *, left: bool = True, beat: str = EXITED) -> None:
        """End the thread; with ``left``, leave ``beat`` as this rank's last, which
        tells its peers how it left (Note [how a rank left] in peers.py)."""
        self._stop.set()
        if self._cut_off is not None:
            self._cut_off.stop()
        if self._thread is not None:
            join_before_exit(self._thread, JOIN_S)  # Note [a store call in flight at exit]
            self._thread = None
        if left:  # Note [finishing] in tandem/launch/watchdog.py: the last word, marked as such
            self._write_progress(finished=True)
        if left and self.store is not None and self.peers is not None and not self._store_gone.is_set():
            if self.fingerprints is not None:
                self.fingerprints.post_shutdown()
            try:
                self.store.set(heartbeat_key(self.rank), beat)
            except Exception:  # noqa: BLE001 - the store may already be gone
                pass
        if self._stacks is not None:
            faulthandler.unregister(signal.SIGUSR1)
            self._stacks.close()
            self._stacks = None

    def set_liveness(self, liveness: Liveness) -> None:
        """Beat, and judge the peers' beats, by ``liveness`` from now on (every
        rank of the group sets the same)."""
        self.liveness = liveness
        if self.peers is not None:
            self.peers.liveness = liveness

    def _run(self) -> None:
        beaten = time.monotonic()
        # The progress file every tick, a beat every liveness.beat_s (an elastic job's, seconds apart).
        while not self._stop.wait(min(self.liveness.beat_s, HEARTBEAT_INTERVAL_S)):
            # The progress file first: a beat waits for the store's answer (Note [cut off]),
            # and the launcher's watchdog must not see a slow store as a stalled rank.
            self._write_progress()
            if time.monotonic() - beaten >= self.liveness.beat_s - _EARLY_S:
                beaten = time.monotonic()
                self._beat()

    def _beat(self) -> None:
        if self.peers is None or self._beat_store is None or self._store_gone.is_set():
            return
        self._beats += 1
        try:
            self._beat_store.set(heartbeat_key(self.rank), str(self._beats))
            # A set is sent without an answer; a check waits for the store's (Note [cut off]).
            if self._cut_off is not None and self._beat_store.check([heartbeat_key(self.rank)]):
                self._landed = time.monotonic()
        except Exception as e:  # noqa: BLE001 - a lost store is reported by the waits
            logger.debug("rank %d: heartbeat failed: %s", self.rank, e)
            if self._cut_off is not None and connection_closed(e):
                # Its connection is never made again: every later beat would fail
                # (each with torch's warning), until the silence stopped the rank.
                self._store_gone.set()
                self._cut_off.stop_now(e)

    def _write_progress(self, *, finished: bool = False) -> None:
        if self._progress_file is None:
            return
        ledger = self.ledger
        state = (ledger.issued, ledger.completed, ledger.step)
        if not finished:
            self._post_progress(state)
            if state == self._written:
                return
        self._written = state
        snapshot = {"rank": self.rank, "pid": self.pid, "host": socket.gethostname(),
                    "main_thread": threading.main_thread().ident, **ledger.snapshot()}
        if finished:
            snapshot["finished_at"] = time.time()
        tmp = self._progress_file.with_name(self._progress_file.name + ".tmp")
        try:
            tmp.write_text(json.dumps(snapshot))
            os.replace(tmp, self._progress_file)
        except OSError as e:
            logger.debug("rank %d: cannot write %s: %s", self.rank, self._progress_file, e)


    def _post_progress(self, state: tuple[int, int, int]) -> None:
        """Post a short snapshot in the store when the progress changed, at most
        once every PROGRESS_POST_S (Note [a hang on another node])."""
        last, at = self._posted
        now = time.monotonic()
        if (self._progress_store is None or state == last or now - at < PROGRESS_POST_S
                or self._store_gone.is_set()):
            return
        self._posted = (state, now)
        snapshot = {"rank": self.rank, "pid": self.pid, "host": socket.gethostname(),
                    "node": os.environ.get("GROUP_RANK"), **self.ledger.snapshot(last=2)}
        try:
            self._progress_store.set(progress_key(self.rank), json.dumps(snapshot))
        except Exception as e:  # noqa: BLE001 - a lost store is reported by the waits
            logger.debug("rank %d: cannot post progress: %s", self.rank, e)


JOIN_S = 2.0
"""How long :meth:`Monitor.stop` waits for the heartbeat's thread before leaving it to exit."""


PROGRESS_POST_S = 1.0
"""At most this often a rank's progress goes to the store."""


def progress_key(rank: int) -> str:
    """Where rank ``rank`` posts its progress, in the store below its prefixes."""
    return f"tandem/progress/{rank}"


# Note [one monitor per process]: the holder, with the pid and the default
# group's store it was built for (a forked child must not use its parent's
# thread; a group initialised again gets a new monitor).
_current: tuple[tuple[int, int], Monitor] | None = None


def _owner() -> tuple[int, int]:
    return os.getpid(), id(default_store())


def start_monitor(*, timeout_s: float, environ: Mapping[str, str] | None = None,
                  liveness: Liveness = DEFAULT_LIVENESS) -> Monitor:
    """Build and start this process's monitor for the default process group
    (replacing one left from an earlier group)."""
    global _current
    stop_monitor(left=False)
    env = os.environ if environ is None else environ
    world_size = dist.get_world_size()
    monitor = Monitor(
        rank=dist.get_rank(), world_size=world_size,
        store=default_store() if world_size > 1 else None,
        progress_file=env.get(_PROGRESS_ENV) or None, stacks_file=env.get(_STACKS_ENV) or None,
        debug="collectives" in debug_flags(env), timeout_s=timeout_s, liveness=liveness)
    monitor.start()
    _current = (_owner(), monitor)
    return monitor


def stop_monitor(*, left: bool = True, beat: str = EXITED) -> None:
    """Stop this process's monitor, if it has one; ``left`` and ``beat``: :meth:`Monitor.stop`."""
    global _current
    if _current is not None:
        (pid, _), monitor = _current
        _current = None
        if pid == os.getpid():
            monitor.stop(left=left, beat=beat)


def current_monitor_if_any() -> Monitor | None:
    """This process's monitor, if it has one (never starts one)."""
    if _current is not None and _current[0][0] == os.getpid():
        return _current[1]
    return None


def current_monitor() -> Monitor:
    """This process's monitor; started on first use if :func:`tandem.init` did not."""
    if _current is not None and _current[0] == _owner():
        return _current[1]
    return start_monitor(timeout_s=DEFAULT_TIMEOUT.total_seconds())


@atexit.register
def leave_at_exit() -> None:
    """Tell peers this rank left without tandem.shutdown(): run at exit, when
    its script returned or called sys.exit. Its collectives will never come,
    and its last beat says so (Note [how a rank left] in peers.py). After an
    uncaught exception the exit hook leaves instead, saying it raised, last of
    all (Note [exit on an uncaught exception] in exit.py)."""
    stop_monitor(left=True, beat=last_beat(shut_down=False))
