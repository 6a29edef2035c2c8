"""An elastic job whose control plane is on etcd (Note [a replicated control
plane] in tandem/launch/etcd_plane.py), on 3 namespace nodes of 1 worker each,
an etcd member on each, started by ``tandem run --rdzv-backend etcd``:

- every process of the node whose member leads the cluster SIGKILLed: the other
  two elect another leader and train on;
- that node's link cut (a partition of one node from two): the two train on,
  the one stops with exit 75 and the cut-off message, and writes nothing once
  the link is back.

Each run ends at the parameters of one process on the same global batches (at
the world sizes the run recorded), every sample of the epoch is trained once,
and no process or namespace is left behind."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.comm.cut_off import cut_off_after
from tandem.control.elastic_group import MIN_STALE_ON_ETCD_S
from tandem.testing import Cluster, cluster_unavailable

sys.path.insert(0, str(Path(__file__).parent))
from _cluster_faults import N  # noqa: E402
from _cluster_nodes import Node, await_paused, check_result, records, resume, used_samples  # noqa: E402


def _unavailable() -> str | None:
    reason = cluster_unavailable()
    if reason is not None:
        return f"no cluster of namespaces here: {reason}"
    if shutil.which("etcd") is None:
        return "the etcd binary is not installed (apt-get install etcd-server; .ci/run installs it)"
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return "tandem run --rdzv-backend etcd makes its certificates with cryptography, which is not installed"
    return None


REASON = _unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))

ELASTIC = {"ELASTIC": "1", "PAUSE_AT": "4"}
_LEADER = """
import json, sys, tempfile, time
from pathlib import Path
from tandem.store.etcd_gateway import EtcdGateway
from tandem.store.store_address import EtcdAddress
from tandem.launch.etcd_plane import node_identity
endpoints, secret = sys.argv[1].split(","), sys.argv[2].encode()
tls = EtcdAddress(tuple(endpoints), "", str(node_identity(secret, Path(tempfile.mkdtemp()), "127.0.0.1"))).tls()
for i, endpoint in enumerate(endpoints):
    status = EtcdGateway([endpoint], tls).call("/v3/maintenance/status", {}, time.monotonic() + 5, "status")
    if status["header"]["member_id"] == status["leader"]:
        print(i)
"""


def _endpoints(cluster: Cluster) -> str:
    return ",".join(f"{cluster.address(n)}:2379" for n in range(cluster.nodes))


def _start(cluster: Cluster, out: Path) -> list[Node]:
    rendezvous = ["--rdzv-backend", "etcd", "--rdzv-endpoint", _endpoints(cluster)]
    return [Node(cluster, n, out, ["2:3", "--elastic"], ELASTIC, nproc=1, rendezvous=rendezvous)
            for n in range(cluster.nodes)]


def _leader(cluster: Cluster) -> int:
    """The node whose etcd member leads, asked from node 0's namespace."""
    found = cluster.run(0, [sys.executable, "-c", _LEADER, _endpoints(cluster), cluster.secret],
                        capture_output=True, text=True, timeout=30)
    assert found.returncode == 0 and found.stdout.strip(), found.stderr[-3000:]
    return int(found.stdout.split()[0])


def _samples_of(out: Path, pids: list[int]) -> dict[Path, str]:
    """The sample records of the workers among ``pids``, as they are now."""
    return {p: p.read_text() for p in out.glob("samples-*.jsonl") if int(p.stem.rsplit("-", 1)[1]) in pids}


def test_on_etcd_the_leaders_node_lost_the_other_two_train_on(tmp_path: Path) -> None:
    with Cluster(3) as cluster:
        nodes = _start(cluster, tmp_path)
        await_paused(tmp_path, 3)
        lost = _leader(cluster)
        cluster.kill(lost)
        assert nodes[lost].proc.wait(timeout=10) == -9
        resume(tmp_path)
        outs = [nodes[n].finish() for n in range(3) if n != lost]
    for code, out in outs:
        assert code == 0, out[-4000:]
    assert any("elastic: lost" in out for _, out in outs), outs[0][1][-4000:]
    shrink = next(c for c in records(tmp_path)[0]["changes"] if c["lost_ranks"])
    assert (used_samples(tmp_path, cutoff=shrink["step"]) == check_result(records(tmp_path), 2, start_world=3)
            == list(range(N)))
    assert cluster.leftovers() == []


def test_on_etcd_a_partition_of_one_node_from_two_stops_the_one_and_the_two_train_on(tmp_path: Path) -> None:
    with Cluster(3) as cluster:
        nodes = _start(cluster, tmp_path)
        await_paused(tmp_path, 3)
        cut = _leader(cluster)   # the minority holds the leader: the majority elects another
        pids = cluster.pids(cut)
        cluster.cut(cut)
        cut_at = time.monotonic()
        resume(tmp_path)
        code_cut, out_cut = nodes[cut].finish(timeout=60)      # it stops while its link is still cut
        stopped = nodes[cut].first("is cut off from the job's store")
        written = _samples_of(tmp_path, pids)
        cluster.restore(cut)
        outs = [nodes[n].finish() for n in range(3) if n != cut]
        after = _samples_of(tmp_path, pids)
    assert code_cut != 0 and "exit code 75 (cut off from the job's store)" in out_cut, out_cut[-4000:]
    # its beats stop landing at the cut: it stops after the silence that says so, and load
    assert stopped is not None and stopped - cut_at < cut_off_after(MIN_STALE_ON_ETCD_S) + 4, out_cut[-4000:]
    for code, out in outs:
        assert code == 0, out[-4000:]
    assert after == written   # nothing of the cut node trained once the link was back
    shrink = next(c for c in records(tmp_path)[0]["changes"] if c["lost_ranks"])
    assert (used_samples(tmp_path, cutoff=shrink["step"]) == check_result(records(tmp_path), 2, start_world=3)
            == list(range(N)))
    assert cluster.leftovers() == []
    assert subprocess.run(["pgrep", "-x", "etcd"], capture_output=True).returncode != 0  # no member left
