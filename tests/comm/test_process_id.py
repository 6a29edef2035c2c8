"""Deaths seen at once (Note [deaths seen at once] in tandem/comm/process_id.py):
a peer's process that has ended on this kernel, or whose launcher posted its
exit, is gone without waiting out the heartbeat window; a stopped one is not.
And how a peer is worded (Note [how a rank left] in tandem/comm/peers.py): by
its last beat, then by its exit code or signal where one is known."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from tandem.control.generation import PREFIX, ElasticConfig
from tandem.control.membership import Membership
from tandem.comm.peers import PeerLostError, PeerWatch, heartbeat_key, last_beat, process_key
from tandem.comm.process_id import NodeBeat, ProcessId, exit_notice_key, exit_words, node_beat_key
from tandem.control.elastic_group import MIN_STALE_ON_ETCD_S
from tandem.launch.node_reports import NODE_BEAT_S, NodeReports, beat_period
from tandem.store.store_address import EtcdAddress

pytestmark = pytest.mark.skipif(ProcessId.this_process() is None, reason="needs Linux's /proc")


def _child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_process_ended_is_seen_and_a_stopped_one_is_alive() -> None:
    child = _child()
    try:
        me = ProcessId.this_process()
        process = ProcessId.of(child.pid)
        assert me is not None and process is not None and process.kernel == me.kernel
        assert ProcessId.decode(process.encode()) == process
        assert process.ended_here() is None
        os.kill(child.pid, signal.SIGSTOP)  # paused, not dead
        assert process.ended_here() is None
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while process.ended_here() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        # A zombie, not reaped: its exit status is still there.
        assert process.ended_here() == f"its process (pid {child.pid}) was killed by SIGKILL"
        child.wait()
        assert process.ended_here() == f"its process (pid {child.pid}) has ended"
    finally:
        child.kill()
        child.wait()
    # A reused pid is another process: its start time differs.
    me = ProcessId.this_process()
    assert me is not None
    assert ProcessId(me.kernel, me.pid, me.started + 1).ended_here() == f"its process (pid {me.pid}) has ended"


def test_a_process_of_another_kernel_is_judged_by_its_launchers_notice() -> None:
    store = dist.HashStore()
    elsewhere = ProcessId("another-host", 4242, 17)
    assert elsewhere.ended_here() is None and elsewhere.ended(store) is None
    store.set(exit_notice_key("another-host", 4242), "exited with -9, seen by its launcher")
    assert elsewhere.ended(store) == "exited with -9, seen by its launcher"


def test_a_collectives_watch_sees_a_dead_peer_without_waiting_out_the_window() -> None:
    store = dist.HashStore()
    child = _child()
    store.set(heartbeat_key(1), "3")
    process = ProcessId.of(child.pid)
    assert process is not None
    store.set(process_key(1), process.encode())
    watch = PeerWatch(store, 0, clock=lambda: 0.0)  # the clock never moves: no beat goes stale
    assert watch.observe([0, 1]) == {}
    child.kill()
    child.wait()
    assert watch.observe([0, 1]) == {1: f"has died: its process (pid {child.pid}) has ended"}
    # Posted by the watch itself:
    PeerWatch(store, 2).post_process()
    assert ProcessId.decode(store.get(process_key(2)).decode()) == ProcessId.this_process()


def test_a_member_whose_launcher_posted_its_exit_is_dead_at_once() -> None:
    store = dist.HashStore()
    config = ElasticConfig(beat_s=0.01, stale_after_s=1.0, regroup_timeout_s=5.0)
    clock = lambda: 1000.0  # noqa: E731 - no beat ever goes stale
    members = [Membership.founding(store, r, 2, config, clock=clock) for r in range(2)]
    try:
        # Member 1 as if on another host (its id is read once, at the first look).
        store.set(f"{PREFIX}/process/1", ProcessId("another-host", 99, 1).encode())
        assert members[0].dead(["0", "1"]) == {}
        store.set(exit_notice_key("another-host", 99), "exited with -9, seen by its launcher")
        assert members[0].dead(["0", "1"]) == {"1": "has died: exited with -9, seen by its launcher"}
    finally:
        for m in members:
            m.stop()


def test_the_launcher_beats_for_its_node_and_posts_an_exit_to_the_workers_store() -> None:
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    reports = NodeReports.of_this_node()
    me = ProcessId.this_process()
    assert me is not None and reports.node == f"{me.kernel}.{me.pid}"
    try:
        reports.beat_in(("127.0.0.1", server.port))
        server.wait([node_beat_key(reports.node)], datetime.timedelta(seconds=10))
        first = NodeBeat.decode(server.get(node_beat_key(reports.node)))
        assert first is not None and first.ended == {} and abs(first.at - time.time()) < 5
        reports.post(("127.0.0.1", server.port), 1234, "exited with -9, seen by its launcher")
        server.wait([exit_notice_key(me.kernel, 1234)], datetime.timedelta(seconds=10))
        assert server.get(exit_notice_key(me.kernel, 1234)) == b"exited with -9, seen by its launcher"
        beat = NodeBeat.decode(server.get(node_beat_key(reports.node)))  # written before the notice
        assert beat is not None and beat.ended == {1234: "exited with -9, seen by its launcher"}
    finally:
        reports.stop()


def test_a_node_beats_less_often_on_etcd_and_still_several_times_a_window() -> None:
    """A beat on etcd is a write through Raft (tandem/launch/node_reports.py): a
    node beats there once a second, six times in the shortest window etcd allows."""
    on_etcd = beat_period(EtcdAddress(("10.0.0.1:2379",), "jobs/j"))
    assert beat_period(("127.0.0.1", 29500)) == NODE_BEAT_S == 0.25
    assert on_etcd == 1.0 and MIN_STALE_ON_ETCD_S / on_etcd >= 6


def test_a_reaped_process_is_worded_by_its_launchers_notice_when_there_is_one() -> None:
    store = dist.HashStore()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    process = ProcessId.of(child.pid)
    assert process is not None
    child.wait()  # reaped: /proc keeps no status
    assert process.ended(store) == f"its process (pid {child.pid}) has ended"
    store.set(exit_notice_key(process.kernel, child.pid),
              f"its process (pid {child.pid}) {exit_words(child.returncode)}, seen by its launcher")
    assert process.ended(store) == f"its process (pid {child.pid}) exited with code 3, seen by its launcher"
    assert exit_words(-signal.SIGSEGV) == "was killed by SIGSEGV" and exit_words(75).startswith("stopped, cut off")


def test_a_peer_is_worded_by_its_last_beat() -> None:
    """Note [how a rank left]: a rank that raised is not "has left the job"."""
    store = dist.HashStore()
    watch = PeerWatch(store, 0, clock=lambda: 0.0)
    for rank, beat in ((1, last_beat()), (2, last_beat(shut_down=False)), (3, last_beat(raised=ValueError))):
        store.set(heartbeat_key(rank), beat)
    said = watch.observe([0, 1, 2, 3])
    assert said == {1: "has left the job (it called tandem.shutdown())",
                    2: "has left the job: its process ended without calling tandem.shutdown() (its script "
                       "returned, or called sys.exit)",
                    3: "crashed: it raised an uncaught ValueError (its traceback is in its log)"}
    # A rank that said how it left needs no guess at the cause; a silent one gets it.
    assert "(killed, out of memory, or crashed)" not in str(PeerLostError(0, {3: said[3]}, "#1 all_reduce"))
    assert "(killed, out of memory, or crashed)" in str(PeerLostError(0, {3: "stopped beating 3.0 s ago"}, "#1"))
