"""Nodes that came to one rendezvous with different job secrets are told so:
:class:`SecretCheck`.

# Note [another secret at the rendezvous]
(With ``--open-stores`` only: behind TLS a node with another secret cannot
open a session with the store at all, and its tunnel tells it so: Note
[stores behind TLS] in tunnel.py.) Under a job secret every key a node reads in the rendezvous store has a name
made from the secret (Note [signed store] in tandem/store/job_secret.py). Two
nodes started with different secrets read different keys: neither sees the
other, each waits for the nodes it cannot see, and the one that gives up
first says "fewer than 2 node(s) joined ... check that this node can reach
the address" while the other loses its connection to a store whose host
left. Neither names the secret.

So each node's launcher leaves a mark in the rendezvous store that any node
can read: a number that its secret gives (an HMAC of a fixed text: it tells
nothing of the secret) and its address, under a counter of marks. Once a
second it reads the marks that came since it last looked; a mark with another
number is a node with another secret, and the launcher says so at once,
naming that node, and again in its error if the job cannot start. It stops
reading once it has seen as many marks like its own as the job has nodes, or
one of another secret, or when the job ends: with the static rendezvous node
0 goes on to start its workers before node 1 has come, so the meeting alone
is too short a time to look. The check only speaks: a stranger who writes
marks can make a node warn, never stop it (a job is stopped only by what its
secret signs).
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable

import torch.distributed as dist

from tandem.store.job_secret import secret_mark
from tandem.launch.config import split_endpoint

__all__ = ["SecretCheck"]

logger = logging.getLogger(__name__)

_PREFIX = "tandem/secret-marks"
_POLL_S = 1.0
_CONNECT_S = 5.0
_MAX_MARKS = 4096


class SecretCheck:
    """Marks this node in the rendezvous store at ``endpoint`` and reads the
    others' marks while the nodes meet (Note [another secret at the rendezvous]).

    Args:
        endpoint: the rendezvous store's ``host:port``.
        run_id: the job's rendezvous id (marks of other jobs are apart).
        node: how this node is named to the others (its address).
        secret: this node's job secret.
        nodes: how many nodes the job has at most.
        on_other: called once with a line naming the first node seen with
            another secret.
    """

    def __init__(self, endpoint: str, run_id: str, node: str, secret: bytes | None, *, nodes: int,
                 on_other: Callable[[str], None]) -> None:
        self.endpoint = endpoint
        self.prefix = f"{_PREFIX}/{run_id}"
        self.node = node
        self.mark = secret_mark(secret)
        self.nodes = nodes
        self.other: str | None = None
        """The line about a node seen with another secret, once one is seen."""
        self._on_other = on_other
        self._read = 0     # marks read so far
        self._alike = 0    # of them, like this node's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin, in a thread of its own: a store that is not up yet is asked again."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="tandem-secret-check", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop reading (the job has ended)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * _POLL_S)
            self._thread = None

    def _run(self) -> None:
        store: dist.Store | None = None
        marked = False  # once: a second mark of this node would count as a second node like it
        while not self._stop.is_set():
            try:
                if store is None:
                    host, port = split_endpoint(self.endpoint, "--rdzv-endpoint")
                    store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=_CONNECT_S))
                if not marked:
                    number = store.add(f"{self.prefix}/count", 1)
                    store.set(f"{self.prefix}/{number}", f"{self.mark} {self.node}")
                    marked = True
                if self.read(store):
                    return
            except Exception as e:  # noqa: BLE001 - not up yet, or gone: the rendezvous says so itself
                logger.debug("secret check at %s: %s", self.endpoint, e)
                store = None
            self._stop.wait(_POLL_S)

    def read(self, store: dist.Store) -> bool:
        """Read the marks that came since the last read; True when there is no
        more to look for (a node with another secret, or every node, seen)."""
        count = min(int(store.add(f"{self.prefix}/count", 0)), _MAX_MARKS)
        while self._read < count:
            key = f"{self.prefix}/{self._read + 1}"
            if not store.check([key]):
                break   # counted, not yet written: read again next time
            self._read += 1
            mark, _, node = store.get(key).decode(errors="replace").partition(" ")
            self._alike += mark == self.mark
            if mark != self.mark:
                self.other = (f"the node at {node[:100] or '?'} came to the rendezvous at {self.endpoint} with "
                              f"another job secret than this node's: the nodes of a job cannot see each other's "
                              "keys unless every node has the same TANDEM_JOB_SECRET or TANDEM_JOB_SECRET_FILE "
                              "contents")
                self._on_other(self.other)
                return True
        return self._alike >= self.nodes or self._read >= _MAX_MARKS
