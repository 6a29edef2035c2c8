"""The nodes of an elastic job of several nodes, and where a node that comes
back joins it: :class:`NodeRoll`.

# Note [nodes of an elastic job]
torch's agents treat the nodes of a job as fixed. Two of its habits break an
elastic job of several nodes (both seen on namespace nodes, one killed):

- the exit barrier: a node whose workers finished waits until every node of the
  rendezvous round has arrived, for up to 300 s. A node lost for good never
  arrives, so the survivors, done, wait out the barrier;
- a node started again after a loss enters a new rendezvous round. The
  running nodes would restart every worker from the checkpoint for it (torch's
  agents do, when a node waits), and with ``--nnodes 1:N`` the newcomer alone
  makes a round: a second job, which resumed from the first one's checkpoint
  and trained beside it.

So the launchers of an elastic job keep a roll in the rendezvous store (the
c10d endpoint), beside torch's keys, under ``tandem/nodes/<rdzv id>/``:

==================  ==========================================================
``workers``         ``host:port`` of the running attempt's workers' store,
                    written by the node that hosts it when its workers start,
                    removed when they end
``nodes``, ``node/<k>``  how many nodes ever joined, and the id of the k-th
``beat/<id>``       a node launcher's heartbeat (wall-clock time), every
                    :data:`BEAT_S`, from a thread with a connection of its own
``done/<id>``       that node's workers have finished
==================  ==========================================================

A node whose launcher finds ``workers`` set, and that store answering, joins
the running job instead of the rendezvous: its workers start as replacements
do (``TANDEM_ELASTIC_JOIN=1``, the store's address), and the members admit
them at a step boundary with the live state (Note [elastic membership] in
tandem/control/membership.py). At the end a node waits only for the nodes on the
roll that have neither finished nor gone silent for :data:`STALE_S`, and only
if it hosts a store the others use (the rendezvous store, or the workers'):
a node that hosts neither leaves at once, so the hosts leave last and no node
reads a store whose host has left.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

from tandem._compat import rendezvous_info
from tandem.store.job_secret import SignedStore, signed_like
from tandem.store.store_address import EtcdAddress, StoreAddress
from tandem.launch.etcd_plane import EtcdControlPlane
from tandem.launch.config import split_endpoint
from tandem.launch.tunnel import SecretDiffersError, Tunnels

__all__ = ["BEAT_S", "JoinRunningJob", "NodeRoll", "STALE_S"]

logger = logging.getLogger(__name__)

BEAT_S = 0.5
"""How often a node's launcher beats."""
STALE_S = 5.0
"""A node whose launcher has not beaten for this long is gone."""
_CONNECT_S = 5.0
_ETCD = "etcd:"  # a workers' store on the job's etcd cluster, by its prefix


