"""tandem.send / tandem.recv (and isend / irecv): the receiver learns shapes and
dtypes from the message (Note [shape handshake] in tandem/comm/p2p.py).

One spawned group of 3 ranks: rank 0 sends to rank 1 a sequence whose shapes,
dtypes and structures change from message to message, synchronously and then
asynchronously; rank 2 exchanges with rank 1 at the same time; then the errors.
The expected messages are built on both sides by the same plain function.
"""

from __future__ import annotations

import collections
import time

import pytest
import torch
import torch.distributed as dist

import tandem
from tandem.comm.peers import PeerLostError
from tandem.testing import run_distributed

Pair = collections.namedtuple("Pair", "hidden mask")


def _message(i: int) -> object:
    """Message i, the same on every rank: shapes and structure change with i."""
    g = torch.Generator().manual_seed(i)
    k = 1 + i % 4
    kinds = [
        lambda: torch.randn(k, 3, generator=g),
        lambda: (torch.randn(2, k, 5, generator=g).requires_grad_(), torch.arange(k * 2).view(k, 2)),
        lambda: {"x": torch.randn(k, generator=g).to(torch.bfloat16), "step": i, "name": f"m{i}",
                 "empty": torch.zeros(0, k)},
        lambda: [Pair(torch.randn(k, k, generator=g, dtype=torch.float64), torch.rand(k, generator=g) > 0.5)],
    ]
    return kinds[i % len(kinds)]()


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.requires_grad == b.requires_grad and torch.equal(a.detach(), b.detach()))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _ranks(rank: int, world_size: int) -> dict[str, object]:
    out: dict[str, object] = {}
    n = 8
    if rank == 0:
        for i in range(n):
            tandem.send(_message(i), 1)
        pending = [tandem.isend(_message(100 + i), 1) for i in range(n)]
        for p in pending:
            p.wait()
        dist.send(torch.tensor([1, 2]), 1)  # not a tandem message
        out["self"] = _error(lambda: tandem.send(torch.ones(1), 0))
        out["range"] = _error(lambda: tandem.send(torch.ones(1), 5))
    elif rank == 1:
        got = [tandem.recv(0) for _ in range(n)]
        out["sync"] = [_same(_message(i), m) for i, m in enumerate(got)]
        posted = [tandem.irecv(0) for _ in range(n)]
        out["async"] = [_same(_message(100 + i), p.wait()) for i, p in enumerate(posted)]
        out["from 2"] = [_same(_message(200 + i), tandem.recv(2)) for i in range(3)]
        out["raw"] = _error(lambda: tandem.recv(0))
    else:
        for i in range(3):
            tandem.send(_message(200 + i), 1)
    dist.barrier()
    return out


def test_messages_of_changing_shapes_and_structures_arrive_whole() -> None:
    results = run_distributed(_ranks, 3, timeout=90)
    r0, r1 = results[0], results[1]
    assert r1["sync"] == [True] * 8 and r1["async"] == [True] * 8 and r1["from 2"] == [True] * 3, r1
    assert r1["raw"].startswith("RuntimeError: rank 1: tandem.recv from rank 0 got a header [1, 2] that is "
                                "not a tandem message"), r1["raw"]
    assert r0["self"] == "ValueError: rank 0: cannot send to itself (rank 0); pass another rank", r0["self"]
    assert r0["range"] == "ValueError: rank 0: cannot send to rank 5: ranks are 0..2", r0["range"]


# ---------------------------------------------------------------------- late, dead and foreign peers

LATE_S = (0.5, 2.5, 8.0)   # how long after the receive was posted each message is sent
RAW_BYTES = (8, 16, 24, 4096)


