"""tandem.testing.run_cases: many cases in one spawned group, each with its own
process group, fresh random state and environment, deadline and failure; a
case that raises, hangs or kills a rank fails alone, and the cases after it
still run."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
import torch.distributed as dist

from tandem.testing import Case, RankFailure, run_cases, run_distributed


def _sum(rank: int, world_size: int, scale: float) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item() * scale


def _draws(rank: int, world_size: int) -> tuple[list[float], float, str | None, int]:
    out = (torch.rand(3).tolist(), random.random(), os.environ.get("CASE_VAR"), dist.get_world_size())
    torch.manual_seed(123)  # must not reach the next case
    random.seed(123)
    os.environ["LEAKED"] = "1"
    return out


def _env(rank: int, world_size: int) -> tuple[str | None, str | None]:
    return os.environ.get("LEAKED"), os.environ.get("CASE_VAR")


def _raises_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    dist.all_reduce(torch.ones(2))  # rank 1 never comes: fails once its group is gone


def _hangs(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(3600)


def _dies(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(7)
    dist.barrier()


CASES = {
    "sum": Case(_sum, args=(2.0,)),
    "draws": Case(_draws, env={"CASE_VAR": "x"}),
    "draws_again": Case(_draws),
    "env": Case(_env),
    "raises": Case(_raises_on_rank_1, timeout=30),
    "after_raise": Case(_sum, args=(1.0,)),
    "hangs": Case(_hangs, timeout=1),
    "after_hang": Case(_sum, args=(1.0,)),
    "dies": Case(_dies, timeout=30),
    "after_death": Case(_sum, args=(1.0,)),
}


@pytest.fixture(scope="module")
def results():
    return run_cases(CASES, 2)


def test_each_case_returns_one_value_per_rank(results):
    assert results["sum"] == [6.0, 6.0]
    assert list(results) == list(CASES)


def test_a_case_starts_with_a_new_ranks_random_state_and_environment(results):
    fresh = run_distributed(_draws, 2)
    for rank in range(2):
        assert results["draws"][rank][0] == results["draws_again"][rank][0] == fresh[rank][0]
        # Python's generator is reseeded from the OS at a fork, and for each case.
        assert results["draws_again"][rank][1] != random.Random(123).random()
    assert results["draws"][0][2:] == ("x", 2)
    assert results["draws_again"][0][2:] == (None, 2)
    assert results["env"] == [(None, None)] * 2


def test_a_case_that_raises_fails_alone_with_its_traceback(results):
    with pytest.raises(RankFailure) as info:
        results["raises"]
    # (Rank 0's collective may fail too, once rank 1's group is gone: reported alongside.)
    assert "rank 1 refuses" in info.value.tracebacks[1]
    assert results["after_raise"] == [3.0, 3.0]


def test_a_case_that_hangs_times_out_alone(results):
    with pytest.raises(TimeoutError, match=r"case 'hangs': ranks \[0\] of 2 did not finish within 1s"):
        results["hangs"]
    assert results["after_hang"] == [3.0, 3.0]


def test_a_rank_that_dies_fails_its_case_alone(results):
    with pytest.raises(RankFailure) as info:
        results["dies"]
    assert "process exited with code 7" in info.value.tracebacks[1]
    assert results["after_death"] == [3.0, 3.0]


def test_start_concurrently_runs_calls_together_and_keeps_each_outcome_apart() -> None:
    import threading

    from tandem.testing import start_concurrently

    together = threading.Barrier(2, timeout=10)  # passes only if both calls run at once

    def meet(value: int) -> int:
        together.wait()
        return value

    def fail() -> int:
        raise KeyError("its own failure")

    with start_concurrently({"a": lambda: meet(1), "b": lambda: meet(2), "c": fail}, at_once=2) as runs:
        assert runs["a"].result() == 1 and runs["b"].result() == 2
        with pytest.raises(KeyError, match="its own failure"):
            runs["c"].result()
    with pytest.raises(ValueError, match="at_once must be >= 1, got 0"):
        with start_concurrently({}, at_once=0):
            pass
