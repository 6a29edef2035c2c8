"""The board of waits (Note [mismatched waits] in tandem/comm/wait_board.py),
in one process over an in-memory store: which notes make a mismatch, and
which do not (a slow collective every rank is in, a peer waiting on another
rank, a wait too young, a single reading)."""

from __future__ import annotations

import time

from tandem.comm.wait_board import MISMATCH_AFTER_S, WaitBoard, WaitNote


class Store:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)


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
