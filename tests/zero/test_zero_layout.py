"""ZeRO's pure parts: shards of DDP's buckets, and the memory planner."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from tandem.ddp.plan import ParamInfo, plan_buckets
from tandem.zero import estimate_memory, shard_bucket

CPU = torch.device("cpu")


@pytest.mark.parametrize("seed", range(30))
def test_shards_tile_every_bucket_and_every_parameter_once(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.choice([1, 2, 3, 4, 7])
    params = [ParamInfo(f"p{i}", rng.choice([1, 5, 33, 100, 1000]), torch.float32, CPU)
              for i in range(rng.randint(1, 25))]
    plan = plan_buckets(params, list(reversed(range(len(params)))), [rng.choice([64, 512, 1 << 20])],
                        pad_to=world, last_bucket_extra=1)
    covered: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(params))}
    for spec in plan.buckets:
        shards = shard_bucket(spec, world)
        assert [s.rank for s in shards] == list(range(world))
        assert [s.start for s in shards] == [r * spec.padded_numel // world for r in range(world)]
        assert sum(s.length for s in shards) == spec.padded_numel
        for s in shards:
            for piece in s.pieces:
                # The piece's place in the bucket is the parameter's offset plus its start.
                k = spec.params.index(piece.param)
                assert s.start + piece.shard_offset == spec.offsets[k] + piece.param_start
                covered[piece.param].append((piece.param_start, piece.length))
        assert sum(s.padding for s in shards) == spec.padded_numel - spec.numel
    for i, ranges in covered.items():
        ranges.sort()
        pos = 0
        for start, length in ranges:
            assert start == pos and length > 0
            pos += length
        assert pos == params[i].numel


def test_shard_rejects_a_bucket_planned_for_another_world() -> None:
    plan = plan_buckets([ParamInfo("w", 10, torch.float32, CPU)], [0], [1 << 20], pad_to=2)
    with pytest.raises(ValueError, match="world_size=4"):
        shard_bucket(plan.buckets[0], 4)


def test_memory_planner_shards_what_each_stage_promises() -> None:
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 8))
    n = sum(p.numel() for p in model.parameters())
    stages = estimate_memory(model, 4, optimizer_bytes_per_param=8, bucket_cap_mb=0.1)
    s0, s1, s2, s3 = stages
    assert s0.buckets is not None and not any(b.solo for b in s0.buckets.buckets)   # every weight < 4 MiB
    flat = 4 * sum(b.padded_numel for b in s0.buckets.buckets)   # DDP's flat buffer: + flag + padding
    assert flat - 4 * n in (4, 8, 12, 16)
    assert (s0.params, s0.grads, s0.optimizer) == (4 * n, flat, 8 * n)  # param.grad is its view of the buffer
    assert s1.params == flat and s1.grads == flat // 4   # parameters in their bucket; the gradient shards
    assert s1.optimizer == pytest.approx(8 * n / 4, rel=0.01)   # Adam's moments, 1/4; fp32: no master copy
    assert s2.grads == flat // 4 and s2.optimizer == s1.optimizer and s2.params == s1.params
    # the buckets, gradients accumulated into them, and autograd's new gradient of the largest parameter
    assert s1.reducing == s2.reducing == flat + 4 * 256 * 256
    assert s3.params == pytest.approx(s0.params / 4, rel=0.01)
    assert [e.total for e in stages[:3]] == sorted((e.total for e in stages[:3]), reverse=True)
    # Stage 3 holds the least between steps; its peaks (gathered units, gradients
    # being reduced) are tests/fsdp/test_fsdp_memory.py's subject.
    steady = [e.steady for e in stages]
    assert steady[3] == min(steady)
    one = estimate_memory(model, 1)
    assert one[0].grads == 4 * n   # a world of one builds no reducer: param.grad only
