"""The split of an epoch's rest into global batches (Note [exact split] in
tandem/data/split.py), over a grid of sizes, world sizes, batch sizes and starts,
in one process: every rank's sampler is built with explicit num_replicas and rank.

What each case checks: every rank has the same number of batches; global batch
k is positions [start + k*R*B, ...) of the epoch's order (so R ranks train like
one process with batch R*B); an exact split yields every remaining sample once
and none twice; the weights are n_r * R / N, sum to R, and are all 1 where the
sizes are equal (every padded split).
"""

from __future__ import annotations

import itertools
from typing import Any
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

from tandem.data import DistributedSampler
from tandem.data.batches import empty_batch, planned_batches
from tandem.data.split import RestSplit

SIZES = [1, 2, 5, 7, 12, 13, 30]
WORLDS = [1, 2, 3, 4]
BATCHES = [1, 2, 3, 4]
EMPTY: list[int] = []


def _order(n: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()


def _chunks(indices: list[int], batch_size: int, drop_last: bool) -> list[list[int]]:
    """What a DataLoader's batch sampler makes of a sampler's indices."""
    chunks = [indices[i:i + batch_size] for i in range(0, len(indices), batch_size)]
    return [c for c in chunks if len(c) == batch_size] if drop_last else chunks


def _split_of(n: int, world: int, start: int, batch_size: int, *, exact: bool, drop_last: bool,
              sampler_drop_last: bool = False) -> tuple[RestSplit, list[list]]:
    """The split every rank computes (checked to be the same) and each rank's planned batches."""
    splits, per_rank = set(), []
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, drop_last=sampler_drop_last)
        sampler.set_epoch(0, start, exact=exact)
        indices = list(sampler)
        assert len(indices) == len(sampler)
        split = sampler.split(batch_size, drop_last)
        splits.add(split)
        per_rank.append(list(planned_batches(iter(_chunks(indices, batch_size, drop_last)), split, rank,
                                             lambda: EMPTY)))
    assert len(splits) == 1, splits
    return splits.pop(), per_rank


CASES = list(itertools.product(SIZES, WORLDS, BATCHES, [False, True]))


@pytest.mark.parametrize("exact", [True, False])
def test_every_rank_has_the_same_batches_and_global_batches_are_contiguous(exact: bool) -> None:
    for n, world, batch_size, drop_last in CASES:
        order = _order(n)
        for start in range(n + 1):
            if not exact and start % world:
                continue  # a padded resume starts at a multiple of the world size
            case = f"n={n} world={world} B={batch_size} start={start} drop_last={drop_last}"
            split, per_rank = _split_of(n, world, start, batch_size, exact=exact, drop_last=drop_last)
            assert all(len(batches) == split.num_batches for batches in per_rank), case
            trained: list[int] = []
            for k in range(split.num_batches):
                counts = split.counts(k)
                rows = [per_rank[r][k] for r in range(world)]
                assert [len(p.batch) for p in rows] == counts == [p.count for p in rows], case
                assert sum(counts) == split.size_of(k) > 0, case
                weights = [p.weight for p in rows]
                assert weights == [c * world / sum(counts) for c in counts], case
                assert sum(weights) == pytest.approx(world), case
                if len(set(counts)) == 1:
                    assert weights == [1.0] * world, case  # bit for bit today's gradient
                # Rank r's batch k holds positions r, r + R, ... of global batch k.
                first = start + k * world * batch_size
                padded = order + order * world  # positions past n repeat the order (padding)
                union = sorted(i for p in rows for i in p.batch)
                assert union == sorted(padded[first:first + split.size_of(k)]), case
                for r in range(world):
                    assert rows[r].batch == [padded[q] for q in split.positions(r, k)], case
                trained += union
            assert split.end == split.consumed_after(split.num_batches) == start + len(trained), case
            if exact:
                counted = Counter(trained)
                assert max(counted.values(), default=1) == 1, case                       # none twice
                if not drop_last:
                    assert sorted(trained) == sorted(order[start:]), case                # none left out
                else:
                    assert len(trained) == (n - start) // (world * batch_size) * world * batch_size, case
            else:  # padded: equal sizes in every global batch, so every weight is 1
                assert all(len(set(split.counts(k))) == 1 for k in range(split.num_batches)), case


def test_only_the_last_global_batch_is_uneven_and_only_it_may_be_empty() -> None:
    for n, world, batch_size, drop_last in CASES:
        for start in range(n + 1):
            split = RestSplit(start=start, length=n - start, world=world, batch_size=batch_size,
                              drop_last=drop_last)
            for k in range(split.num_batches - 1):
                assert split.counts(k) == [batch_size] * world
            if split.num_batches:
                last = split.counts(split.num_batches - 1)
                assert last == sorted(last, reverse=True) and last[0] > 0  # rank 0 never empty
                assert max(last) - min(last) <= 1
                if drop_last:
                    assert last == [batch_size] * world


