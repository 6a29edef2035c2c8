"""tandem.testing.Cluster: nodes as network namespaces on this machine (Note
[nodes as namespaces] in tandem/testing/cluster.py). Nodes reach each other at
their own addresses and nothing else does; a cut link stops the traffic while
the processes live, and restoring it lets it through again; a killed node
has no process left; every node's host name resolves to 127.0.0.1; every
link is shaped at the rate asked; and nothing of
a cluster is left behind, also when the test inside it fails. Skipped with
the reason where namespaces cannot be made (no CAP_NET_ADMIN)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.testing import Cluster, cluster_unavailable

REASON = cluster_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no cluster of namespaces here: {REASON}")

# A TCP echo on a node: listens on its address, answers one line per connection.
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 29400)); s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept(); c.sendall(c.recv(64).upper()); c.close()
"""

# Connect from a node (or the host) and print what came back, or the error.
CLIENT = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], 29400), timeout=1.0)
    c.sendall(b"hello"); print(c.recv(64).decode())
except OSError as e:
    print(type(e).__name__)
"""


def _ask(cluster: Cluster, node: int | None, address: str) -> str:
    argv = [sys.executable, "-c", CLIENT, address]
    if node is None:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    else:
        out = cluster.run(node, argv, capture_output=True, text=True, timeout=30)
    return out.stdout.strip()


def test_nodes_reach_each_other_links_cut_and_come_back_and_nodes_die() -> None:
    with Cluster(3, rate="100mbit") as cluster:
        server = cluster.popen(0, [sys.executable, "-c", SERVER, cluster.address(0)],
                               stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        assert _ask(cluster, 1, cluster.address(0)) == "HELLO"
        assert _ask(cluster, 2, cluster.address(0)) == "HELLO"
        # Every node resolves the machine's host name to loopback, as many containers do.
        resolved = cluster.run(1, [sys.executable, "-c", "import socket; print(socket.gethostbyname("
                                   "socket.gethostname()), socket.getfqdn())"], capture_output=True, text=True)
        assert resolved.stdout.split() == ["127.0.0.1", "localhost"], resolved
        # The host has no address on the bridge: only the nodes reach the nodes.
        assert _ask(cluster, None, cluster.address(0)) != "HELLO"

        cluster.cut(1)
        assert _ask(cluster, 1, cluster.address(0)) in ("TimeoutError", "OSError", "timeout")
        assert _ask(cluster, 2, cluster.address(0)) == "HELLO"   # only node 1 is cut off
        assert server.poll() is None                              # the server lives on
        cluster.restore(1)
        assert _ask(cluster, 1, cluster.address(0)) == "HELLO"

        shaped = cluster.run(1, ["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout
        assert "tbf" in shaped and "100Mbit" in shaped, shaped

        cluster.kill(0)
        assert server.wait(timeout=10) == -9 and cluster.pids(0) == []
        assert _ask(cluster, 1, cluster.address(0)) in ("ConnectionRefusedError", "TimeoutError")
    assert cluster.leftovers() == []


def test_nothing_is_left_behind_when_the_test_inside_fails() -> None:
    cluster = Cluster(2, rate=None)
    with pytest.raises(RuntimeError, match="inside"), cluster:
        sleeper = cluster.popen(1, ["sleep", "300"])
        raise RuntimeError("a failure inside the cluster")
    assert sleeper.poll() is not None
    assert cluster.leftovers() == []


WORLD = """
import torch, torch.distributed as dist, tandem
world = tandem.init()
t = torch.tensor([float(world.rank + 1)])
dist.all_reduce(t)
print(f"WORLD rank={world.rank} size={world.world_size} sum={t.item():g}", flush=True)
tandem.shutdown()
"""


# The static rendezvous with --local-addr. Its other forms run elsewhere, training:
# node ranks without --local-addr, and an endpoint without it, as the "Launch on many
# nodes" page writes them (test_cluster_train.py's docs test); an endpoint with it on
# 2 x 2 and 4 x 1 nodes (test_cluster_train.py), which also checks each rank's node.
@pytest.mark.parametrize("form,local_addr", [("node-rank", True)])
def test_two_nodes_with_their_own_addresses_form_one_world(tmp_path, form: str, local_addr: bool) -> None:
    """The docs' "Many nodes" commands, with the rendezvous on node 0's
    address: gloo must advertise each node's own address, not the loopback its
    hostname resolves to, whether --local-addr names it or the route to the
    rendezvous host does; and with a c10d endpoint, the node holding its
    address hosts the store (Note [the address a node gives] in
    tandem/launch/machine.py)."""
    script = tmp_path / "world.py"
    script.write_text(WORLD)
    with Cluster(2) as cluster:
        procs = []
        for node in range(2):
            meet = (["--node-rank", str(node), "--master-addr", cluster.address(0), "--master-port", "29500"]
                    if form == "node-rank" else
                    ["--rdzv-endpoint", f"{cluster.address(0)}:29400", "--rdzv-id", "two-namespaces"])
            argv = [sys.executable, "-m", "tandem", "run", "--nnodes", "2", "--nproc-per-node", "1", *meet,
                    "--rdzv-timeout", "30", str(script)]
            if local_addr:
                argv[-1:-1] = ["--local-addr", cluster.address(node)]
            procs.append(cluster.popen(node, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=60)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    ranks = sorted(line.split("WORLD rank=")[1].split()[0] for out in outs for line in out.splitlines()
                   if "WORLD rank=" in line and "size=2 sum=3" in line)
    assert ranks == ["0", "1"], outs
    assert cluster.leftovers() == []
