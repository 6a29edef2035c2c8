"""A TCP store that listens on the job's address only: :func:`listening_store`.

# Note [a store on the job's address]
torch's ``TCPStore`` server ignores the host it is given and listens on every
interface ("::" or 0.0.0.0): a job on a laptop in a café, or on a cluster
node with a public interface, lets anyone who can reach the machine into its
store, and a store decides who is in a job (Note [signed store] in
job_secret.py). torch's constructor also takes a socket that is already
listening (``master_listen_fd``); tandem binds that socket itself, to the
address the store's clients are told, and hands it over: a job of one node
uses 127.0.0.1 and never leaves loopback.

Binding to the wrong address would lock the job out, so the store listens on
every interface as torch's does, with a warning that names the address to
give instead, where the address is not this machine's, or where a host name
resolves to loopback here while clients come from other nodes (many
``/etc/hosts`` map the host's own name to 127.0.1.1). The same happens on a
torch whose ``TCPStore`` takes no listening socket.
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import logging
import os
import socket

import torch.distributed as dist

__all__ = ["bind_address", "listening_store", "names_loopback"]

logger = logging.getLogger(__name__)

_BACKLOG = 2048


def bind_address(host: str, *, many_nodes: bool = False) -> tuple[socket.AddressFamily, str] | None:
    """The address family and address to listen on for clients told ``host``;
    None when ``host`` is not an address of this machine, or is loopback while
    the clients are on ``many_nodes`` (Note [a store on the job's address])."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        address = str(sockaddr[0])
        if many_nodes and not names_loopback(host) and ipaddress.ip_address(address.split("%")[0]).is_loopback:
            return None  # a host name this machine resolves to itself
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((address, 0))
        except OSError:
            continue  # not an address of this machine
        return family, address
    return None


def names_loopback(host: str) -> bool:
    """``host`` says loopback itself (every node on this machine), rather than resolving to it."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def listening_store(host: str, port: int, *, timeout: datetime.timedelta, world_size: int | None = None,
                    wait_for_workers: bool = False, multi_tenant: bool = False,
                    many_nodes: bool = False) -> dist.TCPStore:
    """A ``TCPStore`` server at ``host:port`` (``port`` 0: a free one; the
    store's ``port`` says which) listening on ``host``'s address only (Note [a
    store on the job's address]); ``many_nodes``: clients on other nodes
    connect to it."""
    bound = bind_address(host, many_nodes=many_nodes)
    if bound is not None:
        family, address = bound
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((address, port))
            listener.listen(_BACKLOG)
        except OSError as e:
            listener.close()
            name = errno.errorcode.get(e.errno or 0, "")
            raise dist.DistNetworkError(f"the store cannot listen on {address}:{port}: {e.strerror} "
                                        f"({name})") from e
        # The store owns (and closes) the descriptor it is given, also when it fails: give it a copy.
        try:
            return dist.TCPStore(host, listener.getsockname()[1], world_size, True, timeout,
                                 wait_for_workers=wait_for_workers, multi_tenant=multi_tenant,
                                 master_listen_fd=os.dup(listener.fileno()), use_libuv=True)
        except TypeError as e:  # a torch whose TCPStore takes no listening socket
            logger.debug("tandem: TCPStore takes no listening socket here (%s)", e)
        finally:
            listener.close()
    else:
        logger.warning("tandem: the store for %s:%d listens on every interface: %r is not an address of "
                       "this machine that the other nodes can reach (give the launcher or MASTER_ADDR this "
                       "node's own address to keep the store off the other interfaces)", host, port, host)
    return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=wait_for_workers,
                         multi_tenant=multi_tenant)
