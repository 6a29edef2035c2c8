"""Where a job's workers meet: a TCP store's ``(host, port)``, or a prefix on an
etcd cluster (:class:`EtcdAddress`); :func:`connect` reaches either.

# Note [the workers' store on etcd]
Under ``tandem run --rdzv-backend etcd`` (Note [a replicated control plane] in
tandem/launch/etcd_plane.py) the workers of an attempt meet under a prefix of
the job's etcd cluster instead of in a ``TCPStore`` that one node hosts. The
launcher tells them where in one variable, :data:`ETCD_STORE_ENV`: the
members' client addresses, the attempt's prefix and the directory that holds
this node's TLS identity (``ca.crt``, ``node.crt``, ``node.key``; the job
secret made them). ``tandem.init()`` then builds the default group over an
:class:`~tandem.store.etcd_store.EtcdStore` there, and everything the job keeps
in its store (the membership, the beats, each generation's group) is on every
etcd member: losing any one node loses none of it.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import torch.distributed as dist

from tandem.store.etcd_gateway import EtcdTLS
from tandem.store.etcd_store import EtcdStore
from tandem.store.job_secret import SignedStore

__all__ = ["ETCD_STORE_ENV", "EtcdAddress", "StoreAddress", "connect", "describe", "etcd_client", "store_ports"]

ETCD_STORE_ENV = "TANDEM_ETCD_STORE"
"""The workers' store on etcd, as JSON (Note [the workers' store on etcd])."""


@dataclass(frozen=True)
class EtcdAddress:
    """A prefix on an etcd cluster, and this node's TLS identity toward it."""

    endpoints: tuple[str, ...]
    """The members' client addresses, ``host:port``."""
    prefix: str
    """Every key of the store lives under it."""
    tls_dir: str | None = None
    """The directory with ``ca.crt``, ``node.crt`` and ``node.key``; None for plain HTTP."""

    def tls(self) -> EtcdTLS | None:
        if self.tls_dir is None:
            return None
        d = Path(self.tls_dir)
        return EtcdTLS(ca_file=d / "ca.crt", cert_file=d / "node.crt", key_file=d / "node.key")

    def store(self, timeout: datetime.timedelta) -> EtcdStore:
        """A client of the store, whose reads wait up to ``timeout``."""
        return EtcdStore(list(self.endpoints), self.prefix, timeout, self.tls())

    def env(self) -> dict[str, str]:
        """The variable that hands this address to a worker."""
        return {ETCD_STORE_ENV: json.dumps({"endpoints": list(self.endpoints), "prefix": self.prefix,
                                            "tls_dir": self.tls_dir})}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EtcdAddress | None:
        """The address in :data:`ETCD_STORE_ENV`; None when it is not set.

        Raises:
            ValueError: the variable is not what a launcher writes.
        """
        text = (os.environ if environ is None else environ).get(ETCD_STORE_ENV)
        if not text:
            return None
        try:
            data = json.loads(text)
            return cls(tuple(str(e) for e in data["endpoints"]), str(data["prefix"]), data.get("tls_dir"))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{ETCD_STORE_ENV}={text[:200]!r} is not a store address as `tandem run "
                             f"--rdzv-backend etcd` writes it ({e}); unset it, or launch with tandem run") from None

    def __str__(self) -> str:
        return f"{self.prefix} on the etcd cluster at {','.join(self.endpoints)}"


StoreAddress = Union[tuple[str, int], EtcdAddress]
"""A TCP store's ``(host, port)``, or an :class:`EtcdAddress`."""


def connect(address: StoreAddress, timeout_s: float) -> dist.Store:
    """A client of the store at ``address`` (a TCP store is connected to at once)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if isinstance(address, EtcdAddress):
        return address.store(timeout)
    return dist.TCPStore(address[0], address[1], None, False, timeout)


def describe(address: StoreAddress) -> str:
    """``host:port``, or the etcd prefix and members, for messages."""
    return str(address) if isinstance(address, EtcdAddress) else f"{address[0]}:{address[1]}"


def store_ports(store: dist.Store) -> set[int]:
    """The ports this process's connections to ``store`` (below its prefixes and
    signature) go to: a TCP store's, or every etcd member's client port; the
    connections to them are the store's, not a group's."""
    base = store.inner if isinstance(store, SignedStore) else store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        return {base.port}
    if isinstance(base, EtcdStore):
        return {int(e.rsplit(":", 1)[1]) for e in base.endpoints}
    return set()


def etcd_client(store: dist.Store, *, below_prefixes: bool = False) -> tuple[dist.Store, str] | None:
    """``store`` (with ``below_prefixes``: the etcd store below its prefixes) and
    the members' addresses, when an :class:`~tandem.store.etcd_store.EtcdStore` is
    below its prefixes; None otherwise. Its calls need no connection of their
    own: each thread has its own connections to the members (Note [failing over
    between etcd members] in etcd_gateway.py)."""
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if not isinstance(base, EtcdStore):
        return None
    return (base if below_prefixes else store), ",".join(base.endpoints)
