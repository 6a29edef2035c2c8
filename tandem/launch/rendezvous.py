"""A fresh store for every attempt's workers: :class:`FreshWorkerStore`.

# Note [one store per attempt]
The elastic agent gives its workers ``MASTER_ADDR``/``MASTER_PORT`` of a store
hosted by node 0's agent, and ``TORCHELASTIC_USE_AGENT_STORE=True`` so that
``init_process_group`` connects to it as a client. The agent keeps that store
for its whole life (the static rendezvous always has; the c10d one since torch
shares its TCPStore with the workers, 2.13 included): after a restart the new
workers meet in the same store, where the dead attempt's keys (gloo's peer
addresses, the barrier counters under ``default_pg/``) are still set. They then
read the old addresses and fail to connect, or wait for a barrier that has
already counted past them. Plain ``torchrun --max-restarts 1`` fails this way
after a worker is killed.

:class:`FreshWorkerStore` wraps torch's own rendezvous handler and changes one
thing: after each rendezvous node 0 starts a new ``TCPStore`` on a free port
(see Note [free port] in :mod:`tandem.launch.config`), publishes the port in the
rendezvous store (signed under a job secret: Note [signed store] in
job_secret.py), and every node hands that address to its workers. A job of
one node keeps it on loopback (Note [a store on the job's address] in
listening_store.py); with tunnels (Note [stores behind TLS] in tunnel.py) it
listens on loopback and is served behind TLS at node 0's address, and the
workers of every other node meet in it through their launcher's tunnel. The previous
attempt's store is closed when the next one opens. Process management, the
rendezvous itself and the agent's own store stay torch's.

In a job of several nodes, torch's agent asks ``num_nodes_waiting`` at every
check of its workers (every 0.1 s), and the c10d handler answers from the
rendezvous store: over a cut link that call stalls, and the agent with it,
so that it would not see its own workers exit. There a thread asks once a
second and the agent reads its last answer (:class:`_WaitingNodes`).

Where the port is published: the c10d rendezvous returns a store scoped to the
rendezvous round, so a fixed key is fresh in every round (and a node that joins
late reads the same key as the others). The static rendezvous returns the same
store every time; its nodes restart together, so the key carries the attempt
number.
"""

from __future__ import annotations

import datetime
import logging
import threading
import uuid
from collections.abc import Callable, Mapping

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

from tandem._compat import rendezvous_info
from tandem.store.job_secret import SignedStore
from tandem.store.listening_store import listening_store
from tandem.store.store_address import StoreAddress
from tandem.launch.etcd_plane import EtcdControlPlane
from tandem.launch.tunnel import Tunnels

__all__ = ["FreshWorkerStore"]

logger = logging.getLogger(__name__)

_PORT_KEY = "tandem/worker_store_port"
_LOOPBACK = "127.0.0.1"
_POLL_S = 1.0
_STOP_S = 2.0


