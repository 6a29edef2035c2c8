"""What each rank puts on the wire: counted and ordered through ``ddp.comm.observers``.

Overlap cannot be measured on 2 cores, but it is structural: a bucket's reduction
is issued while backward is still producing earlier layers' gradients.

The cases run in one spawned group per world size (tandem.testing.run_cases, in
module fixtures); each test reads its own case.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import torch
from torch import nn

import tandem
from tandem.testing import Case, CaseResults, grad_of, run_cases
from tandem.testing.models import IN, OUT, make_model


def _record(ddp: tandem.DistributedDataParallel) -> list[tuple[str, str, int]]:
    events: list[tuple[str, str, int]] = []
    ddp.comm.observers.append(lambda e: events.append((e.op, e.tag, e.numel)))
    return events


def _taken(events: list) -> list:
    """The events so far, and none left."""
    taken = list(events)
    events.clear()
    return taken


def _step(ddp, x, y, *, backward=True) -> None:
    loss = nn.functional.mse_loss(ddp(x), y)
    if backward:
        loss.backward()


def _counts(rank: int, world_size: int) -> dict:
    ddp = tandem.DistributedDataParallel(make_model("mlp", seed=rank), bucket_cap_mb=0.00001)
    reducer = ddp.reducer
    assert reducer is not None
    n_buckets = len(reducer.buckets)
    events = _record(ddp)
    x, y = torch.randn(4, IN), torch.randn(4, OUT)
    per_phase = {}
    _step(ddp, x, y)                                     # step 1 (buckets rebuilt after it)
    per_phase["step1"] = _taken(events)
    _step(ddp, x, y)                                     # step 2: rebuild broadcast first
    per_phase["step2"] = _taken(events)
    with ddp.no_sync():
        _step(ddp, x, y)
        _step(ddp, x, y)
    per_phase["no_sync"] = _taken(events)
    _step(ddp, x, y)
    per_phase["after_no_sync"] = _taken(events)
    with torch.no_grad():
        ddp(x)
    per_phase["no_grad"] = _taken(events)
    return {"n_buckets": n_buckets, "n_buckets_now": len(reducer.buckets), **per_phase}


def test_one_reduction_per_bucket_per_step_and_none_under_no_sync(two) -> None:
    for r in two["counts"]:
        assert r["n_buckets"] > 3
        def buckets(ev: list) -> list:
            return [e for e in ev if e[0] == "all_reduce" and e[1].startswith("bucket")]
        assert [e[1] for e in buckets(r["step1"])] == [f"bucket {i}" for i in range(r["n_buckets"])]
        assert len(r["step1"]) == r["n_buckets"]
        # Step 2 starts with the one-time broadcast of rank 0's gradient arrival order.
        assert r["step2"][0][:2] == ("broadcast", "bucket order")
        assert len(buckets(r["step2"])) == r["n_buckets_now"] == len(r["step2"]) - 1
        assert r["no_sync"] == []
        assert len(buckets(r["after_no_sync"])) == r["n_buckets_now"]
        assert r["no_grad"] == []


def _overlap(rank: int, world_size: int) -> list[str]:
    model = make_model("mlp", seed=0)
    ddp = tandem.DistributedDataParallel(model, bucket_cap_mb=0.00001)
    timeline: list[str] = []
    ddp.comm.observers.append(lambda e: timeline.append(f"{e.op}:{e.tag}"))
    # Registered after DDP's own hooks, so each entry follows DDP's handling of it.
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, n=name: timeline.append(f"grad:{n}"))
    x, y = torch.randn(4, IN), torch.randn(4, OUT)
    _step(ddp, x, y)
    return timeline


def test_first_bucket_launches_before_the_last_gradient_arrives(two) -> None:
    for timeline in two["overlap"]:
        first_launch = timeline.index("all_reduce:bucket 0")
        last_grad = max(i for i, e in enumerate(timeline) if e.startswith("grad:"))
        assert first_launch < last_grad, timeline
        # And the launches are interleaved with backward, not all at the end.
        launches_during_backward = [e for e in timeline[:last_grad] if e.startswith("all_reduce")]
        assert len(launches_during_backward) >= 2, timeline


class RankOrdered(nn.Module):
    """Two branches whose order of computation (and so of gradient arrival)
    depends on the rank."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.a = nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, OUT))
        self.b = nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank % 2 == 0:
            ya = self.a(x)
            yb = self.b(x)
        else:
            yb = self.b(x)
            ya = self.a(x)
        return ya + yb


