"""tandem.data.DistributedSampler equals torch's sampler index for index, splits
each epoch into a partition (plus minimal padding), and resumes mid-epoch.

Everything here runs in one process: every rank's sampler is built with explicit
num_replicas and rank, which is all a rank's sampler depends on.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import cast

import pytest
import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from tandem.data import DistributedSampler

SIZES = [1, 2, 3, 4, 5, 7, 8, 12, 13]
WORLDS = [1, 2, 3, 4]
FLAGS = list(itertools.product([False, True], [False, True]))   # (shuffle, drop_last)


def _ranks(n: int, world: int, epoch: int = 0, start: int = 0, **kwargs) -> list[list[int]]:
    """Every rank's indices for one epoch."""
    out = []
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, **kwargs)
        sampler.set_epoch(epoch, start)
        indices = list(sampler)
        assert len(indices) == len(sampler)
        out.append(indices)
    return out


def _global_order(n: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    if not shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def _indices(n: int) -> Dataset[int]:
    """``range(n)`` as torch's sampler types its dataset: it reads only the length."""
    return cast(Dataset[int], range(n))


@pytest.mark.parametrize("shuffle,drop_last", FLAGS)
def test_equals_torch_sampler(shuffle: bool, drop_last: bool) -> None:
    for n, world, seed, epoch in itertools.product([0, *SIZES], WORLDS, [0, 7], [0, 1, 3]):
        if n == 0 and drop_last:
            continue        # refused, see test_errors
        for rank in range(world):
            ours = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle,
                                      seed=seed, drop_last=drop_last)
            ref: TorchSampler[int] = TorchSampler(_indices(n), num_replicas=world, rank=rank, shuffle=shuffle,
                                                  seed=seed, drop_last=drop_last)
            ours.set_epoch(epoch)
            ref.set_epoch(epoch)
            case = f"n={n} world={world} rank={rank} seed={seed} epoch={epoch}"
            assert list(ours) == list(ref), case
            assert len(ours) == len(ref), case


@pytest.mark.parametrize("shuffle,drop_last", FLAGS)
def test_epoch_is_a_partition_with_minimal_padding(shuffle: bool, drop_last: bool) -> None:
    for n, world, epoch in itertools.product(SIZES, WORLDS, [0, 1]):
        shares = _ranks(n, world, epoch, shuffle=shuffle, drop_last=drop_last)
        counts = Counter(i for share in shares for i in share)
        total = sum(counts.values())
        case = f"n={n} world={world} epoch={epoch}"
        assert len({len(s) for s in shares}) == 1, case           # equal shares
        assert total % world == 0, case
        if drop_last:
            assert max(counts.values(), default=1) == 1, case     # no duplicates
            assert n - world < total <= n, case                   # fewer than `world` dropped
        else:
            assert set(counts) == set(range(n)), case
            assert total == math.ceil(n / world) * world, case    # fewer than `world` padded
            assert total - n < world, case


def test_shuffle_order_changes_with_epoch_and_follows_seed() -> None:
    orders = {epoch: _ranks(50, 1, epoch)[0] for epoch in range(3)}
    assert len({tuple(o) for o in orders.values()}) == 3
    assert _ranks(50, 1, 2, seed=5)[0] == _ranks(50, 1, 7)[0]     # seed + epoch


def test_without_set_epoch_every_epoch_repeats() -> None:
    # The pitfall the docstring warns about: the order only changes with set_epoch.
    sampler = DistributedSampler(range(20), num_replicas=2, rank=1)
    assert list(sampler) == list(sampler)