class FreshWorkerStore(RendezvousHandler):
    """torch's rendezvous handler ``inner``, with a new store for each attempt's
    workers (see Note [one store per attempt])."""

    def __init__(self, inner: RendezvousHandler, *, timeout: datetime.timedelta,
                 poll_waiting: bool = False, many_nodes: bool = True, secret: bytes | None = None,
                 tunnels: Tunnels | None = None, plane: EtcdControlPlane | None = None,
                 give_workers: Callable[[Mapping[str, str]], None] | None = None) -> None:
        self._inner = inner
        self._plane = plane
        self._give_workers = give_workers
        self._tunnels = tunnels
        self._many_nodes = many_nodes
        self._secret = secret
        self._waiting = _WaitingNodes(inner) if poll_waiting else None
        self._timeout = timeout
        self._server: dist.TCPStore | None = None
        self._attempt = 0
        self.hosted: StoreAddress | None = None
        """The workers' store's address, as other nodes are told it, while this node
        hosts it (its round's rank 0; on etcd, the node that named it)."""
        self.workers_store: StoreAddress | None = None
        """The address this node's processes reach the store this attempt's workers
        meet in at (with tunnels, on 127.0.0.1)."""
        self._public: tuple[str, int] | None = None  # the workers' store as the nodes are told it

    def get_backend(self) -> str:
        return self._inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        # The workers connect to the store made here as clients.
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        if self._waiting is not None:
            self._waiting.reset()  # the nodes that waited for this round are in it
        self._attempt += 1
        key = _PORT_KEY
        if self.get_backend() == "static":
            key = f"{_PORT_KEY}/{self._attempt}"
        bootstrap = info.bootstrap_store_info
        if bootstrap is None:
            raise RuntimeError(f"the {self.get_backend()} rendezvous returned no store address for "
                               "the workers; tandem needs torch's RendezvousInfo with "
                               "bootstrap_store_info (torch 2.4 or later)")
        # Note [a store on the job's address] in tandem/store/listening_store.py
        addr = bootstrap.master_addr if self._many_nodes else _LOOPBACK
        store = info.store if self._secret is None else SignedStore(info.store, self._secret, "the rendezvous store")
        if self._plane is not None:
            return self._on_etcd(info, store, key)
        if self._tunnels is not None and self._public is not None:
            self._tunnels.drop(*self._public)  # the previous attempt's tunnel
        if info.rank == 0:
            self._server = None  # close the previous attempt's store before opening the next
            if self._tunnels is None:
                self._server = listening_store(addr, 0, timeout=self._timeout, many_nodes=self._many_nodes)
                public = self._server.port
            else:
                self._server = listening_store(_LOOPBACK, 0, timeout=self._timeout)
                public = self._tunnels.serve(addr, 0, self._server.port, "the workers' store")
            store.set(key, str(public))
            self.hosted = (addr, public)
        port = int(store.get(key).decode())
        self._public = (addr, port)
        self.workers_store = self._public if self._tunnels is None else self._tunnels.reach(
            addr, port, "the workers' store", timeout_s=self._timeout.total_seconds())
        logger.debug("attempt %d: workers meet in a fresh store at %s:%d", self._attempt, addr, port)
        return rendezvous_info(info.store, info.rank, info.world_size, *self.workers_store)

    def _on_etcd(self, info: RendezvousInfo, store: dist.Store, key: str) -> RendezvousInfo:
        """The attempt's workers meet under a fresh prefix of the job's etcd
        cluster, which the round's rank 0 names (Note [the workers' store on
        etcd] in tandem/store/store_address.py)."""
        assert self._plane is not None
        if info.rank == 0:
            store.set(key, uuid.uuid4().hex)
        address = self._plane.address(f"workers/{store.get(key).decode()}")
        self.hosted = address if info.rank == 0 else None
        self.workers_store = address
        if self._give_workers is not None:
            self._give_workers(address.env())
        logger.debug("attempt %d: workers meet at %s", self._attempt, address)
        bootstrap = info.bootstrap_store_info
        assert bootstrap is not None
        return rendezvous_info(info.store, info.rank, info.world_size, bootstrap.master_addr, bootstrap.master_port)

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        if self._waiting is not None:
            return self._waiting.last()
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        if self._tunnels is not None and self._public is not None:
            self._tunnels.drop(*self._public)
        self._server = None
        self.hosted = None
        self.stop_polling()
        return self._inner.shutdown()

    def stop_polling(self) -> None:
        """Stop asking how many nodes wait, also when the rendezvous is left open
        (Note [ending the launcher] in cli.py)."""
        if self._waiting is not None:
            self._waiting.stop()


class _WaitingNodes:
    """``inner.num_nodes_waiting()`` asked by a thread of its own once every
    :data:`_POLL_S`, so that a stalled store stalls only it (see Note [one
    store per attempt])."""

    def __init__(self, inner: RendezvousHandler) -> None:
        self._inner = inner
        self._value = 0
        self._round = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-nodes-waiting", daemon=True)
        self._thread.start()

    def last(self) -> int:
        return self._value

    def reset(self) -> None:
        """A round has completed: no node waits, and an answer asked before does not count."""
        self._round += 1
        self._value = 0

    def stop(self) -> None:
        """Stop, and wait for a question under way to end: at once when the
        store's host is gone; for at most :data:`_STOP_S` on a cut link."""
        self._stop.set()
        self._thread.join(timeout=_STOP_S)

    def _run(self) -> None:
        while not self._stop.wait(_POLL_S):
            asked_in = self._round
            try:
                waiting = self._inner.num_nodes_waiting()
                if asked_in == self._round:
                    self._value = waiting
            except Exception as e:  # noqa: BLE001 - the store is gone or the link cut; the agent decides
                logger.debug("num_nodes_waiting failed: %s", e)
