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
(see Note [free port] in :mod:`tandem.launch.flags`), publishes the port in the
rendezvous store, and every node hands that address to its workers. The previous
attempt's store is closed when the next one opens. Process management, the
rendezvous itself and the agent's own store stay torch's.

Where the port is published: the c10d rendezvous returns a store scoped to the
rendezvous round, so a fixed key is fresh in every round (and a node that joins
late reads the same key as the others). The static rendezvous returns the same
store every time; its nodes restart together, so the key carries the attempt
number.
"""

from __future__ import annotations

import datetime
import logging

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

from tandem._compat import rendezvous_info

__all__ = ["FreshWorkerStore"]

logger = logging.getLogger(__name__)

_PORT_KEY = "tandem/worker_store_port"


class FreshWorkerStore(RendezvousHandler):
    """torch's rendezvous handler ``inner``, with a new store for each attempt's
    workers (see Note [one store per attempt])."""

    def __init__(self, inner: RendezvousHandler, *, timeout: datetime.timedelta) -> None:
        self._inner = inner
        self._timeout = timeout
        self._server: dist.TCPStore | None = None
        self._attempt = 0

    def get_backend(self) -> str:
        return self._inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        # The workers connect to the store made here as clients.
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        self._attempt += 1
        key = _PORT_KEY
        if self.get_backend() == "static":
            key = f"{_PORT_KEY}/{self._attempt}"
        bootstrap = info.bootstrap_store_info
        if bootstrap is None:
            raise RuntimeError(f"the {self.get_backend()} rendezvous returned no store address for "
                               "the workers; tandem needs torch's RendezvousInfo with "
                               "bootstrap_store_info (torch 2.4 or later)")
        addr = bootstrap.master_addr
        if info.rank == 0:
            self._server = None  # close the previous attempt's store before opening the next
            self._server = dist.TCPStore(addr, 0, None, True, self._timeout,
                                         wait_for_workers=False)
            info.store.set(key, str(self._server.port))
        port = int(info.store.get(key).decode())
        logger.debug("attempt %d: workers meet in a fresh store at %s:%d", self._attempt, addr, port)
        return rendezvous_info(info.store, info.rank, info.world_size, addr, port)

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        self._server = None
        return self._inner.shutdown()