@pytest.mark.parametrize("shuffle,drop_last", FLAGS)
def test_resume_same_world_continues_exactly(shuffle: bool, drop_last: bool) -> None:
    for n, world in itertools.product(SIZES, WORLDS):
        full = _ranks(n, world, epoch=2, shuffle=shuffle, drop_last=drop_last, seed=1)
        for start in range(0, n + 1, world):
            resumed = _ranks(n, world, epoch=2, start=start, shuffle=shuffle, drop_last=drop_last,
                             seed=1)
            for rank in range(world):
                assert resumed[rank] == full[rank][start // world:], \
                    f"n={n} world={world} start={start} rank={rank}"


@pytest.mark.parametrize("shuffle,drop_last", FLAGS)
def test_resume_other_world_covers_the_rest_once(shuffle: bool, drop_last: bool) -> None:
    for n, old_world, new_world in itertools.product(SIZES, WORLDS, WORLDS):
        order = _global_order(n, shuffle, seed=0, epoch=4)
        for start in range(0, n + 1, old_world):
            shares = _ranks(n, new_world, epoch=4, start=start, shuffle=shuffle, drop_last=drop_last)
            case = f"n={n} {old_world}->{new_world} ranks, start={start}"
            assert len({len(s) for s in shares}) == 1, case
            yielded = Counter(i for share in shares for i in share)
            rest = Counter(order[start:])
            total = sum(yielded.values())
            assert total % new_world == 0, case
            if drop_last:
                assert not yielded - rest, case                   # nothing twice, nothing consumed
                assert 0 <= (n - start) - total < new_world, case
            else:
                assert not rest - yielded, case                   # every remaining sample ...
                padding = yielded - rest                          # ... once, plus the padding
                assert sum(padding.values()) == (-(n - start)) % new_world, case


def test_resume_pads_from_the_start_of_the_epoch_order() -> None:
    # 10 samples over 4 ranks, 4 done: 6 left, padded with order[0] and order[1].
    order = _global_order(10, True, seed=0, epoch=0)
    shares = _ranks(10, 4, start=4)
    assert [i for row in zip(*shares) for i in row] == order[4:] + order[:2]


def test_padding_repeats_the_whole_order_when_needed() -> None:
    # One sample left for 4 ranks after 2 of 3: padding of 3 cycles through the order.
    order = _global_order(3, True, seed=0, epoch=0)
    shares = _ranks(3, 4, start=2)
    assert [s[0] for s in shares] == [order[2], order[0], order[1], order[2]]


def test_len_follows_epoch_and_start() -> None:
    sampler = DistributedSampler(range(10), num_replicas=3, rank=2, drop_last=False)
    assert len(sampler) == 4
    sampler.set_epoch(1, start=6)
    assert (len(sampler), len(list(sampler))) == (2, 2)
    sampler.set_epoch(1, start=10)
    assert (len(sampler), list(sampler)) == (0, [])
    sampler.set_epoch(2)                                          # a new epoch starts at 0
    assert (sampler.start, len(sampler)) == (0, 4)


def test_properties_and_defaults_without_process_group() -> None:
    sampler = DistributedSampler(range(9), shuffle=False, seed=3, drop_last=True)
    assert (sampler.num_replicas, sampler.rank, sampler.dataset_size) == (1, 0, 9)
    assert (sampler.epoch, sampler.start, sampler.shuffle, sampler.seed, sampler.drop_last) == \
        (0, 0, False, 3, True)
    sampler.set_epoch(5, 2)
    assert (sampler.epoch, sampler.start) == (5, 2)
    with pytest.raises(AttributeError):
        sampler.epoch = 1  # type: ignore[misc]


def test_state_dict_round_trip_resumes_at_another_world_size() -> None:
    saved = DistributedSampler(range(13), num_replicas=2, rank=0, seed=4)
    saved.set_epoch(3, 6)
    state = saved.state_dict()
    assert {k: state[k] for k in ("epoch", "start", "seed")} == {"epoch": 3, "start": 6, "seed": 4}
    shares = []
    for rank in range(3):
        sampler = DistributedSampler(range(13), num_replicas=3, rank=rank, seed=4)
        sampler.load_state_dict(state)
        assert (sampler.epoch, sampler.start) == (3, 6)
        shares.append(list(sampler))
    order = _global_order(13, True, 4, 3)
    # The 7 samples left, then 2 of padding from the start of the epoch's order.
    assert [i for row in zip(*shares) for i in row] == order[6:] + order[:2]


def test_load_state_dict_refuses_another_order() -> None:
    state = DistributedSampler(range(8), num_replicas=1, rank=0, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1 was saved, this sampler has seed=2"):
        DistributedSampler(range(8), num_replicas=1, rank=0, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle=True was saved, this sampler has shuffle=False"):
        DistributedSampler(range(8), num_replicas=1, rank=0, seed=1, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match="8 samples was saved, this sampler has 9"):
        DistributedSampler(range(9), num_replicas=1, rank=0, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"no \['start'\]"):
        DistributedSampler(range(8), seed=1).load_state_dict({k: v for k, v in state.items() if k != "start"})
    # Without shuffling the seed does not shape the order, so it may differ.
    unshuffled = DistributedSampler(range(8), shuffle=False, seed=1).state_dict()
    DistributedSampler(range(8), shuffle=False, seed=2).load_state_dict(unshuffled)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_replicas=2, rank=2), r"rank=2 is outside \[0, 1\]"),
    (dict(num_replicas=2, rank=-1), r"rank=-1 is outside \[0, 1\]"),
    (dict(num_replicas=0, rank=0), "num_replicas=0, it must be at least 1"),
])
def test_constructor_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DistributedSampler(range(4), **kwargs)


def test_errors() -> None:
    with pytest.raises(ValueError, match="empty and drop_last=True"):
        DistributedSampler([], num_replicas=2, rank=0, drop_last=True)
    with pytest.raises(TypeError, match="has no __len__"):
        DistributedSampler(iter(range(3)))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="rank must be an int"):
        DistributedSampler(range(3), num_replicas=2, rank=0.5)  # type: ignore[arg-type]
    sampler = DistributedSampler(range(5), num_replicas=2, rank=1)
    with pytest.raises(ValueError, match=r"rank 1\): start=-1 is outside \[0, 5\]"):
        sampler.set_epoch(0, -1)
    with pytest.raises(ValueError, match=r"start=6 is outside \[0, 5\]"):
        sampler.set_epoch(0, 6)
    assert (sampler.epoch, sampler.start) == (0, 0)               # a refused call changes nothing


def test_dataset_that_changed_size_is_refused() -> None:
    data = list(range(6))
    sampler = DistributedSampler(data, num_replicas=2, rank=0)
    data.append(6)
    with pytest.raises(RuntimeError, match="had 6 samples at construction and has 7 now"):
        list(sampler)