def _late_dead_and_foreign(rank: int, world_size: int) -> dict[str, object]:
    """Rank 0 sends three messages to rank 1 late (the receives posted first,
    Note [late peers] in tandem/comm/p2p.py), then raw torch.distributed sends
    of several sizes; rank 2 dies while rank 1 waits for its message."""
    import os
    import signal
    import time

    from tandem._compat import default_store
    store = default_store()
    out: dict[str, object] = {}
    if rank == 0:   # a collective's late peer is waited for too, not taken for lost
        time.sleep(2.5)
    total = tandem.all_reduce_sum(torch.ones(2))
    assert isinstance(total, torch.Tensor)  # the sum of a tensor is a tensor
    out["collective"] = total.tolist()
    entered = time.monotonic()   # before rank 1 leaves the barrier, rank 0 has entered it
    dist.barrier()
    start = time.monotonic()
    if rank == 0:
        for i, late in enumerate(LATE_S):
            time.sleep(max(0.0, start + late - time.monotonic()))
            tandem.send(_message(300 + i), 1)
        out["sync late"] = "sent"
        time.sleep(2.5)
        tandem.send(_message(400), 1)   # to a receive that waits, not a posted one
        for n in RAW_BYTES:
            dist.send(torch.full((n,), 7, dtype=torch.uint8), 1)
    elif rank == 1:
        posted = [tandem.irecv(0) for _ in LATE_S]
        out["late"] = [_same(_message(300 + i), p.wait()) for i, p in enumerate(posted)]
        # rank 0's start is after rank 1 entered the barrier (one system-wide
        # monotonic clock), so a receive that waited for the last message
        # waited at least its delay from `entered`, however the exits skew
        out["waited"] = time.monotonic() - entered
        out["sync late"] = _same(_message(400), tandem.recv(0))
        out["raw"] = [_error(lambda: tandem.recv(0)) for _ in RAW_BYTES]
        pending = tandem.irecv(2)
        store.set("tandem-test/receiving", "1")
        try:
            pending.wait()
            out["dead"] = "no error"
        except PeerLostError as e:
            out["dead"] = str(e)
            out["seen after"] = time.time() - float(store.get("tandem-test/killed_at").decode())
    else:
        store.wait(["tandem-test/receiving"])
        time.sleep(1.0)
        store.set("tandem-test/killed_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)   # while rank 1 waits in recv from it
    return out


def test_late_senders_deliver_dead_ones_are_named_and_foreign_messages_are_refused() -> None:
    results = run_distributed(_late_dead_and_foreign, 3, timeout=90, may_die=[2])
    r1 = results[1]
    assert [r["collective"] for r in results[:2]] == [[3.0, 3.0]] * 2
    # late by 0.5, 2.5 and 8 s: each waited for, none taken for a lost peer
    assert r1["late"] == [True, True, True] and r1["sync late"] is True, r1
    assert r1["waited"] >= LATE_S[-1]
    for got in r1["raw"]:
        assert got.startswith("RuntimeError: rank 1: tandem.recv from rank 0 got a header"), got
        assert "not a tandem message" in got, got
    assert "rank 2" in r1["dead"] and "tandem.recv of the header of a message from rank 2" in r1["dead"], r1["dead"]
    assert r1["seen after"] < 5.0, r1["seen after"]


def _mismatched(rank: int, world_size: int) -> str:
    """Ranks 0 and 1: rank 0 in a collective (tandem.all_reduce_sum over the
    pair), rank 1 receiving from it; ranks 2 and 3: each receiving from the
    other. No rank is lost; every one should name the mismatch. The test is
    about mismatches, not deaths: a long liveness window keeps a beat that a
    loaded host delays (FileStore, four ranks, two cores) from reading as a
    death (seen twice in full suites beside the namespace-cluster tests)."""
    from tandem.comm.monitor import current_monitor
    from tandem.comm.peers import Liveness

    current_monitor().set_liveness(Liveness(beat_s=0.25, stale_after_s=20.0))   # every rank
    pair = dist.new_group([0, 1])   # every rank creates both groups
    dist.new_group([2, 3])
    dist.barrier()
    try:
        if rank == 0:
            tandem.all_reduce_sum(torch.ones(3), group=pair)
        elif rank == 1:
            tandem.recv(0)
        else:
            tandem.recv(5 - rank)
    except Exception as e:  # noqa: BLE001 - the test reads type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_ranks_waiting_on_each_other_in_different_operations_are_named() -> None:
    from tandem.comm.wait_board import MISMATCH_AFTER_S
    start = time.monotonic()
    errors = run_distributed(_mismatched, 4, timeout=90)
    for rank, error in enumerate(errors):
        assert error.startswith(f"MismatchError: rank {rank}: mismatched calls: "), error
    pair = "rank 0 waits in #"   # the all-reduce's ledger entry
    for error in errors[:2]:
        assert pair in error and "all_reduce" in error, error
        assert "rank 1 waits in tandem.recv of the header of a message from rank 0" in error, error
    for error in errors[2:]:
        assert ("rank 2 waits in tandem.recv of the header of a message from rank 3" in error
                and "rank 3 waits in tandem.recv of the header of a message from rank 2" in error), error
    # named once both have waited MISMATCH_AFTER_S, not at the group's timeout (10 minutes)
    assert time.monotonic() - start < MISMATCH_AFTER_S + 60


class _Work:
    """A send's or receive's work that ends as told, noting when it was waited on."""

    def __init__(self, name: str, waited: list[str], error: Exception | None = None) -> None:
        self.name, self.waited, self.error = name, waited, error

    def wait(self, timeout: object = None) -> bool:
        self.waited.append(self.name)
        if self.error is not None:
            raise self.error
        return True


def test_a_messages_parts_are_waited_on_in_order_with_one_watched_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [one wait for a message's parts]: every part is waited on, in the order
    it was posted, by the pair's waiter thread; the caller watches the peer over
    the last part only; an earlier part's error is raised, not lost behind a
    later part that completed."""
    from tandem.comm import p2p
    from tandem.comm.peers import Waiter

    watched: list[object] = []
    waiter = Waiter()
    monitor = type("Monitor", (), {"peers": object(), "p2p_waiter": lambda self, *a: waiter})()
    monkeypatch.setattr(p2p, "current_monitor", lambda: monitor)
    monkeypatch.setattr(p2p.dist, "get_backend", lambda group=None: "gloo")

    def watch(work: object, peers: object, ranks: object, during: object, header: bool = False) -> None:
        watched.append(work)
        work.wait()  # type: ignore[attr-defined]

    monkeypatch.setattr(p2p, "wait_watching_peers", watch)
    waited: list[str] = []
    p2p._wait_all([_Work(n, waited) for n in ("header", "spec", "a", "b")], 1, None, "send", "a test")
    assert waited == ["header", "spec", "a", "b"] and len(watched) == 1
    waited.clear()
    broken = ConnectionError("the spec's send failed")
    parts = [_Work("header", waited), _Work("spec", waited, broken), _Work("a", waited)]
    with pytest.raises(ConnectionError) as raised:
        p2p._wait_all(parts, 1, None, "send", "a test")
    assert raised.value is broken
    assert waited == ["header", "spec", "a"] and len(watched) == 2