def _order(rank: int, world_size: int, as_view: bool) -> dict:
    torch.manual_seed(0)
    model = RankOrdered(rank)
    ddp = tandem.DistributedDataParallel(model, bucket_cap_mb=0.0002,
                                         gradient_as_bucket_view=as_view)
    rng = random.Random(rank)
    # Registered before nothing else runs: each gradient is delayed at random, per rank.
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: time.sleep(rng.uniform(0, 0.004)))
    arrival: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, n=name: arrival.append(n))
    issued: list[tuple[str, str, int]] = []
    ddp.comm.observers.append(lambda e: issued.append((e.op, e.tag, e.numel)))
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x, y = torch.randn(4, IN, generator=g), torch.randn(4, OUT, generator=g)
        ddp.zero_grad()
        _step(ddp, x, y)
    grads = [grad_of(p).clone() for p in model.parameters()]
    return {"issued": issued, "arrival": arrival[:8], "grads": grads}


def test_issue_order_is_identical_on_every_rank_despite_delays_and_arrival_order(four) -> None:
    for as_view in (False, True):
        results = four[f"order as_view={as_view}"]
        # The ranks really did see gradients in different orders...
        assert results[0]["arrival"] != results[1]["arrival"]
        # ...yet issued exactly the same collectives in the same order,
        for r in results[1:]:
            assert r["issued"] == results[0]["issued"]
        # and hold the same averaged gradients.
        for r in results[1:]:
            for a, b in zip(r["grads"], results[0]["grads"]):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def _buffers(rank: int, world_size: int) -> dict:
    model = make_model("batchnorm", seed=rank)
    ddp = tandem.DistributedDataParallel(model)
    events = _record(ddp)
    x, y = torch.randn(4, IN) + rank, torch.randn(4, OUT)
    out: dict[str, Any] = {}
    _step(ddp, x, y)
    out["first"] = [e[:2] for e in _taken(events) if e[0] == "broadcast"]
    with ddp.no_sync():
        _step(ddp, x, y)
        out["no_sync_first"] = [e[:2] for e in _taken(events) if e[1] == "buffers"]
        _step(ddp, x, y)
        out["no_sync_second"] = [e[:2] for e in _taken(events) if e[1] == "buffers"]
    # The forward after an unsynchronised one does not broadcast buffers (as torch).
    _step(ddp, x, y)
    out["after"] = [e[:2] for e in _taken(events) if e[0] == "broadcast" and e[1] == "buffers"]
    _step(ddp, x, y)
    out["next"] = [e[:2] for e in events if e[0] == "broadcast" and e[1] == "buffers"]
    out["running_mean"] = model.get_buffer("bn.running_mean").clone()
    return out


def test_buffers_broadcast_before_synchronised_forwards_only(two) -> None:
    results = two["buffers"]
    for r in results:
        # BatchNorm's float buffers and its int64 counter: one collective per dtype.
        assert r["first"] == [("broadcast", "buffers")] * 2
        # Whether a forward broadcasts is decided by the forward before it (as torch):
        # the first forward under no_sync follows a synchronised one.
        assert r["no_sync_first"] == [("broadcast", "buffers")] * 2
        assert r["no_sync_second"] == []
        assert r["after"] == []
        assert r["next"] == [("broadcast", "buffers")] * 2
    # Each rank updated its own running stats in the last forward, after the broadcast.
    assert not torch.equal(results[0]["running_mean"], results[1]["running_mean"])


@pytest.fixture(scope="module")
def two() -> CaseResults:
    return run_cases({"counts": Case(_counts, timeout=60), "overlap": Case(_overlap, timeout=60),
                      "buffers": Case(_buffers, timeout=60)}, 2)


@pytest.fixture(scope="module")
def four() -> CaseResults:
    return run_cases({f"order as_view={as_view}": Case(_order, args=(as_view,), timeout=90)
                      for as_view in (False, True)}, 4)
