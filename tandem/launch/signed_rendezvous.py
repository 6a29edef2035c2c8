"""torch's rendezvous handlers with their store on the job's address and, under
a job secret, their state signed: :func:`rendezvous_handler`.

# Note [the rendezvous' state]
torch's c10d rendezvous keeps its state (the round, who waits, who takes
part) under one key of its store, ``torch.rendezvous.<run id>``, as a pickle,
and every node's launcher reads and unpickles it about once a second. The
run id is no secret (it is on the command line), so whoever reached the
store's port could set that key and run code in every launcher. torch's
handler takes the backend that holds its state as an argument, so tandem
builds it with its own pieces and changes nothing else:

* the store is a :func:`~tandem.store.listening_store.listening_store` on the
  endpoint's address (Note [a store on the job's address]), and so is the one
  torch's handler starts for the workers (unused by tandem, which gives each
  attempt a store of its own);
* under a job secret, torch's own c10d backend keeps the state in a
  :class:`~tandem.store.job_secret.SignedStore` (Note [signed store]): the
  key's name is an HMAC a stranger cannot make, and the value carries an HMAC
  checked before torch decodes it; a value that fails is refused, and the
  rendezvous reports it as a failed store call.

With tunnels (a job of several nodes: Note [stores behind TLS] in
tunnel.py) the store listens on 127.0.0.1 of its host, which serves it on the
endpoint behind TLS, and every other node reaches it through its own tunnel.

The static rendezvous (``--master-port``) keeps no pickle; its store is
listened for in the same way. torch's agent's own keys in the round's store
(rank assignment, the exit barrier) are JSON and counters: a stranger there
can stop a job, not run code in it.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from tandem._compat import matches_machine_hostname, preset_static_store, share_listening_store
from tandem.store.job_secret import SignedStore
from tandem.store.listening_store import listening_store
from tandem.launch.etcd_plane import EtcdControlPlane
from tandem.launch.tunnel import Tunnels, free_port

__all__ = ["rendezvous_handler"]

_C10D_PORT = 29400  # torch's default for an endpoint without a port
_LOOPBACK = "127.0.0.1"
_STATIC_TIMEOUT_S = 600  # torch's static rendezvous' default store timeout


def rendezvous_handler(params: RendezvousParameters, *, secret: bytes | None,
                       many_nodes: bool, tunnels: Tunnels | None = None,
                       plane: EtcdControlPlane | None = None) -> RendezvousHandler:
    """torch's handler for ``params``, with its store listening on the
    endpoint's address (or behind ``tunnels``' TLS) and, under ``secret``, its
    state signed (Note [the rendezvous' state]); ``many_nodes``: nodes other
    than this one may take part. With ``plane``, torch's c10d handler keeps
    its state and its rounds' stores on the job's etcd cluster (Note [a
    replicated control plane] in etcd_plane.py): TLS with client certificates
    keeps strangers out, so nothing is signed."""
    if plane is not None:
        timeout = datetime.timedelta(seconds=int(params.get_as_int("read_timeout", 60) or 60))
        on_etcd = plane.store("rdzv", timeout)
        etcd_handler = create_handler(on_etcd, C10dRendezvousBackend(on_etcd, params.run_id), params)
        # The store torch would share with the workers: unused (they meet on etcd), kept off the network.
        share_listening_store(etcd_handler, lambda addr, port: listening_store(
            _LOOPBACK, port, timeout=timeout, multi_tenant=True, many_nodes=False))
        return etcd_handler
    if params.backend == "static":
        handler = get_rendezvous_handler(params)
        host, port = parse_rendezvous_endpoint(params.endpoint, -1)
        store_timeout = datetime.timedelta(seconds=int(params.config.get("timeout", _STATIC_TIMEOUT_S)))
        if int(params.config["rank"]) == 0:
            if tunnels is not None:  # served first: the store waits for every node's client
                host, port = _LOOPBACK, free_port(_LOOPBACK)
                tunnels.serve(*parse_rendezvous_endpoint(params.endpoint, -1), port, "the rendezvous store")
            preset_static_store(handler, listening_store(host, port, timeout=store_timeout,
                                                         world_size=params.max_nodes, wait_for_workers=True,
                                                         multi_tenant=True, many_nodes=many_nodes))
        elif tunnels is not None:
            local = tunnels.reach(host, port, "the rendezvous store", timeout_s=store_timeout.total_seconds())
            preset_static_store(handler, dist.TCPStore(*local, params.max_nodes, False, store_timeout,
                                                       multi_tenant=True))
        return handler
    if params.backend != "c10d" or params.get("store_type", "tcp").strip().lower() != "tcp":
        return get_rendezvous_handler(params)
    read_timeout = int(params.get_as_int("read_timeout", 60) or 60)
    if read_timeout <= 0:
        raise ValueError(f"read_timeout={read_timeout} must be a positive number of seconds")
    timeout = datetime.timedelta(seconds=read_timeout)
    store = _c10d_store(params, timeout=timeout, many_nodes=many_nodes, tunnels=tunnels)
    state_store: dist.Store = store
    if secret is not None:
        state_store = SignedStore(store, secret, f"the rendezvous store at {params.endpoint}")
    handler = create_handler(store, C10dRendezvousBackend(state_store, params.run_id), params)
    # tandem gives the workers a store of its own (Note [one store per attempt] in rendezvous.py)
    share_listening_store(handler, lambda addr, port: listening_store(
        addr if many_nodes and tunnels is None else _LOOPBACK, port, timeout=timeout, multi_tenant=True,
        many_nodes=many_nodes))
    return handler


def _c10d_store(params: RendezvousParameters, *, timeout: datetime.timedelta, many_nodes: bool,
                tunnels: Tunnels | None) -> dist.TCPStore:
    """The c10d rendezvous' store as torch makes it (the host by ``is_host`` or
    by host name; a would-be host that finds the port taken connects to it),
    hosted by :func:`listening_store`, behind ``tunnels`` when given."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=_C10D_PORT)
    said = params.get_as_bool("is_host")
    is_host = said if said is not None else matches_machine_hostname(host)
    if is_host:
        try:
            if tunnels is None:
                return listening_store(host, port, timeout=timeout, multi_tenant=True, many_nodes=many_nodes)
            hosted = listening_store(_LOOPBACK, 0, timeout=timeout, multi_tenant=True)
            tunnels.serve(host, port, hosted.port, "the rendezvous store")
            return hosted
        except (OSError, RuntimeError, ValueError) as e:
            if said is not None:
                raise RendezvousConnectionError(
                    f"this node was told to host the rendezvous store at {host}:{port} and cannot: {e}") from e
    if tunnels is not None:
        host, port = tunnels.reach(host, port, "the rendezvous store", timeout_s=timeout.total_seconds())
    try:
        return dist.TCPStore(host, port, None, False, timeout)
    except (RuntimeError, ValueError, TimeoutError) as e:
        raise RendezvousConnectionError(f"the rendezvous store at {host}:{port} cannot be reached: {e}") from e
