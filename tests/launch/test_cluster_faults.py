"""Faults across nodes, on namespace nodes with their own addresses and a
1 Gbit/s link (tandem.testing.Cluster), 2 nodes x 2 workers, the c10d store
on node 0's address, the Trainer job of tests/launch/_cluster_faults.py:

- a worker dies on node 1: the whole job restarts on both nodes and resumes
  from its checkpoint;
- ``--elastic``, node 1 lost (every process in it killed): node 0 goes on;
  node 1's ``tandem run`` started again joins the running job with its live
  state (Note [nodes of an elastic job] in tandem/launch/node_roll.py);
- node 1's link cut while its processes live: node 0, which holds the store,
  goes on; node 1's workers stop within the window, saying they were cut off
  (Note [cut off] in tandem/comm/cut_off.py); when the link is back nothing
  of node 1 trains;
- node 0, the store's host, lost: node 1's workers stop within the window,
  saying so; and with only its launcher killed (the stores gone, every worker
  alive), at once, in one line each.

Each training run ends at the parameters of one process on the same global
batches (at the world sizes the run recorded), every sample of the epoch is
trained once, and no process or namespace is left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.comm.cut_off import cut_off_after
from tandem.comm.peers import STALE_AFTER_S
from tandem.testing import Cluster, cluster_unavailable
from tandem.testing.ports import listening_ports

sys.path.insert(0, str(Path(__file__).parent))
from _cluster_faults import N  # noqa: E402
from _cluster_nodes import Node, await_paused, await_until, check_result, records, resume, used_samples  # noqa: E402

REASON = cluster_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no cluster of namespaces here: {REASON}")

ELASTIC = {"ELASTIC": "1"}


def test_a_worker_dies_on_node_1_and_the_job_restarts_on_both_nodes(tmp_path: Path) -> None:
    with Cluster(2) as cluster:
        nodes = [Node(cluster, n, tmp_path, ["2", "--max-restarts", "1"], {"DIE_AT": "1:0:6"}) for n in (0, 1)]
        outs = [node.finish() for node in nodes]
    for code, out in outs:
        assert code == 0, out[-4000:]
        assert "after 1 restart(s)" in out, out[-4000:]
    resumed = [line for _, out in outs for line in out.splitlines() if "resumed from" in line]
    assert resumed and "step 4)" in resumed[0], resumed     # the checkpoint of step 4, on both nodes
    assert used_samples(tmp_path, cutoff=4) == check_result(records(tmp_path), 4) == list(range(N))
    assert cluster.leftovers() == []


def test_elastic_a_node_lost_then_back_rejoins_with_live_state(tmp_path: Path) -> None:
    env = {**ELASTIC, "HOLD_FOR_JOIN": "10"}
    with Cluster(2) as cluster:
        first = [Node(cluster, n, tmp_path, ["1:2", "--elastic", "--max-restarts", "2"], {**env, "PAUSE_AT": "4"})
                 for n in (0, 1)]
        await_paused(tmp_path, 4)
        cluster.kill(1)
        assert first[1].proc.wait(timeout=10) == -9
        resume(tmp_path)
        await_until(lambda: first[0].first("elastic: lost") is not None, "the shrink", timeout=30)
        again = Node(cluster, 1, tmp_path, ["1:2", "--elastic", "--max-restarts", "2"], env)
        (code0, out0), (code1, out1) = first[0].finish(), again.finish()
    assert code0 == 0, out0[-4000:]
    assert code1 == 0, out1[-4000:]
    assert "this node's workers join it" in out1, out1[-3000:]
    # Node 1's two replacements are admitted, together or one after the other.
    admitted = {j for found in re.findall(r"admitted (j\d+(?:, j\d+)*)", out0) for j in found.split(", ")}
    assert len(admitted) == 2, out0[-4000:]
    shrink = next(c for c in records(tmp_path)[0]["changes"] if c["lost_ranks"])
    assert used_samples(tmp_path, cutoff=shrink["step"]) == check_result(records(tmp_path), 4) == list(range(N))
    assert cluster.leftovers() == []


def test_elastic_a_cut_link_stops_the_side_without_the_store(tmp_path: Path) -> None:
    with Cluster(2) as cluster:
        nodes = [Node(cluster, n, tmp_path, ["1:2", "--elastic"], {**ELASTIC, "PAUSE_AT": "4"}) for n in (0, 1)]
        await_paused(tmp_path, 4)
        cluster.cut(1)
        cut_at = time.monotonic()
        resume(tmp_path)
        code1, out1 = nodes[1].finish(timeout=60)          # node 1 stops while its link is still cut
        stopped = nodes[1].first("is cut off from the job's store")
        written = {p: p.read_text() for p in tmp_path.glob("samples-*.jsonl")}
        cluster.restore(1)
        code0, out0 = nodes[0].finish()
        after = {p: p.read_text() for p in tmp_path.glob("samples-*.jsonl") if p in written}
    assert code1 != 0 and "exit code 75 (cut off from the job's store)" in out1, out1[-4000:]
    assert stopped is not None and stopped - cut_at < 8.0, out1[-4000:]   # the window: 2 x 2 s, and load
    assert code0 == 0, out0[-4000:]
    # Node 1's processes wrote nothing once the link was back: one side trained on.
    for path, text in written.items():
        if path.name.startswith("samples-1-"):
            assert after[path] == text
    shrink = next(c for c in records(tmp_path)[0]["changes"] if c["lost_ranks"])
    assert used_samples(tmp_path, cutoff=shrink["step"]) == check_result(records(tmp_path), 2) == list(range(N))
    assert cluster.leftovers() == []


def test_the_store_host_lost_stops_every_other_rank_and_the_job_resumes(tmp_path: Path) -> None:
    """Node 0 (the store's host) killed: node 1's workers stop within the
    window, each saying it was cut off, and node 1's launcher fails; the job
    started again on both nodes resumes from its last checkpoint and ends as
    if uninterrupted."""
    with Cluster(2) as cluster:
        nodes = [Node(cluster, n, tmp_path, ["1:2", "--elastic"], {**ELASTIC, "PAUSE_AT": "6"}) for n in (0, 1)]
        await_paused(tmp_path, 4)
        cluster.kill(0)
        lost_at = time.monotonic()
        resume(tmp_path)
        code1, out1 = nodes[1].finish(timeout=60)
        stopped = [t for t, line in nodes[1].lines if "was cut off from the job's store and stopped" in line]
        nodes[0].finish()
        again = [Node(cluster, n, tmp_path, ["2", "--elastic"], ELASTIC) for n in (0, 1)]
        (code0, out0), (code1b, out1b) = (node.finish() for node in again)
    assert code1 == 1 and "exit code 75 (cut off from the job's store)" in out1, out1[-4000:]
    assert out1.count("is cut off from the job's store") >= 2, out1[-4000:]   # both workers, each saying so
    # Both stopped within the window (2 x 2 s, and load), as the launcher saw them go. Not
    # the launcher's own end: its interpreter's teardown took 2 to 3 s more on a loaded host.
    assert len(stopped) == 2 and max(stopped) - lost_at < 8.0, out1[-4000:]
    assert code0 == 0 and code1b == 0, (out0[-3000:], out1b[-3000:])
    resumed = [line for line in (out0 + out1b).splitlines() if "resumed from" in line]
    assert resumed, out0[-3000:]
    step = int(resumed[0].split("step ")[-1].rstrip(")"))
    assert step >= 4, resumed
    assert used_samples(tmp_path, cutoff=step) == check_result(records(tmp_path), 4) == list(range(N))
    assert cluster.leftovers() == []


def test_the_store_lost_stops_the_other_node_at_once_with_one_line_of_cause(tmp_path: Path) -> None:
    """Node 0's launcher, which hosts the job's stores, killed while every
    worker lives (a job without --elastic): each rank's next call to the store
    finds its connection closed, and node 1's workers stop at once, well
    within the silence that would stop them (Note [cut off] in
    tandem/comm/cut_off.py), each with one line that says why in place of a
    traceback, and no C++ backtrace on the console; node 1's launcher fails
    naming that cause."""
    with Cluster(2) as cluster:
        nodes = [Node(cluster, n, tmp_path, ["2"], {"PAUSE_AT": "6"}) for n in (0, 1)]
        await_paused(tmp_path, 4)
        os.kill(nodes[0].proc.pid, signal.SIGKILL)   # `ip netns exec` ran the launcher in its own process
        lost_at = time.monotonic()
        resume(tmp_path)
        code1, out1 = nodes[1].finish(timeout=60)
        said = [(t, line) for t, line in nodes[1].lines if "is cut off from the job's store at" in line
                and line.startswith("[rank ")]
    assert code1 == 1 and "failed first, with exit code 75 (cut off from the job's store)" in out1, out1[-4000:]
    assert sorted(line.split()[1] for _, line in said) == ["2]", "3]"], out1[-4000:]   # one line per rank
    assert max(t for t, _ in said) - lost_at < cut_off_after(STALE_AFTER_S), out1[-4000:]
    workers = [line for line in out1.splitlines() if line.startswith("[rank ")]
    assert not [line for line in workers if "Traceback" in line or "frame #" in line], out1[-4000:]
    assert cluster.leftovers() == []


def test_a_hung_rank_on_another_node_is_named_by_the_hang_report(tmp_path: Path) -> None:
    """Rank 3 (node 1) sleeps in its step's loss; rank 0 and 1 (node 0) wait in
    the step's all-reduce. Node 0's watchdog sees only ranks waiting among its
    own, and its report names rank 3 on node 1 from what it posted in the
    store (Note [a hang on another node] in tandem/launch/watchdog.py)."""
    with Cluster(2) as cluster:
        nodes = [Node(cluster, n, tmp_path, ["2", "--hang-timeout", "4"], {"HANG_AT": "1:1:5"}) for n in (0, 1)]
        outs = [node.finish(timeout=120) for node in nodes]
    (code0, out0), (code1, out1) = outs
    assert code0 != 0 and code1 != 0, (out0[-3000:], out1[-3000:])
    # Node 0's report: rank 2 (node 1) waits with ranks 0 and 1, as it posted;
    # rank 3 (node 1) has not issued the collective, and is named.
    assert "ranks 0, 1, 2: waiting in #" in out0, out0[-4000:]
    assert "  rank 3 (node 1 on " in out0, out0[-4000:]
    assert "the others wait for rank 3 (node 1 on " in out0, out0[-4000:]
    # Node 1's own report has rank 3's stack, in the script's sleep.
    assert "_cluster_faults.py" in out1 and "in loss_fn" in out1, out1[-4000:]
    assert cluster.leftovers() == []


STRANGER = str(Path(__file__).parent / "_stranger.py")


def test_a_stranger_on_a_third_node_opens_no_session_and_the_job_ends_as_without_it(tmp_path: Path) -> None:
    # Note [stores behind TLS] in tandem/launch/tunnel.py: node 2, on the same bridge,
    # knows every port the job listens on; for 10 s, while every rank waits at step 3 with
    # its beats and stores live, it tries to open a session with a store at each (to list,
    # read, overwrite, add and join) and sends bytes to each. Meanwhile a node started with
    # another secret asks to join. Then the job goes on to its end.
    marker = tmp_path / "the-stranger-ran-code"
    env = {**ELASTIC, "PAUSE_AT": "3"}
    with Cluster(3) as cluster:
        nodes = [Node(cluster, n, tmp_path, ["1:2", "--elastic"], env) for n in (0, 1)]
        await_paused(tmp_path, 4)
        listening = {n: listening_ports(cluster.pids(n)) for n in (0, 1)}
        ports = sorted({(address, port) for n in (0, 1) for found in listening[n].values()
                        for address, port in found if address == cluster.address(n)})
        stranger = cluster.popen(2, [sys.executable, STRANGER, json.dumps(ports), str(marker), "faults", "10"],
                                 with_secret=False, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        (tmp_path / "wrong").mkdir()
        started = time.monotonic()
        wrong = Node(cluster, 2, tmp_path / "wrong", ["1:2", "--elastic"], {**env, "TANDEM_JOB_SECRET": "another"})
        wrong_code, wrong_out = wrong.finish(timeout=60)
        told_at = wrong.first("this job's secret differs from yours")
        told = json.loads(stranger.communicate(timeout=60)[0].strip().splitlines()[-1])
        resume(tmp_path)
        outs = [node.finish() for node in nodes]
    # Where the job listens: each node's own address and loopback, never every interface.
    for n in (0, 1):
        found = {address for sockets in listening[n].values() for address, _ in sockets}
        assert found <= {cluster.address(n), "127.0.0.1"} and cluster.address(n) in found, (n, listening[n])
    stores = [f"{cluster.address(0)}:29400"]  # the rendezvous store's, at least, and the workers' store's
    assert len(ports) >= 3 and all(where in told["told"] for where in stores), (ports, told)
    # No session opened at any port, in any round.
    assert told["rounds"] >= 2 and len(told["told"]) == len(ports), told
    assert not any(what == "opened" for what in told["told"].values()), told
    assert not marker.exists()
    # The node with another secret is told so at once (not when its 60 s rendezvous gives up:
    # its start may take seconds on a loaded host), and the job's host logs it in one line.
    assert wrong_code != 0 and told_at is not None and told_at - started < 30, wrong_out[-3000:]
    for code, out in outs:
        assert code == 0, out[-4000:]
    stranger_lines = [[line for line in out.splitlines() if cluster.address(2) in line] for _, out in outs]
    assert sum("its job secret differs from this job's" in line for lines in stranger_lines for line in lines) == 1
    assert all(len(lines) <= 3 for lines in stranger_lines), stranger_lines
    done = records(tmp_path)
    assert all(d["changes"] == [] for d in done), done[0]["changes"]  # the world never changed
    assert used_samples(tmp_path, cutoff=N) == check_result(done, 4) == list(range(N))
    assert cluster.leftovers() == []
