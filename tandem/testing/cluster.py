"""Nodes on one machine: Linux network namespaces joined by a bridge, each
with its own interface and address and a rate-limited link, for tests of
what crosses machines (rendezvous, gloo's addresses, a lost node, a cut link).

# Note [nodes as namespaces]
Each node is a network namespace holding one end of a veth pair (``eth0``,
its address ``10.213.<k>.<node + 1>/24``) and its own loopback; the other end
is attached to a bridge in the host's namespace, which has no address on it:
nodes reach each other over the bridge and nothing else, and no address
outside the namespaces is used. A link's rate is a ``tbf`` queue on both ends
of its veth pair (this kernel has ``tbf`` and ``htb``, not ``netem``: delay
exists only as queueing). Cutting a link sets the bridge's end down, so the
processes on both sides live on and their connections stall, as when a cable
is pulled; killing a node sends SIGKILL to every process in its namespace.
Every node resolves the machine's host name to 127.0.0.1, as in many
containers (an ``/etc/netns/<name>/hosts`` file, which ``ip netns exec``
mounts over ``/etc/hosts``): a name torch takes from the host name is then
of no use to the other nodes, as in the containers users run in.
Names carry a prefix of the process id and a counter, so clusters of
concurrent tests never meet, and :meth:`Cluster.close` removes everything,
also after a failure inside ``with Cluster(...)``. Building one needs
CAP_NET_ADMIN (root, as CI runs): :func:`cluster_unavailable` says why not.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from tandem.store.job_secret import SECRET_ENV, SECRET_FILE_ENV, new_secret
from tandem.testing.start_close import StartAndClose

__all__ = ["Cluster", "cluster_unavailable"]

_COUNTER = itertools.count()
_NETNS_ETC = Path("/etc/netns")  # ip netns exec mounts <this>/<namespace>/<file> over /etc/<file>


def cluster_unavailable() -> str | None:
    """Why a :class:`Cluster` cannot be built here (None: it can)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the ip and tc commands (iproute2) are not installed"
    if os.geteuid() != 0:
        return "network namespaces need CAP_NET_ADMIN: run as root"
    probe = f"tndprobe{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"cannot create a network namespace: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


# Note [nodes as namespaces] at the top of this file.
class Cluster(StartAndClose):
    """``nodes`` nodes on this machine: each a network namespace with its own
    address and link, the links joined by one bridge and nothing else. Building
    one needs CAP_NET_ADMIN (root): :func:`cluster_unavailable` says why not.

    Args:
        nodes: how many nodes.
        rate: each node's link rate as ``tc`` writes it (``"1gbit"``,
            ``"100mbit"``), or None for an unshaped link.

    Use it as a context manager; :meth:`close` tears everything down.
    """

    def __init__(self, nodes: int, *, rate: str | None = "1gbit") -> None:
        if nodes < 1:
            raise ValueError(f"Cluster: nodes={nodes} must be at least 1")
        k = next(_COUNTER)
        self.tag = f"t{os.getpid() % 100000}x{k}"        # at most 12 characters: interface names take 15
        self.subnet = f"10.213.{(os.getpid() * 7 + k) % 250}"
        self.secret = new_secret()  # the job secret its nodes share (popen, run)
        self.nodes = nodes
        self.rate = rate
        self.bridge = f"{self.tag}b"
        self.namespaces = [f"tandem-{self.tag}-n{i}" for i in range(nodes)]
        self._host_ends = [f"{self.tag}h{i}" for i in range(nodes)]
        self._processes: list[subprocess.Popen[Any]] = []

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        """Create the bridge and every node, with its address and rate."""
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for i, (ns, host_end) in enumerate(zip(self.namespaces, self._host_ends)):
            _ip("netns", "add", ns)
            etc = _NETNS_ETC / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost {socket.gethostname()}\n")
            _ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", host_end, "master", self.bridge)
            _ip("link", "set", host_end, "up")
            self._in(ns, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            self._in(ns, "ip", "link", "set", "eth0", "up")
            self._in(ns, "ip", "link", "set", "lo", "up")
            if self.rate is not None:
                shape = ["rate", self.rate, "burst", "256kb", "latency", "50ms"]
                _run(["tc", "qdisc", "add", "dev", host_end, "root", "tbf", *shape])
                self._in(ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", *shape)

    def close(self) -> None:
        """Kill every process in the nodes and remove the nodes and the bridge;
        safe to call twice, and after a half-built start."""
        for i in range(self.nodes):
            self.kill(i)
        for p in self._processes:
            if p.poll() is None:
                p.kill()
            p.wait()
        self._processes.clear()
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(_NETNS_ETC / ns, ignore_errors=True)
        for name in (*self._host_ends, self.bridge):   # a veth's host end goes with its namespace
            subprocess.run(["ip", "link", "del", name], capture_output=True)

    # ------------------------------------------------------------------ use
    def address(self, node: int) -> str:
        """Node ``node``'s address (on its ``eth0``)."""
        return f"{self.subnet}.{node + 1}"

    def popen(self, node: int, argv: Sequence[str], *, with_secret: bool = True,
              **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on node ``node`` (``subprocess.Popen``'s keywords), with
        the cluster's job secret in its environment unless it has one (or, with
        ``with_secret=False``, with no secret at all: a stranger);
        :meth:`close` kills it if it still runs."""
        p = subprocess.Popen(["ip", "netns", "exec", self.namespaces[node], *argv],
                             **self._with_secret(kwargs, with_secret))
        self._processes.append(p)
        return p

    def run(self, node: int, argv: Sequence[str], *, with_secret: bool = True,
            **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` on node ``node`` to its end (``subprocess.run``'s keywords;
        ``with_secret`` as :meth:`popen`)."""
        return subprocess.run(["ip", "netns", "exec", self.namespaces[node], *argv],
                              **self._with_secret(kwargs, with_secret))

    def _with_secret(self, kwargs: dict[str, Any], with_secret: bool) -> dict[str, Any]:
        """Every node of a cluster is given the same job secret, as a job of several
        nodes needs (Note [signed store] in tandem/store/job_secret.py)."""
        env = dict(kwargs.get("env") or os.environ)
        if not with_secret:
            env.pop(SECRET_ENV, None)
            env.pop(SECRET_FILE_ENV, None)
        elif SECRET_ENV not in env and SECRET_FILE_ENV not in env:
            env[SECRET_ENV] = self.secret
        return {**kwargs, "env": env}

    def pids(self, node: int) -> list[int]:
        """The processes running in node ``node``."""
        out = subprocess.run(["ip", "netns", "pids", self.namespaces[node]], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def kill(self, node: int) -> None:
        """SIGKILL every process in node ``node`` (a node lost; its network stays)."""
        for pid in self.pids(node):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def cut(self, node: int) -> None:
        """Cut node ``node``'s link: its processes live on, unreachable."""
        _ip("link", "set", self._host_ends[node], "down")

    def restore(self, node: int) -> None:
        """Put node ``node``'s link back."""
        _ip("link", "set", self._host_ends[node], "up")

    def leftovers(self) -> list[str]:
        """What of this cluster still exists (empty after :meth:`close`)."""
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        return ([ns for ns in self.namespaces if ns in namespaces]
                + [str(_NETNS_ETC / ns) for ns in self.namespaces if (_NETNS_ETC / ns).exists()]
                + [name for name in (*self._host_ends, self.bridge) if f" {name}:" in links or f" {name}@" in links])

    def _in(self, ns: str, *argv: str) -> None:
        _run(["ip", "netns", "exec", ns, *argv])


def _ip(*argv: str) -> None:
    _run(["ip", *argv])


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"Cluster: `{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
