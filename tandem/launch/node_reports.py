"""What a node's launcher tells its workers' store: its beat, and its workers'
exits: :class:`NodeReports` (Note [deaths seen at once] in tandem/comm/process_id.py).

The store's host may be another node, over a link that may be cut: a store
call there can stall for its timeout, and the agent's health check, which saw
an exit, must not stall with it. So one thread of its own writes the reports,
in order, through a client of its own: the node's beat every
:data:`NODE_BEAT_S` (:data:`NODE_BEAT_ON_ETCD_S` on etcd), and at once when a
worker ends (the beat then names its pid), with the worker's exit notice
beside it.

On etcd a beat is a write through Raft, which costs the members far more
than a TCPStore's ``set`` costs its server (BENCHMARKS.md, the control plane
on etcd). A beat only has to land well within the liveness window, and the
window on etcd is at least :data:`~tandem.control.elastic_group.MIN_STALE_ON_ETCD_S` (Note [a window
longer than a failover] in tandem/control/elastic_group.py): a beat a second
is six to a window there. A worker's end is written at once either way.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from tandem.store.job_secret import SignedStore
from tandem.control.elastic_group import MIN_STALE_ON_ETCD_S
from tandem.store.store_address import EtcdAddress, StoreAddress, connect, describe
from tandem.comm.process_id import NodeBeat, ProcessId, node_beat_key, write_exit_notice

__all__ = ["NODE_BEAT_ON_ETCD_S", "NODE_BEAT_S", "NodeReports", "beat_period"]

logger = logging.getLogger(__name__)

_CONNECT_S = 5.0
NODE_BEAT_S = 0.25
"""How often a node's launcher beats for its workers (the members' default ``beat_s``)."""
NODE_BEAT_ON_ETCD_S = MIN_STALE_ON_ETCD_S / 6
"""How often it beats in a store on etcd (the module's docstring)."""

_Address = StoreAddress


@dataclass(frozen=True)
class _NewStore:
    """Beat in the store at ``address`` from now on (None: beat where it beats)."""

    address: _Address | None


@dataclass(frozen=True)
class _Ended:
    """A worker ended: the store to tell, its pid, how."""

    address: _Address
    pid: int
    what: str


class NodeReports:
    """Beats for this node's workers in their store, and tells it when one ends, from a daemon thread.

    Args:
        node: this node's name in the store (``TANDEM_NODE`` of its workers).
        secret: the job secret the reports are signed with (Note [signed store] in job_secret.py).
    """

    def __init__(self, node: str, secret: bytes | None = None) -> None:
        self.node = node
        self._secret = secret
        # a new attempt's store to beat in, a worker that ended, or the end
        self._queue: queue.SimpleQueue[_NewStore | _Ended | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._client: tuple[_Address, dist.Store] | None = None
        self._address: _Address | None = None  # the store beaten in
        self._ended: dict[int, str] = {}  # this attempt's workers that ended

    @classmethod
    def of_this_node(cls, secret: bytes | None = None) -> NodeReports:
        """This launcher's reports, named by its kernel and pid (two launchers may share a kernel)."""
        me = ProcessId.this_process()
        return cls(f"{me.kernel}.{me.pid}" if me is not None else f"pid{os.getpid()}", secret)

    def beat_in(self, store_address: _Address | None) -> None:
        """Beat in the workers' store at ``store_address`` from now on (a new attempt's)."""
        if store_address is not None:
            self._start()
            self._queue.put(_NewStore(store_address))

    def post(self, store_address: _Address | None, pid: int, what: str) -> None:
        """Tell the workers meeting in the store at ``store_address`` that ``pid`` ended (``what``)."""
        if store_address is None:
            return
        self._start()
        self._queue.put(_Ended(store_address, pid, what))

    def stop(self) -> None:
        """Let the reports under way be written, for a moment at most."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=1.0)
            self._thread = None

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tandem-node-reports", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        next_beat = time.monotonic()
        while True:
            item: _NewStore | _Ended | None
            try:
                item = self._queue.get(timeout=max(0.0, next_beat - time.monotonic()))
            except queue.Empty:
                item = _NewStore(None)  # time to beat
            if item is None:
                return
            if isinstance(item, _Ended):  # a worker ended
                if item.address != self._address:
                    self._address, self._ended = item.address, {}
                self._ended[item.pid] = item.what
            elif item.address is not None:  # a new attempt's store
                self._address, self._ended = item.address, {}
            if self._address is not None:  # the beat first: it is what the members read
                self._write(_set, node_beat_key(self.node), NodeBeat(time.time(), dict(self._ended)).encode())
            if isinstance(item, _Ended):
                self._write(write_exit_notice, item.pid, item.what)
            next_beat = time.monotonic() + beat_period(self._address)

    def _write(self, call: Callable[..., None], *args: object) -> None:
        """``call(the store, *args)``; a failure is logged and the next call connects again."""
        address = self._address
        assert address is not None
        try:
            call(self._store(address), *args)
        except Exception as e:  # noqa: BLE001 - the workers' heartbeat window still sees the death
            logger.debug("could not report to the workers' store at %s: %s", describe(address), e)
            self._client = None

    def _store(self, address: _Address) -> dist.Store:
        if self._client is None or self._client[0] != address:
            store = connect(address, _CONNECT_S)
            self._client = (address, store if self._secret is None
                            else SignedStore(store, self._secret, f"the workers' store at {describe(address)}"))
        return self._client[1]


def beat_period(address: _Address | None) -> float:
    """How often a node beats in the store at ``address`` (the module's docstring)."""
    return NODE_BEAT_ON_ETCD_S if isinstance(address, EtcdAddress) else NODE_BEAT_S


def _set(store: dist.Store, key: str, value: str) -> None:
    store.set(key, value)
