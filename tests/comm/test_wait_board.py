"""The board of waits (Note [mismatched waits] in tandem/comm/wait_board.py),
in one process over an in-memory store: which notes make a mismatch, and
which do not (a slow collective every rank is in, a peer waiting on another
rank, a wait too young, a single reading)."""

from __future__ import annotations

import time
from typing import cast

import pytest
import torch.distributed as dist

from tandem.comm.peers import Liveness, PeerLostError, PeerWatch, SliceEnded, wait_watching_peers
from tandem.comm.wait_board import MISMATCH_AFTER_S, MismatchError, WaitBoard, WaitNote


class Store:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def as_c10d(self) -> dist.Store:
        """This store where a c10d store is typed: it has the methods PeerWatch calls."""
        return cast(dist.Store, self)


OLD = time.time() - MISMATCH_AFTER_S - 1


def _judge(mine: WaitNote, theirs: WaitNote | None, readings: int = 2) -> dict:
    store = Store()
    board, peer = WaitBoard(store, 1), WaitBoard(store, 0)
    if theirs is not None:
        peer.post(theirs)
    board.post(mine)
    found: dict = {}
    for _ in range(readings):
        found = board.mismatch(mine)
    return found


def test_a_receive_and_a_collective_that_need_each_other_are_a_mismatch_on_the_second_reading() -> None:
    recv = WaitNote("tandem.recv of the header of a message from rank 0", (0,), OLD, header=True)
    collective = WaitNote("#1 all_reduce", (1,), OLD)
    assert _judge(recv, collective, readings=1) == {}
    assert _judge(recv, collective) == {1: recv, 0: collective}
    # the other way round: rank 1 in the collective, rank 0 receiving from it
    recv_0 = WaitNote("tandem.recv of the header of a message from rank 1", (1,), OLD, header=True)
    collective_1 = WaitNote("#1 all_reduce", (0,), OLD)
    assert _judge(collective_1, recv_0) == {1: collective_1, 0: recv_0}


def test_what_is_not_a_mismatch() -> None:
    recv = WaitNote("tandem.recv of the header of a message from rank 0", (0,), OLD, header=True)
    young = WaitNote("tandem.recv of the header of a message from rank 0", (0,), time.time(), header=True)
    assert _judge(young, WaitNote("#1 all_reduce", (1,), OLD)) == {}                  # too young
    assert _judge(recv, WaitNote("#1 all_reduce", (1,), time.time())) == {}           # the peer's too young
    assert _judge(recv, WaitNote("#1 all_reduce", (2, 3), OLD)) == {}                 # the peer waits on others
    assert _judge(WaitNote("#4 all_reduce", (0,), OLD), WaitNote("#4 all_reduce", (1,), OLD)) == {}  # slow, together
    assert _judge(recv, None) == {}                                                   # the peer is not waiting
    store = Store()
    board, peer = WaitBoard(store, 1), WaitBoard(store, 0)
    peer.post(WaitNote("#1 all_reduce", (1,), OLD))
    board.mismatch(recv)
    peer.clear()                                                                      # its wait ended
    assert board.mismatch(recv) == {}


class _FailsAfterOneSlice:
    """A receive's work: one slice ends, then the wait fails as gloo's does when
    the peer's process has closed its connections."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self, timeout: object = None) -> bool:
        self.waits += 1
        if self.waits == 1:
            raise SliceEnded("slice")
        raise RuntimeError("[gloo] Connection closed by peer")


def test_a_wait_that_fails_after_its_peer_judged_the_mismatch_and_left_names_the_mismatch() -> None:
    """On a loaded host one rank of the pair judges the mismatch seconds before
    the other, raises, and ends its process: the other's wait then fails
    instead of slicing on. It names the mismatch from the note the first left
    posted, not a lost peer (seen in full suites: "rank 3 stopped beating 20 s
    ago" in tests/comm/test_p2p.py)."""
    store = Store()
    WaitBoard(store, 0).post(WaitNote("tandem.recv of the header of a message from rank 1", (1,), OLD, header=True))
    watch = PeerWatch(store.as_c10d(), 1, Liveness(beat_s=0.01, stale_after_s=0.05))
    with pytest.raises(MismatchError) as raised:
        wait_watching_peers(_FailsAfterOneSlice(), watch, [0, 1],
                            lambda: "tandem.recv of the header of a message from rank 0", header=True)
    assert set(raised.value.waits) == {0, 1}
    assert "rank 0 waits in tandem.recv of the header of a message from rank 1" in str(raised.value)
    assert "Connection closed by peer" in str(raised.value.__cause__)
    # Without the peer's note the failure is a lost peer, as before.
    store = Store()
    watch = PeerWatch(store.as_c10d(), 1, Liveness(beat_s=0.01, stale_after_s=0.05))
    with pytest.raises(PeerLostError):
        wait_watching_peers(_FailsAfterOneSlice(), watch, [0, 1], lambda: "tandem.recv", header=True)
