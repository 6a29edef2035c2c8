"""Seeding and RNG capture (tandem.checkpoint.rng) against the generators' own APIs:
draws after ``seed_everything(s)`` equal those of a fresh ``random.Random(s)``,
``numpy.random.RandomState(s)`` and ``torch.Generator().manual_seed(s)``, on every
rank; per-rank streams are those of ``rank_seed(s, rank)``, differ between ranks and
follow the rank of the process group; a captured state restores the same draws,
also after a trip through ``torch.save`` and ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import os
import random
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tandem.testing import run_distributed
from tandem.checkpoint.rng import capture_rng_state, rank_seed, restore_rng_state, seed_everything

N = 5


def _draws() -> dict[str, list[float]]:
    """Draws from the global generators, including Gaussians, which keep a cached
    second value in the generator's state (Python and numpy)."""
    return {"python": [random.random() for _ in range(N)] + [random.gauss(0, 1) for _ in range(3)],
            "numpy": np.random.rand(N).tolist() + np.random.randn(3).tolist(),
            "torch": torch.rand(N).tolist() + torch.randn(3).tolist()}


def _reference_draws(seed: int) -> dict[str, list[float]]:
    """The same draws from private generators seeded with ``seed``."""
    py = random.Random(seed)
    rs = np.random.RandomState(seed % 2**32)
    gen = torch.Generator().manual_seed(seed)
    return {"python": [py.random() for _ in range(N)] + [py.gauss(0, 1) for _ in range(3)],
            "numpy": rs.rand(N).tolist() + rs.randn(3).tolist(),
            "torch": torch.rand(N, generator=gen).tolist() + torch.randn(3, generator=gen).tolist()}


def _seeded(seed: int, **kwargs) -> tuple[int, dict[str, list[float]]]:
    applied = seed_everything(seed, **kwargs)
    return applied, _draws()


def _ranks(rank: int, world_size: int, seed: int) -> dict[str, Any]:
    """Before the process group exists, the rank comes from ``RANK``; afterwards from
    the group, where this test numbers the ranks the other way round."""
    out: dict[str, Any] = {"env": _seeded(seed, per_rank=True)}
    group_rank = world_size - 1 - rank
    dist.init_process_group("gloo", init_method=f"file://{os.environ['TANDEM_TEST_STORE']}",
                            rank=group_rank, world_size=world_size)
    out["group_rank"] = group_rank
    out["same"] = _seeded(seed)
    out["per_rank"] = _seeded(seed, per_rank=True)
    out["per_rank_again"] = _seeded(seed, per_rank=True)
    # Neither rank may exit before the other has finished connecting: gloo's
    # full-mesh connect fails with "Connection closed by peer" otherwise.
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_seed_everything_on_two_ranks() -> None:
    seed = 1234
    results = run_distributed(_ranks, 2, args=(seed,), init_process_group=False, timeout=60)
    for rank, r in enumerate(results):
        assert r["same"] == (seed, _reference_draws(seed)), f"rank {rank}"
        derived = rank_seed(seed, r["group_rank"])
        assert r["per_rank"] == (derived, _reference_draws(derived)), f"rank {rank}"
        assert r["per_rank_again"] == r["per_rank"], f"rank {rank}: not reproducible"
        env_derived = rank_seed(seed, rank)
        assert r["env"] == (env_derived, _reference_draws(env_derived)), f"rank {rank}"
    a, b = (r["per_rank"][1] for r in results)
    assert all(a[k] != b[k] for k in a), "per-rank streams coincide"


def test_seed_everything_with_explicit_rank_in_one_process() -> None:
    assert _seeded(7, per_rank=True, rank=3) == (rank_seed(7, 3), _reference_draws(rank_seed(7, 3)))
    big = 2**63 - 1  # numpy takes 32 bits of it; the others all 63
    assert _seeded(big) == (big, _reference_draws(big))


def test_rank_seeds_are_distinct_and_in_range() -> None:
    assert rank_seed(0, 1) != rank_seed(1, 0)
    seeds = {rank_seed(s, r) for s in range(16) for r in range(16)}
    assert len(seeds) == 256  # seed + rank would give 31
    assert all(0 <= s < 2**63 for s in seeds)
    assert rank_seed(5, 2) == rank_seed(5, 2)


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True, "3", None])
def test_bad_seed_raises_value_error(seed: object) -> None:
    before = torch.get_rng_state()
    with pytest.raises(ValueError, match="seed"):
        seed_everything(seed)  # type: ignore[arg-type]
    assert torch.equal(torch.get_rng_state(), before), "a rejected seed changed the generator"


def test_capture_and_restore_round_trip() -> None:
    seed_everything(99)
    _draws()  # three Gaussians leave a cached one in Python's and numpy's state
    numpy_state = np.random.get_state()
    assert isinstance(numpy_state, tuple)  # the legacy form: (..., has_gauss, cached_gaussian)
    assert random.getstate()[2] is not None and numpy_state[3] == 1
    state = capture_rng_state()
    expected = _draws()

    _draws()  # move on, then come back
    restore_rng_state(state)
    assert _draws() == expected

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    seed_everything(5)
    restore_rng_state(loaded)
    assert _draws() == expected

    # A state whose tuples became lists (a serialiser that knows no tuples).
    listed = dict(loaded, python=[loaded["python"][0], list(loaded["python"][1]), loaded["python"][2]])
    seed_everything(6)
    restore_rng_state(listed)
    assert _draws() == expected
