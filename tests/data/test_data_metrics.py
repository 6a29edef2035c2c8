"""tandem.data's metrics on 2 and 3 ranks equal the same metric computed by hand
over every rank's inputs in one process.

Each rank's inputs are deterministic functions of its rank (the ``_inputs_*``
helpers below), so the test process rebuilds all of them and computes the
expected value itself. All checks of one world size run inside one spawned
group (``_rank_checks``), which returns what each rank got; the tests compare.
Errors that depend on other ranks must be raised on every rank: each rank
catches its own and returns the message, and the harness's timeout turns a
hang into a failure.
"""

from __future__ import annotations

import math
from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from tandem.data import (DistributedSampler, RunningMean, all_reduce_mean, all_reduce_sum, gather_samples,
                         weighted_mean)
from tandem.testing import run_distributed

N = 11                      # not a multiple of 2 or 3: the sampler pads
EPOCH = 1
BATCH = 4
Pair = namedtuple("Pair", "index y")


def _inputs_float(rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float64).reshape(2, 3) * (rank + 1) - 0.25 * rank


def _inputs_int(rank: int) -> torch.Tensor:
    return torch.tensor([rank, 2 * rank + 1, -3], dtype=torch.int32)


def _inputs_bool(rank: int) -> torch.Tensor:
    return torch.tensor([rank % 2 == 0, True, rank > 0])


def _token_losses(rank: int) -> torch.Tensor:
    """Per-token losses; rank r sees 3 * r tokens, so rank 0 sees none."""
    return torch.arange(3 * rank, dtype=torch.float32) * 0.5 + rank


def _dataset() -> TensorDataset:
    x = torch.linspace(-1, 1, N * 2).reshape(N, 2)
    return TensorDataset(torch.arange(N), x)


def _model(x: torch.Tensor) -> torch.Tensor:
    return x @ torch.tensor([[2.0, -1.0], [0.5, 3.0]]) + 1


def _evaluate(shuffle: bool, drop_last: bool, as_tuple: bool) -> tuple[Any, int]:
    """Evaluate the whole dataset through a DataLoader over this rank's sampler,
    then gather every rank's results."""
    dataset = _dataset()
    sampler = DistributedSampler(dataset, shuffle=shuffle, drop_last=drop_last)   # ranks from dist
    sampler.set_epoch(EPOCH)
    indices, outputs = [], []
    for index, x in DataLoader(dataset, batch_size=BATCH, sampler=sampler):
        indices.append(index)
        outputs.append(_model(x))
    local = Pair(torch.cat(indices), torch.cat(outputs))
    values = local if as_tuple else local._asdict()
    return gather_samples(values, len(dataset)), sampler.num_replicas


def _error(fn: Any, *args: Any) -> str:
    try:
        fn(*args)
    except ValueError as e:
        return str(e)
    return "no error"