class NodeRoll:
    """This node's place on the roll of an elastic job (Note [nodes of an elastic job]).

    Args:
        endpoint: the rendezvous store's ``host:port``.
        run_id: the job's rendezvous id.
        node_id: this node's id, unique in the job (default: its address or
            host name, and the launcher's pid).
        secret: the job secret, which signs the roll's keys and values.
        tunnels: the launcher's TLS tunnels, through which the stores of other
            nodes are reached (Note [stores behind TLS] in tunnel.py); None:
            they are reached directly.
    """

    def __init__(self, endpoint: str, run_id: str, node_id: str | None = None, *,
                 secret: bytes | None = None, tunnels: Tunnels | None = None,
                 plane: EtcdControlPlane | None = None) -> None:
        self.endpoint = endpoint
        self._tunnels = tunnels
        self._plane = plane
        self._secret = secret  # the roll's keys are signed with it (Note [signed store] in job_secret.py)
        self.prefix = f"tandem/nodes/{run_id}"
        self.node_id = node_id or f"{socket.gethostname()}-{os.getpid()}"
        self._store: dist.Store | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the store
    def _connect(self, timeout_s: float = _CONNECT_S) -> dist.Store:
        if self._store is None and self._plane is not None:  # Note [a replicated control plane]
            self._store = self._plane.store("nodes", datetime.timedelta(seconds=timeout_s))
        if self._store is None:
            host, port = self._reach(*split_endpoint(self.endpoint, "--rdzv-endpoint"), "the rendezvous store",
                                     timeout_s)
            client = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
            self._store = client if self._secret is None else SignedStore(
                client, self._secret, f"the rendezvous store at {self.endpoint}")
        return self._store

    def _reach(self, host: str, port: int, what: str, timeout_s: float) -> tuple[str, int]:
        if self._tunnels is None:
            return host, port
        return self._tunnels.reach(host, port, what, timeout_s=timeout_s)

    def _key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    # ------------------------------------------------------------------ a running job
    def running_job(self) -> StoreAddress | None:
        """The address of the running job's workers' store, when there is a
        running job whose store answers; None otherwise (then this node meets
        the others in the rendezvous).

        Raises:
            SecretDiffersError: the rendezvous store refused this node's TLS
                handshake (Note [stores behind TLS] in tunnel.py).
        """
        try:
            store = self._connect()
            if not store.check([self._key("workers")]):
                return None
            address = store.get(self._key("workers")).decode()
        except SecretDiffersError:
            raise
        except Exception as e:  # noqa: BLE001 - no store yet: this node is among the first
            logger.debug("no running job at %s: %s", self.endpoint, e)
            return None
        if address.startswith(_ETCD):  # on the job's etcd cluster, which has just answered
            assert self._plane is not None, "a job on etcd is joined with --rdzv-backend etcd"
            return self._plane.at(address[len(_ETCD):])
        host, port = split_endpoint(address, "the workers' store")
        try:
            dist.TCPStore(*self._reach(host, port, "the workers' store", _CONNECT_S), None, False,
                          datetime.timedelta(seconds=_CONNECT_S))
        except Exception as e:  # noqa: BLE001 - its host is gone: a job that no longer runs
            logger.info("the running job's workers' store at %s does not answer (%s)", address, e)
            return None
        return host, port

    def publish(self, address: StoreAddress) -> None:
        """This node hosts (or, on etcd, named) the workers' store at ``address``."""
        text = _ETCD + address.prefix if isinstance(address, EtcdAddress) else f"{address[0]}:{address[1]}"
        self._connect().set(self._key("workers"), text)

    # ------------------------------------------------------------------ beats
    def start(self) -> None:
        """Put this node on the roll and beat until :meth:`finish`."""
        store = self._connect()
        store.set(self._key("node", str(store.add(self._key("nodes"), 1))), self.node_id)
        raw = store.inner if isinstance(store, SignedStore) else store
        beats = signed_like(store, raw.clone()) if hasattr(raw, "clone") else store
        self._beat(beats)
        self._thread = threading.Thread(target=self._run, args=(beats,), name="tandem-node-beat", daemon=True)
        self._thread.start()

    def _run(self, store: dist.Store) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._beat(store)
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return

    def _beat(self, store: dist.Store) -> None:
        store.set(self._key("beat", self.node_id), repr(time.time()))

    def leave(self) -> None:
        """Stop beating and say this node is done, if it is not already (its
        workers failed, or it was stopped)."""
        if self._thread is None:
            return
        said = self._stop.is_set()   # finish() said it
        self._stop_beating()
        if said:
            return
        try:
            self._connect().set(self._key("done", self.node_id), "1")
        except Exception as e:  # noqa: BLE001 - the store is gone or out of reach: the beat goes stale
            logger.debug("could not mark %s done: %s", self.node_id, e)

    def _stop_beating(self) -> None:
        """Stop the beat, and wait for one under way: at once when the store's
        host is gone; for at most 2 s on a cut link (Note [ending the launcher]
        in cli.py)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=4 * BEAT_S)

    def finish(self, timeout_s: float, *, hosted_workers: bool, hosts_endpoint: bool) -> list[str]:
        """Say this node's workers finished; if it hosts a store (``hosted_workers``:
        the running job's workers', whose address it takes down first;
        ``hosts_endpoint``: the rendezvous store), wait until every other node
        on the roll has finished too or is gone. Returns the nodes still
        running at the timeout (empty when none)."""
        self._stop_beating()
        store = self._connect()
        try:
            store.set(self._key("done", self.node_id), "1")
            if hosted_workers:
                store.delete_key(self._key("workers"))
            if not (hosted_workers or hosts_endpoint):
                return []
        except Exception as e:  # noqa: BLE001 - the rendezvous host is gone: nobody to wait for
            logger.info("the rendezvous store at %s is gone (%s): not waiting for other nodes", self.endpoint, e)
            return []
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                running = self._running_nodes(store)
            except Exception:  # noqa: BLE001 - as above
                return []
            if not running or time.monotonic() > deadline:
                return running
            time.sleep(BEAT_S / 2)

    def exit_barrier(self, handler: RendezvousHandler, timeout_s: float, *, hosts_endpoint: bool) -> None:
        """An agent's exit barrier: :meth:`finish`, hosting the workers' store
        where ``handler`` (a :class:`~tandem.launch.rendezvous.FreshWorkerStore`)
        says so; a warning names the nodes still running at the timeout."""
        hosted = getattr(handler, "hosted", None) is not None
        running = self.finish(timeout_s, hosted_workers=hosted, hosts_endpoint=hosts_endpoint)
        if running:
            logger.warning("nodes %s still ran after %.0f s; not waiting longer", running, timeout_s)

    def _running_nodes(self, store: dist.Store) -> list[str]:
        count = store.add(self._key("nodes"), 0)
        ids = [store.get(self._key("node", str(k))).decode() for k in range(1, count + 1)]
        ids = [i for i in ids if i != self.node_id]
        now = time.time()
        running = []
        for node in ids:
            if store.check([self._key("done", node)]):
                continue
            beat = self._key("beat", node)
            if store.check([beat]) and now - float(store.get(beat).decode()) <= STALE_S:
                running.append(node)
        return running


class JoinRunningJob(RendezvousHandler):
    """The "rendezvous" of a node that joins a running elastic job: no meeting;
    this node is a group of its own whose workers meet the job in its workers'
    store at ``address`` (Note [nodes of an elastic job]); on etcd, the launcher
    hands the workers the address itself (Note [the workers' store on etcd] in
    tandem/store/store_address.py)."""

    def __init__(self, address: StoreAddress, run_id: str) -> None:
        self._host, self._port = ("127.0.0.1", 0) if isinstance(address, EtcdAddress) else address
        self._run_id = run_id
        self._store = dist.HashStore()
        self.workers_store = address

    def get_backend(self) -> str:
        return "tandem-join"

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        return rendezvous_info(self._store, 0, 1, self._host, self._port)

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        return True
