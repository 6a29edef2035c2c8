"""Pure bucket planning, checked on grids of sizes in one process, and against
torch's own bucket assignment."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from tandem.ddp.plan import (DEFAULT_FIRST_BUCKET_BYTES, SOLO_BYTES, ParamInfo, cap_bytes_from_mb,
                             plan_buckets, plan_ddp_buckets)

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.float64, torch.float16]


def _random_params(rng: random.Random, n: int, mixed: bool) -> list[ParamInfo]:
    return [ParamInfo(f"p{i}", rng.choice([1, 3, 7, 64, 1000, 5000]),
                      rng.choice(DTYPES) if mixed else torch.float32, CPU) for i in range(n)]


@pytest.mark.parametrize("seed", range(40))
def test_plan_matches_torch_assignment_and_keeps_invariants(seed: int) -> None:
    rng = random.Random(seed)
    params = _random_params(rng, rng.randint(1, 40), mixed=seed % 2 == 1)
    order = list(range(len(params)))
    rng.shuffle(order)
    caps = rng.choice([[100], [64, 4096], [1 << 30], [8, 16, 32]])
    pad_to = rng.choice([1, 2, 3, 4])
    plan = plan_buckets(params, order, caps, pad_to=pad_to, last_bucket_extra=1)

    # Same assignment as torch's C++ planner for the same order and caps.
    tensors = [torch.empty(params[i].numel, dtype=params[i].dtype) for i in order]
    expected, _ = dist._compute_bucket_assignment_by_size(tensors, caps, [False] * len(order),
                                                         list(range(len(order))))
    assert sorted(list(b.params) for b in plan.buckets) == sorted([order[k] for k in b]
                                                                  for b in expected)

    # Every parameter in exactly one bucket; buckets homogeneous and contiguous.
    assert sorted(i for b in plan.buckets for i in b.params) == list(range(len(params)))
    fill: dict = {}
    for k, b in enumerate(plan.buckets):
        assert b.index == k
        assert all(params[i].dtype == b.dtype for i in b.params)
        assert list(b.offsets) == [sum(params[j].numel for j in b.params[:pos])
                                   for pos in range(len(b.params))]
        assert b.numel == sum(params[i].numel for i in b.params)
        assert b.extra == (1 if k == len(plan.buckets) - 1 else 0)
        assert b.padded_numel % pad_to == 0 and 0 <= b.padded_numel - b.numel - b.extra < pad_to
        key = (b.device, b.dtype)
        assert b.buffer_offset == fill.get(key, 0)
        fill[key] = b.buffer_offset + b.padded_numel
    assert plan.buffer_numel == fill
    # Launch order is fill order: a bucket is numbered by when its last parameter fills.
    position = {i: p for p, i in enumerate(order)}
    lasts = [position[b.params[-1]] for b in plan.buckets]
    assert lasts == sorted(lasts)


def test_default_caps_are_torchs() -> None:
    assert cap_bytes_from_mb(None) == [DEFAULT_FIRST_BUCKET_BYTES, 25 * 1024 * 1024]
    assert DEFAULT_FIRST_BUCKET_BYTES == dist._DEFAULT_FIRST_BUCKET_BYTES
    assert cap_bytes_from_mb(2) == [2 * 1024 * 1024]
    assert cap_bytes_from_mb(None, [1, 3]) == [1024 * 1024, 3 * 1024 * 1024]


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_caps_are_named(bad: float) -> None:
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        cap_bytes_from_mb(bad)
    with pytest.raises(ValueError, match="bucket_cap_mb_list"):
        cap_bytes_from_mb(None, [1, bad])


def test_order_must_be_a_permutation() -> None:
    params = [ParamInfo("a", 4, torch.float32, CPU), ParamInfo("b", 4, torch.float32, CPU)]
    with pytest.raises(ValueError, match="permutation"):
        plan_buckets(params, [0, 0], [100])


def test_describe_names_sizes() -> None:
    params = [ParamInfo(f"p{i}", 1 << 18, torch.float32, CPU) for i in range(8)]  # 1 MiB each
    plan = plan_buckets(params, list(reversed(range(8))), cap_bytes_from_mb(None))
    assert plan.describe() == "8 params in 2 buckets, first 1.0 MiB, largest 7.0 MiB"


def test_solo_buckets_stand_alone_and_the_flag_bucket_goes_last() -> None:
    """Note [solo buckets]: parameters of at least solo_bytes get a bucket of their own,
    outside the flat buffer; the others are bucketed as without them; the control
    elements go to the last shared bucket, launched last."""
    sizes = [100, 5000, 100, 6000, 100, 7000]  # fill order: registration reversed
    params = [ParamInfo(f"p{i}", n, torch.float32, CPU) for i, n in enumerate(sizes)]
    order = list(reversed(range(len(params))))
    plan = plan_buckets(params, order, [1 << 20], pad_to=2, last_bucket_extra=1, solo_bytes=4 * 4000)
    assert [b.params for b in plan.buckets] == [(5,), (3,), (1,), (4, 2, 0)]
    assert [b.solo for b in plan.buckets] == [True, True, True, False]
    assert plan.buckets[-1].extra == 1 and all(b.extra == 0 for b in plan.buckets[:-1])
    assert plan.buffer_numel == {(CPU, torch.float32): 302}  # 300 + 1 extra, padded to 2
    assert plan.buckets[-1].buffer_offset == 0
    without = plan_buckets(params, order, [1 << 20], pad_to=2, last_bucket_extra=1)
    assert [b.params for b in without.buckets] == [(5, 4, 3, 2, 1, 0)]


def test_solo_buckets_on_an_accelerator_start_at_the_cap() -> None:
    """Note [solo buckets]: on the CPU a parameter of SOLO_BYTES or more is solo; on
    an accelerator only one of at least the bucket cap (each collective costs the
    host there), so GPT-2 small's 7-9 MiB weights share buckets as in torch."""
    mib = 1 << 20
    sizes_mib = [9, 0.01, 7, 0.01, 30, 5]  # a 30 MiB embedding, 5-9 MiB weights
    caps = cap_bytes_from_mb(None)  # 1 MiB first, then 25 MiB
    for device, solo in ((CPU, {0, 2, 4, 5}), (torch.device("cuda", 0), {4})):
        params = [ParamInfo(f"p{i}", int(m * mib) // 4, torch.float32, device) for i, m in enumerate(sizes_mib)]
        plan = plan_ddp_buckets(params, list(reversed(range(len(params)))), caps, 2, zero=False,
                                gradient_as_bucket_view=False, check_finite=False)
        assert {b.params[0] for b in plan.buckets if b.solo} == solo, device
        assert sorted(i for b in plan.buckets for i in b.params) == list(range(len(params)))
    assert SOLO_BYTES < caps[-1]
