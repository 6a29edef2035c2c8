"""What this machine offers the workers: CPU cores, GPUs, and the network
interface the other nodes reach it by.

Measured here, passed into the pure rules of :mod:`tandem.launch.config`.

# Note [the address a node gives]
gloo (and NCCL's bootstrap) advertise to the other nodes the address their
hostname resolves to; in many containers, and in every namespace of
``tandem.testing.Cluster``, that is 127.0.0.1, so the other nodes connect to
themselves ("Gloo connectFullMesh failed ... Connection refused,
remote=[127.0.0.1]"), although ``--local-addr`` said which address to use.
So a launcher of a job of several nodes gives its workers
``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``: the interface that holds
``--local-addr``, or else the one the route to the rendezvous host leaves by.
A name already set by the user wins; a loopback interface (every node on this
machine's loopback) is left to the defaults. Likewise torch's c10d
rendezvous hosts the store on the node whose hostname resolves to the
endpoint's host, which no node's does then: the node that holds the
endpoint's address is told so (``is_host``, agent.py).

The same name reaches the workers' store. torch's c10d rendezvous names each
node by ``--local-addr`` or else by its fully qualified host name, and the
first node to arrive hosts the workers' store under that name: where the
name is ``localhost``, every node's workers are told ``MASTER_ADDR=localhost``
and the store listens on loopback only, so the other nodes never reach it. So
a launcher of a job of several nodes always knows its address before the
rendezvous (:func:`node_address`): ``--local-addr``, or else this machine's
address on the route to the rendezvous host, which is the address the other
nodes reach it by whenever they reach the rendezvous host the same way. Where
that route stays on loopback although the rendezvous host is named by a host
name (``/etc/hosts`` maps it to this machine's loopback), the others cannot
reach this node there and tandem cannot tell which address they can: it stops
at once and asks for ``--local-addr``.
"""

from __future__ import annotations

import ipaddress
import os
import socket

from tandem.store.listening_store import names_loopback

__all__ = ["address_toward", "interface_of", "loopback_interface_env", "node_address", "socket_interface_env",
           "usable_cpus", "visible_gpus"]

_SIOCGIFADDR = 0x8915


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask, which container
    limits and ``taskset`` narrow), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def visible_gpus() -> int:
    """CUDA devices this process can see; 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface holding ``address`` (a
    host name or IPv4 address); None if none does (Linux only)."""
    try:
        import fcntl
        import struct

        target = socket.inet_aton(socket.gethostbyname(address))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    found = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))[20:24]
                except OSError:
                    continue  # no IPv4 address on it
                if found == target:
                    return name
    except (OSError, ImportError):
        return None
    return None


def address_toward(host: str, port: int) -> str | None:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except OSError:
        return None


def node_address(local_addr: str | None, rendezvous: tuple[str, int]) -> str:
    """This node's address as the other nodes of a job reach it (Note [the
    address a node gives]): ``local_addr`` (``--local-addr``) where given,
    else this machine's address on the route to the ``rendezvous`` host.

    Raises:
        ValueError: no route leads to the rendezvous host, or the route stays
            on loopback for a host given by name; the message asks for
            ``--local-addr``.
    """
    if local_addr:
        return local_addr
    host, port = rendezvous
    address = address_toward(host, port)
    if address is None:
        raise ValueError(f"this node has no route to the rendezvous host {host!r}, so tandem cannot tell "
                         "which address the other nodes reach this node by: check the address, or pass "
                         "--local-addr with this node's own address")
    if ipaddress.ip_address(address).is_loopback and not names_loopback(host):
        raise ValueError(f"the rendezvous host {host!r} is this machine's loopback ({address}) here, so "
                         "tandem cannot tell which address the other nodes reach this node by: pass "
                         "--local-addr with this node's own address (as the other nodes see it), or give "
                         "the rendezvous host by that address")
    return address


def socket_interface_env(local_addr: str | None, rendezvous: tuple[str, int],
                         environ: dict[str, str] | None = None) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` for the workers of a
    job across nodes (Note [the address a node gives]); empty where the
    interface is loopback or cannot be found, and without the names the user set."""
    env = os.environ if environ is None else environ
    address = local_addr or address_toward(*rendezvous)
    name = interface_of(address) if address else None
    if name is None or name == "lo" or (address or "").startswith("127."):
        return {}
    return {key: name for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if key not in env}


def loopback_interface_env(environ: dict[str, str] | os._Environ[str] | None = None) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` for the workers of a job of one node: the
    loopback interface, so that gloo's listeners stay off the machine's other
    interfaces (Note [a store on the job's address] in
    tandem/store/listening_store.py); empty where the user set it or no
    interface holds 127.0.0.1."""
    env = os.environ if environ is None else environ
    if "GLOO_SOCKET_IFNAME" in env:
        return {}
    name = interface_of("127.0.0.1")
    return {} if name is None else {"GLOO_SOCKET_IFNAME": name}
