"""tandem.send / tandem.recv (and isend / irecv): the receiver learns shapes and
dtypes from the message (Note [shape handshake] in tandem/comm/p2p.py).

One spawned group of 3 ranks: rank 0 sends to rank 1 a sequence whose shapes,
dtypes and structures change from message to message, synchronously and then
asynchronously; rank 2 exchanges with rank 1 at the same time; then the errors.
The expected messages are built on both sides by the same plain function.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

import tandem
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
