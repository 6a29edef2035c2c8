"""The state a ZeRO world change sends (Note [elastic ZeRO] in
tandem/elastic/zero_shards.py): each old rank's entries, cut to each new rank's
rows of every parameter (``cut_entries``); every new rank, assembling what the
old ranks sent it, holds exactly its rows' state, and each element travels once.
Checked on the shard layouts of DDP's bucket plans (padded to each world) for
every pair of worlds from 1 to 5, parameters that a shard cuts and that it
holds whole, with a per-parameter scalar beside the per-element state.
"""

from __future__ import annotations

import random

import pytest
import torch

from tandem.ddp.plan import ParamInfo, plan_buckets
from tandem.zero import shard_bucket
from tandem.zero.state_dict import Entry, assemble_state, cut_entries

CPU = torch.device("cpu")


def _rows(params: list[ParamInfo], world: int, cap: int) -> list[list[tuple[int, int, int]]]:
    """Each rank's rows at ``world``: the pieces of its shard of every bucket (state index = param index)."""
    plan = plan_buckets(params, list(reversed(range(len(params)))), [cap], pad_to=world)
    shards = [shard_bucket(spec, world) for spec in plan.buckets]
    return [[(p.param, p.param_start, p.length) for bucket in shards for p in bucket[r].pieces]
            for r in range(world)]


@pytest.mark.parametrize("seed", range(12))
def test_each_new_rank_receives_exactly_its_rows_state_and_each_element_once(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.choice([1, 3, 7, 33, 100]) for _ in range(rng.randint(1, 8))]
    params = [ParamInfo(f"p{i}", n, torch.float32, CPU) for i, n in enumerate(sizes)]
    moments = {i: torch.arange(float(n)) + 1000 * i for i, n in enumerate(sizes)}
    shapes: dict[int, tuple[int, ...]] = {i: (n,) for i, n in enumerate(sizes)}
    cap = rng.choice([16, 64, 1 << 20])
    for old_world in range(1, 6):
        old = [[(i, start, length, {"exp_avg": moments[i][start:start + length].clone(), "step": torch.tensor(3.0)})
                for i, start, length in rows] for rows in _rows(params, old_world, cap)]
        for new_world in range(1, 6):
            new_rows = _rows(params, new_world, cap)
            sent: list[list[list[Entry]]] = [[cut_entries(entries, rows) for rows in new_rows] for entries in old]
            # Each element travels once: to one new rank, from one old rank.
            assert sum(e[2] for per_old in sent for per_new in per_old for e in per_new) == sum(sizes)
            for j, rows in enumerate(new_rows):
                got = [e for per_old in sent for e in per_old[j]]
                state = assemble_state([got], [], shapes)["state"]
                for i, start, length in rows:
                    assert torch.equal(state[i]["exp_avg"][start:start + length], moments[i][start:start + length]), \
                        (seed, old_world, new_world, j, i)
                    assert state[i]["step"].item() == 3.0
                held = {i: 0 for i in range(len(sizes))}
                for i, _, length, _ in got:
                    held[i] += length
                assert held == {i: sum(n for k, _, n in rows if k == i) for i in range(len(sizes))}


def test_a_cut_is_a_view_of_the_entry_and_a_scalar_is_kept_as_it_is() -> None:
    moment = torch.arange(10.0)
    step = torch.tensor(4.0)
    (cut,) = cut_entries([(0, 5, 5, {"exp_avg": moment[5:], "step": step})], [(0, 3, 4), (1, 0, 10)])
    assert cut[:3] == (0, 5, 2)
    assert torch.equal(cut[3]["exp_avg"], torch.tensor([5.0, 6.0]))
    assert cut[3]["exp_avg"].data_ptr() == moment[5:].data_ptr() and cut[3]["step"] is step
    assert cut_entries([(2, 0, 4, {"exp_avg": torch.zeros(4)})], [(0, 0, 4)]) == []