def test_the_issues_case_a_join_with_164_samples_left() -> None:
    # 4 samples per rank, the world grows from 2 to 3 with 164 left: 13 full global
    # batches of 12 and one of 8; padding would have trained one sample twice.
    n, start = 164 + 40, 40
    padded = [i for r in range(3) for i in _ranks_indices(n, 3, r, start, exact=False)]
    assert len(padded) == 165 and set(padded) & set(_order(n)[:start]) == {_order(n)[0]}  # trained twice
    split, per_rank = _split_of(n, 3, start, 4, exact=True, drop_last=False)
    assert split.num_batches == 14 and split.counts(13) == [3, 3, 2]
    assert [per_rank[r][13].weight for r in range(3)] == [9 / 8, 9 / 8, 6 / 8]
    assert split.end == n


def _ranks_indices(n: int, world: int, rank: int, start: int, *, exact: bool) -> list[int]:
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank)
    sampler.set_epoch(0, start, exact=exact)
    return list(sampler)


def test_a_rank_with_no_sample_left_gets_an_empty_batch_of_weight_zero() -> None:
    # 13 left over 3 ranks of 4: a full global batch, then one sample, on rank 0.
    split, per_rank = _split_of(20, 3, 7, 4, exact=True, drop_last=False)
    assert split.counts(1) == [1, 0, 0]
    assert [(p.batch is EMPTY, p.weight) for p in (per_rank[r][1] for r in range(3))] == \
        [(False, 3.0), (True, 0.0), (True, 0.0)]


def test_planned_batches_over_a_dataloader_and_the_empty_batch() -> None:
    data = TensorDataset(torch.arange(10.0).unsqueeze(1), torch.arange(10))
    sampler = DistributedSampler(data, num_replicas=3, rank=2, shuffle=False)
    sampler.set_epoch(0, 4, exact=True)  # 6 left: rank 2 has positions 6 and 9
    loader = DataLoader(data, batch_size=1, sampler=sampler)
    planned = list(planned_batches(iter(loader), sampler.split(1), 2,
                                   lambda: empty_batch(loader.collate_fn, data)))
    assert [p.batch[1].tolist() for p in planned] == [[6], [9]] and [p.weight for p in planned] == [1.0, 1.0]
    sampler.set_epoch(0, 5, exact=True)  # 5 left: rank 2 has position 7 only; its second batch is empty
    planned = list(planned_batches(iter(loader), sampler.split(1), 2,
                                   lambda: empty_batch(loader.collate_fn, data)))
    assert [p.count for p in planned] == [1, 0] and planned[1].weight == 0.0
    x, y = planned[1].batch
    assert (x.shape, x.dtype, y.shape, y.dtype) == ((0, 1), torch.float32, (0,), torch.int64)


def test_empty_batch_keeps_the_structure_and_refuses_what_has_no_tensor() -> None:
    batch = empty_batch(default_collate, [{"x": torch.ones(2, 3), "y": (torch.tensor(1), 5)}])
    assert batch["x"].shape == (0, 2, 3) and batch["y"][0].shape == (0,) and batch["y"][1].shape == (0,)
    with pytest.raises(TypeError, match="collate_fn returned a str without tensors"):
        empty_batch(lambda samples: "text", [0])


def test_a_dataloader_that_ends_early_is_reported() -> None:
    split = RestSplit(start=0, length=6, world=2, batch_size=1)
    with pytest.raises(RuntimeError, match="rank 0: the DataLoader ended after 1 batches"):
        list(planned_batches(iter([[0]]), split, 0, lambda: EMPTY))


@pytest.mark.parametrize("field,value", [("start", -1), ("length", -2), ("world", 0), ("batch_size", 0)])
def test_bad_split_is_refused(field: str, value: int) -> None:
    kwargs: dict[str, Any] = {"start": 0, "length": 4, "world": 2, "batch_size": 2, field: value}
    with pytest.raises(ValueError, match=f"{field}={value}"):
        RestSplit(**kwargs)


def test_sampler_drop_last_with_exact_cuts_to_the_world_as_before() -> None:
    # drop_last never pads, so exact changes nothing: the rest is cut to a multiple of R.
    for n, world, start in itertools.product(SIZES, WORLDS, range(0, 14)):
        if start > n:
            continue
        for rank in range(world):
            a = DistributedSampler(range(n), num_replicas=world, rank=rank, drop_last=True)
            b = DistributedSampler(range(n), num_replicas=world, rank=rank, drop_last=True)
            a.set_epoch(1, start)
            b.set_epoch(1, start, exact=True)
            assert list(a) == list(b)
