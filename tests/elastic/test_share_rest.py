"""What a replacement of a sharded elastic job receives from rank 0 beside the
shards (``ElasticWorld.share_state``): the shards put the optimizer's state and
the parameters it steps in place (ZeRO's rows, fully_shard's shards), and one
broadcast brings the rest: the loop state, the optimizer's hyper-parameters,
the model's buffers and the parameters no shard holds (under ZeRO, a frozen
layer; fully_shard's shards hold every parameter).

Rank 1 plays the replacement: its frozen layer, buffer, counters and learning
rate differ from rank 0's, and after the call they are rank 0's, while the
parameters the shards hold are left as they were. A replacement whose model
has a buffer rank 0's lacks is refused, naming both (under fully_shard:
under ZeRO, DDP's check of the model refuses it before). One spawned group of 2
ranks runs every case.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tandem.testing import Case, CaseResults, run_cases


class WithFrozenAndBuffer(nn.Module):
    seen: torch.Tensor

    def __init__(self, seed: int, extra_buffer: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.trained = nn.Linear(4, 2)
        self.register_buffer("seen", torch.full((3,), float(seed)))
        if extra_buffer:
            self.register_buffer("other", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trained(self.frozen(x)) + self.seen.sum()


def _share(rank: int, world_size: int, strategy: str, extra_buffer: bool) -> dict[str, Any]:
    import tandem
    from tandem.checkpoint.state import TrainingState
    from tandem.elastic.world import ElasticWorld, TrainingStatePoints

    # rank 1, the replacement, is built with another seed
    module = WithFrozenAndBuffer(seed=rank, extra_buffer=extra_buffer and rank == 1)
    if strategy == "zero2":
        model: nn.Module = tandem.DistributedDataParallel(module, zero_stage=2)
        optimizer: Any = tandem.ZeroOptimizer(model, torch.optim.Adam, lr=0.01 * (rank + 1))
    else:
        tandem.fully_shard(module)
        model = module
        optimizer = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=0.01 * (rank + 1))

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    if rank == 1:  # built in a world of its own, as a replacement is: nothing of rank 0's reached it
        with torch.no_grad():
            for p in module.frozen.parameters():
                (p.to_local() if hasattr(p, "to_local") else p).fill_(5.0)
            module.seen.fill_(9.0)
    trained_before = [full(p) for p in module.trained.parameters()]
    state = TrainingState(model=model, optimizer=optimizer, step=7 if rank == 0 else 0,
                          epoch=1 if rank == 0 else 0, consumed=40 if rank == 0 else 0)
    world = ElasticWorld(run=None, model=model, optimizer=optimizer, state=state,  # type: ignore[arg-type]
                         points=TrainingStatePoints(state), fallback=None, sharded=True)
    try:
        world.share_state([1])
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if extra_buffer:  # rank 1 refused: no collective follows
        return {"error": None}
    return {"error": None, "frozen": [full(p) for p in module.frozen.parameters()], "seen": module.seen.clone(),
            "frozen_local": [(p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                             for p in module.frozen.parameters()],
            "trained_kept": all(torch.equal(full(p), b) for p, b in zip(module.trained.parameters(), trained_before)),
            "counters": (state.step, state.epoch, state.consumed), "lr": optimizer.param_groups[0]["lr"]}


def _with_a_rider(rank: int, differ: bool, call: Callable[..., Any]) -> dict[str, Any]:
    """``call(rider=..., check_riders=...)``, which gathers the rider [5, 6] (rank 1's
    [5, 7] where the ranks ``differ``): what the check saw on this rank, and what it
    raised or ``call`` returned."""
    seen: list[list[list[int]]] = []

    def check(riders: list[list[int]]) -> None:
        seen.append(riders)
        if riders[0] != riders[1]:
            raise ValueError(f"rank {rank}: the riders differ: {riders}")

    try:
        out = call(rider=[5, 6 + rank * int(differ)], check_riders=check)
    except ValueError as e:
        return {"error": str(e), "seen": seen}
    return {"error": None, "seen": seen, "out": out}


def _locate_with_a_rider(rank: int, world_size: int, differ: bool) -> dict[str, Any]:
    """The shards' headers carry the caller's numbers (under ZeRO, DDP's model digest),
    checked on every rank before the shards are chosen."""
    from tandem.elastic.buddy import BuddyCopies

    shard = {"rank": rank, "world_size": 2, "x": torch.full((2,), float(rank))}

    def locate(**rider: Any) -> tuple[int, list[int]]:
        located = BuddyCopies().locate([(3, shard)], ("0", "1"), 3, **rider)
        return located.step, sorted(located.provided)
    return _with_a_rider(rank, differ, locate)


def _exchange_with_a_rider(rank: int, world_size: int, differ: bool) -> dict[str, Any]:
    """A grow's exchange carries the caller's numbers (the model digest and the place),
    checked on every rank before any part is returned."""
    from tandem.elastic.buddy import BuddyCopies, Located

    located = Located(2, {rank: {"x": torch.full((2,), float(rank))}}, 3, [3, 3])

    def exchange(**rider: Any) -> dict[int, list[float]]:
        parts = BuddyCopies().exchange(located, lambda old, shard: [shard["x"] + 10 * j for j in range(2)], **rider)
        return {old: part.tolist() for old, part in parts.items()}
    return _with_a_rider(rank, differ, exchange)


# Under ZeRO a replacement with another model is refused before, by DDP's check of the
# model, which rides on the shards' headers, or in a grow on their exchange (the rider cases).
CASES = {"zero2": Case(_share, args=("zero2", False)), "fsdp": Case(_share, args=("fsdp", False)),
         "fsdp-extra": Case(_share, args=("fsdp", True)),
         "rider": Case(_locate_with_a_rider, args=(False,)), "rider-differs": Case(_locate_with_a_rider, args=(True,)),
         "exchange-rider": Case(_exchange_with_a_rider, args=(False,)),
         "exchange-rider-differs": Case(_exchange_with_a_rider, args=(True,))}


@pytest.fixture(scope="module")
def results() -> CaseResults:
    return run_cases(CASES, 2)


@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_the_replacement_gets_the_loop_state_buffers_and_frozen_parameters_beside_the_shards(
        results: CaseResults, strategy: str) -> None:
    r0, r1 = results[strategy]
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
    if strategy == "zero2":  # ZeRO's rows hold the parameters it steps only
        for a, b in zip(r0["frozen"], r1["frozen"]):
            assert torch.equal(a, b)
    else:  # fully_shard's shards hold every parameter, the frozen ones too: not sent again
        assert all(bool((t == 5.0).all()) for t in r1["frozen_local"]), r1["frozen_local"]
    assert torch.equal(r1["seen"], torch.zeros(3)), r1["seen"]  # rank 0's, built with seed 0
    assert r1["counters"] == (7, 1, 40)
    assert r1["lr"] == r0["lr"] == 0.01
    assert r0["trained_kept"] and r1["trained_kept"]  # what the shards hold is not sent again


def test_a_fully_sharded_replacement_with_another_model_is_refused_naming_both(results: CaseResults) -> None:
    r0, r1 = results["fsdp-extra"]
    assert r0["error"] is None  # the sender does not compare
    assert "rank 1: rank 0's model has buffers and parameters" in r1["error"], r1["error"]
    assert "'other'" in r1["error"] and "every rank must build the same model" in r1["error"], r1["error"]


def test_the_shards_headers_carry_the_callers_numbers_checked_before_any_shard_is_chosen(
        results: CaseResults) -> None:
    for rank, r in enumerate(results["rider"]):
        assert r == {"error": None, "seen": [[[5, 6], [5, 6]]], "out": (3, [rank])}, r
    for rank, r in enumerate(results["rider-differs"]):
        assert r["seen"] == [[[5, 6], [5, 7]]], r
        assert r["error"] == f"rank {rank}: the riders differ: [[5, 6], [5, 7]]", r


def test_a_grows_exchange_carries_the_callers_numbers_checked_before_any_part_is_returned(
        results: CaseResults) -> None:
    for rank, r in enumerate(results["exchange-rider"]):
        assert r == {"error": None, "seen": [[[5, 6], [5, 6]]],
                     "out": {0: [10.0 * rank] * 2, 1: [1.0 + 10 * rank] * 2}}, r
    for rank, r in enumerate(results["exchange-rider-differs"]):
        assert r["seen"] == [[[5, 6], [5, 7]]], r
        assert r["error"] == f"rank {rank}: the riders differ: [[5, 6], [5, 7]]", r


def _share_plain(rank: int, world_size: int) -> dict[str, Any]:
    """Without shards (DDP): rank 2 wants the state and gets all of rank 0's; rank 1, a
    member, holds its own (here made to differ) and receives nothing."""
    import tandem
    from tandem.checkpoint.state import TrainingState
    from tandem.elastic.world import ElasticWorld, TrainingStatePoints

    module = WithFrozenAndBuffer(seed=0)
    model = tandem.DistributedDataParallel(module)
    optimizer = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=0.01)
    model(torch.ones(2, 4)).sum().backward()  # a step, so that Adam holds moments (DDP: every rank)
    optimizer.step()
    if rank == 2:  # the replacement: no optimizer state of its own
        optimizer.state.clear()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(float(rank))  # each rank's values its own
    state = TrainingState(model=model, optimizer=optimizer, step=7 if rank < 2 else 0)
    world = ElasticWorld(run=None, model=model, optimizer=optimizer, state=state,  # type: ignore[arg-type]
                         points=TrainingStatePoints(state), fallback=None, sharded=False)
    world.share_state([2])
    moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
    return {"params": [p.detach().clone() for p in module.parameters()], "moments": moments, "step": state.step}


@pytest.fixture(scope="module")
def plain() -> list[dict[str, Any]]:
    return run_cases({"plain": Case(_share_plain)}, 3)["plain"]


def test_without_shards_only_the_ranks_wanting_the_state_receive_all_of_rank_0s(plain: list[dict[str, Any]]) -> None:
    r0, r1, r2 = plain
    assert r2["step"] == 7 and len(r2["moments"]) == len(r0["moments"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(r0["params"] + r0["moments"], r2["params"] + r2["moments"]))
    # rank 1 wanted nothing and kept its own parameters
    assert all(torch.equal(a + 1, b) for a, b in zip(r0["params"], r1["params"]))