def _count_all_reduces(fn: Any) -> tuple[Any, list[tuple[int, torch.dtype]]]:
    """Run ``fn`` and record the all-reduces it issues (numel, dtype)."""
    calls = []
    original = dist.all_reduce

    def recording(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append((tensor.numel(), tensor.dtype))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recording
    try:
        return fn(), calls
    finally:
        dist.all_reduce = original


def _rank_checks(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x = _inputs_float(rank)
    before = x.clone()
    out["sum"] = all_reduce_sum(x)
    out["mean"] = all_reduce_mean(x)
    out["input_unchanged"] = torch.equal(x, before)
    out["int_sum"] = all_reduce_sum(_inputs_int(rank))
    out["int_mean"] = all_reduce_mean(_inputs_int(rank))
    out["bool_sum"] = all_reduce_sum(_inputs_bool(rank))
    out["number_sum"] = all_reduce_sum(rank + 1)
    out["float_sum"] = all_reduce_sum(0.5 * rank)
    out["number_mean"] = all_reduce_mean(rank + 1)

    losses = _token_losses(rank)
    out["weighted"] = weighted_mean(losses.sum(), losses.numel())
    running = RunningMean()
    for chunk in losses.split(2):           # per-batch means, weighted by batch size
        running.update(chunk.mean(), weight=chunk.numel())
    out["running"], out["running_all_reduces"] = _count_all_reduces(running.compute)
    running.reset()
    out["running_empty_error"] = _error(running.compute)
    out["zero_weight_error"] = _error(weighted_mean, 0.0, 0)

    for shuffle in (False, True):
        for drop_last in (False, True):
            out[f"eval/{shuffle}/{drop_last}"] = _evaluate(shuffle, drop_last, as_tuple=shuffle)

    # rank r holds r + 1 rows: not the equal shares of a sampler.
    out["unequal_error"] = _error(gather_samples, torch.zeros(rank + 1, 2), N)
    dtype = torch.float32 if rank == 0 else torch.float64
    out["dtype_error"] = _error(gather_samples, torch.zeros(4, 2, dtype=dtype), N)
    out["num_samples_error"] = _error(gather_samples, torch.zeros(4, 2), 2)
    out["still_in_step"] = all_reduce_sum(1)   # the errors left no collective half-joined
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    world = request.param
    return world, run_distributed(_rank_checks, world, timeout=90)


def test_all_reduce_sum_and_mean_of_tensors(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = ranks
    floats = torch.stack([_inputs_float(r) for r in range(world)])
    ints = torch.stack([_inputs_int(r) for r in range(world)]).long()
    for res in results:
        assert res["input_unchanged"]
        assert res["sum"].dtype == torch.float64 and torch.equal(res["sum"], floats.sum(0))
        assert res["mean"].dtype == torch.float64 and torch.allclose(res["mean"], floats.mean(0))
        assert res["int_sum"].dtype == torch.int32
        assert res["int_sum"].tolist() == ints.sum(0).tolist()
        assert res["int_mean"].dtype == torch.get_default_dtype()
        assert torch.allclose(res["int_mean"], ints.double().mean(0).float())
        bools = torch.stack([_inputs_bool(r) for r in range(world)])
        assert res["bool_sum"].dtype == torch.int64
        assert res["bool_sum"].tolist() == bools.sum(0).tolist()


def test_all_reduce_of_numbers(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = ranks
    for res in results:
        assert res["number_sum"] == sum(r + 1 for r in range(world))
        assert type(res["number_sum"]) is int
        assert res["float_sum"] == pytest.approx(sum(0.5 * r for r in range(world)))
        assert type(res["float_sum"]) is float
        assert res["number_mean"] == pytest.approx((world + 1) / 2)
        assert type(res["number_mean"]) is float
        assert res["still_in_step"] == world


def test_weighted_mean_is_the_mean_over_all_tokens(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = ranks
    expected = torch.cat([_token_losses(r) for r in range(world)]).double().mean().item()
    for res in results:
        assert res["weighted"] == pytest.approx(expected, rel=1e-12)
        assert res["running"] == pytest.approx(expected, rel=1e-6)
        # compute() is one all-reduce of [total, weight] in float64.
        assert res["running_all_reduces"] == [(2, torch.float64)]


def test_zero_total_weight_raises_on_every_rank(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = ranks
    for rank, res in enumerate(results):
        for key in ("running_empty_error", "zero_weight_error"):
            assert f"(rank {rank}): the weights sum to 0.0 over {world} rank(s)" in res[key]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_gather_samples_returns_the_dataset_in_global_order(
        ranks: tuple[int, list[dict[str, Any]]], shuffle: bool, drop_last: bool) -> None:
    world, results = ranks
    order = (torch.randperm(N, generator=torch.Generator().manual_seed(EPOCH)) if shuffle
             else torch.arange(N))
    if drop_last:
        order = order[:N // world * world]
    _, x = _dataset().tensors
    for res in results:
        gathered, replicas = res[f"eval/{shuffle}/{drop_last}"]
        assert replicas == world                              # sampler defaults from dist
        index, y = (gathered.index, gathered.y) if shuffle else (gathered["index"], gathered["y"])
        assert type(gathered) is (Pair if shuffle else dict)
        assert torch.equal(index, order)
        if not shuffle and not drop_last:
            assert index.tolist() == list(range(N))           # every sample once, dataset order
        # Each rank's batches and the whole set are other matrix products (rounded with or
        # without FMA, as the kernel for each shape does): four ulps of |y| < 4 (2^-22 each),
        # where a sample out of place is off by 0.47 at least.
        torch.testing.assert_close(y, _model(x[order]), rtol=0, atol=1e-6)


def test_gather_samples_errors_on_every_rank(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = ranks
    counts = ", ".join(f"rank {r}: {r + 1}" for r in range(world))
    for rank, res in enumerate(results):
        assert f"gather_samples (rank {rank} of {world})" in res["unequal_error"]
        assert f"different numbers of samples ({counts})" in res["unequal_error"]
        assert "equal shares a DistributedSampler gives" in res["unequal_error"]
        assert "trailing shapes and dtypes" in res["dtype_error"]
        assert "num_samples=2" in res["num_samples_error"]


def test_world_of_one_without_process_group() -> None:
    assert not dist.is_initialized()
    x = torch.tensor([1.0, 2.0], dtype=torch.float16)
    total = all_reduce_sum(x)
    assert isinstance(total, torch.Tensor)
    assert torch.equal(total, x) and total is not x and total.dtype == torch.float16
    mean = all_reduce_mean(torch.tensor([1, 2]))
    assert isinstance(mean, torch.Tensor) and mean.tolist() == [1.0, 2.0]
    assert (all_reduce_sum(3), all_reduce_mean(3)) == (3, 3.0)
    assert weighted_mean(torch.tensor(6.0), 4) == 1.5
    running = RunningMean()
    running.update(torch.tensor(2.0), weight=3)
    running.update(4.0)
    assert running.compute() == pytest.approx(2.5)
    values = {"y": torch.arange(6).reshape(3, 2), "i": torch.arange(3)}
    gathered = gather_samples(values, 3)
    assert isinstance(gathered, dict)
    assert gathered.keys() == values.keys() and all(torch.equal(gathered[k], values[k]) for k in values)
    with pytest.raises(ValueError, match="weights sum to 0.0 over 1 rank"):
        weighted_mean(1.0, 0)
    with pytest.raises(ValueError, match="num_samples=5"):
        gather_samples(torch.zeros(3), 5)


def test_argument_errors() -> None:
    with pytest.raises(TypeError, match="tensor or a Python number"):
        all_reduce_sum("1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must hold one number"):
        weighted_mean(torch.ones(2), 2)
    with pytest.raises(ValueError, match="weight=-1 is negative"):
        RunningMean().update(1.0, weight=-1)
    with pytest.raises(ValueError, match="must hold one number"):
        RunningMean().update(torch.ones(3))
    with pytest.raises(TypeError, match="element 'b' is a float"):
        gather_samples({"a": torch.ones(2), "b": 1.0}, 2)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"first dimensions are \[2, 3\]"):
        gather_samples((torch.ones(2), torch.ones(3)), 2)
    assert math.isclose(weighted_mean(torch.tensor(1.0), torch.tensor(4)), 0.25)
