"""The launcher tells the workers of an elastic job that one of them has ended:
:class:`ExitNotices` (Note [deaths seen at once] in tandem/comm/process_id.py).

The notice goes to the workers' store, whose host may be another node, over a
link that may be cut: a store call there can stall for its timeout, and the
agent's health check, which saw the exit, must not stall with it. So one
thread of its own writes the notices, in order, through a client of its own.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading

import torch.distributed as dist

from tandem.comm.job_secret import SignedStore
from tandem.comm.process_id import write_exit_notice

__all__ = ["ExitNotices"]

logger = logging.getLogger(__name__)

_CONNECT_S = 5.0


class ExitNotices:
    """Writes "worker ``pid`` has ended" to the workers' store, from a daemon thread."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret  # the notices are signed with it (Note [signed store] in job_secret.py)
        self._queue: queue.SimpleQueue[tuple[tuple[str, int], int, str] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._client: tuple[tuple[str, int], dist.Store] | None = None

    def post(self, store_address: tuple[str, int] | None, pid: int, what: str) -> None:
        """Tell the workers meeting in the store at ``store_address`` that ``pid`` ended (``what``)."""
        if store_address is None:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tandem-exit-notices", daemon=True)
            self._thread.start()
        self._queue.put((store_address, pid, what))

    def stop(self) -> None:
        """Let the notices under way be written, for a moment at most."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=1.0)
            self._thread = None

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            address, pid, what = item
            try:
                write_exit_notice(self._store(address), pid, what)
            except Exception as e:  # noqa: BLE001 - the heartbeat window still sees the death
                logger.debug("could not post the exit of pid %d to %s:%d: %s", pid, *address, e)
                self._client = None

    def _store(self, address: tuple[str, int]) -> dist.Store:
        if self._client is None or self._client[0] != address:
            store = dist.TCPStore(address[0], address[1], is_master=False,
                                  timeout=datetime.timedelta(seconds=_CONNECT_S), wait_for_workers=False)
            self._client = (address, store if self._secret is None
                            else SignedStore(store, self._secret, f"the workers' store at {address[0]}:{address[1]}"))
        return self._client[1]
