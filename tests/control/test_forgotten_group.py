"""A world change cuts the old group's connections (Note [severing a forgotten
group] in tandem/comm/connections.py).

The unit: which sockets a block opened, and that cutting one ends a read
blocked on its other end, in this process. The whole: two processes go
through a world change with a reduce-scatter left waiting in the old group, as
when a peer's death made the members give up a step, and exit as a job's ranks
do, one of them while the other's interpreter finalizes. Before the fix, the
waiter thread returned from torch in that window and the process died of
SIGABRT ("terminate called without an active exception") after it finished.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tandem.comm.connections import opened_connections, sever

TIMEOUT_S = 90.0


def _listener() -> socket.socket:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server


def test_the_connections_a_block_opened_are_cut_and_nothing_else():
    server = _listener()
    before = socket.create_connection(server.getsockname())  # opened before the block: not its
    before_peer, _ = server.accept()
    with opened_connections() as opened:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        idle_listener = _listener()  # a listener is never recorded
    try:
        assert sorted(c.fd for c in opened) == sorted([client.fileno(), peer.fileno()])
        assert {c.ports for c in opened} == {client.getsockname()[1:2] + client.getpeername()[1:2],
                                              peer.getsockname()[1:2] + peer.getpeername()[1:2]}
        received: list[bytes] = []
        reader = threading.Thread(target=lambda: received.append(peer.recv(1)))
        reader.start()
        mine = tuple(c for c in opened if c.fd == client.fileno())
        assert sever(mine) == 1
        reader.join(5.0)
        assert received == [b""], "a read blocked on the other end sees the connection closed"
        before.sendall(b"x")  # what was not recorded still works
    finally:
        for s in (before, before_peer, client, peer, idle_listener, server):
            s.close()


def test_a_socket_number_reused_since_is_not_cut():
    server = _listener()
    with opened_connections() as opened:
        client = socket.create_connection(server.getsockname())
    fd = client.fileno()
    client.close()
    other = socket.create_connection(server.getsockname())  # most likely the same number
    try:
        assert sever(tuple(c for c in opened if c.fd == fd)) == 0
        other.sendall(b"still connected")
    finally:
        other.close()
        server.close()


_RANK = textwrap.dedent("""
    import os, sys, time
    import torch
    import tandem
    from tandem.control.elastic_group import elastic_membership, enter_generation, new_world_group
    from tandem.comm.group import GroupComm
    from tandem.control.generation import ElasticConfig, Generation

    rank, store, marker, which = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    tandem.init("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    membership = elastic_membership(ElasticConfig())
    # The default group's, or fully_shard's reduce-scatter group's (new_world_group).
    comm = GroupComm() if which == "default" else GroupComm(new_world_group("reduce-scatters"))
    if rank == 0:
        # Rank 1 never issues it: its wait stays in tandem's waiter thread, as a
        # step's reduce-scatter does when the members give the step up.
        comm.reduce_scatter(torch.empty(4), torch.ones(8), async_op=True)
    enter_generation(membership, Generation(1, ("0", "1")))  # the old group is forgotten
    tandem.shutdown()
    if rank == 0:
        class Finalizing:
            # Holds rank 0 in its interpreter's teardown while rank 1 exits.
            def __del__(self, os=os, time=time):
                os.close(os.open(marker, os.O_CREAT | os.O_WRONLY))
                time.sleep(2.0)
        finalizing = Finalizing()
    else:
        deadline = time.monotonic() + 60.0
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
        # Its exit closes its connections of the old group.
""")


@pytest.mark.parametrize("which", ["default", "reduce-scatter group"])
def test_a_rank_with_a_wait_left_in_a_forgotten_group_exits_cleanly(tmp_path: Path, which: str):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                           "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    marker = tmp_path / "rank0-finalizing"
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), str(tmp_path / "store"), str(marker), which],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for rank in (0, 1)]
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert marker.exists(), outputs
    for rank, (p, out) in enumerate(zip(ranks, outputs)):
        assert p.returncode == 0, (rank, p.returncode, out[-3000:])
        assert "terminate called" not in out, (rank, out[-3000:])


_DRAIN = textwrap.dedent("""
    import datetime, sys, threading, time
    import torch.distributed as dist
    from tandem.comm.peers import ThreadedWait, Waiter, drain_at_exit

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    class CutWork:
        # A wait that blocks in torch with the GIL released and fails in a moment,
        # as a wait does once its group's connections were cut.
        def wait(self):
            store.wait(["never"], datetime.timedelta(seconds=0.3))

    if sys.argv[1] == "waiter":   # a reduce-scatter's, a send's or a receive's
        Waiter().submit(CutWork())
    else:   # an object collective's, abandoned: a thread of its own (tandem.comm.watched_call)
        work = ThreadedWait(CutWork())
        threading.Thread(target=work.run, daemon=True).start()
    drain_at_exit()   # what enter_generation calls after the cut

    class Finalizing:
        def __del__(self, time=time):
            time.sleep(1.0)   # the interpreter finalizes while the wait comes back

    finalizing = Finalizing()
""")


@pytest.mark.parametrize("waited_by", ["waiter", "watched_call"])
def test_a_wait_that_fails_as_the_script_ends_is_let_return_before_the_interpreter_finalizes(waited_by: str) -> None:
    """Note [severing a forgotten group]: without ``drain_at_exit`` this
    process aborts ("terminate called without an active exception", exit -6:
    checked), its script finished; so does the watched call's without its wait
    counted in flight."""
    done = subprocess.run([sys.executable, "-c", _DRAIN, waited_by], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0 and "terminate called" not in done.stdout, (done.returncode, done.stdout[-3000:])

