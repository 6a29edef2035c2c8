"""The rows a fully-sharded world change sends (Note [elastic fully_shard] in
tandem/elastic/fsdp_shards.py): each old rank's chunk of a parameter and of its
per-element state, cut into the pieces each new rank holds; every new rank,
concatenating what each old rank sent it in old rank order, has exactly its new
chunk. Checked against the chunks of whole tensors (ceil(rows / world) rows a
rank, the last ones short or empty) for every pair of worlds from 1 to 5, row
counts that divide and do not, none, and a shard dim other than 0.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tandem.elastic.fsdp_shards import _rows_for_each_rank, _rows_of_every_unit


def _chunk(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    rows = full.shape[dim]
    per = -(-rows // world)
    start = min(rank * per, rows)
    return full.narrow(dim, start, min(start + per, rows) - start)


def _unit(full: torch.Tensor, dim: int, new_world: int) -> Any:
    """What _rows_for_each_rank reads of a unit laid out for ``new_world``: one parameter."""
    spec = SimpleNamespace(shard_dim=dim, shape=tuple(full.shape), chunk_rows=-(-full.shape[dim] // new_world))
    return SimpleNamespace(params=SimpleNamespace(managed=[SimpleNamespace(spec=spec, fqn="w")]),
                           comm=SimpleNamespace(size=new_world, rank=0), name="unit")


@pytest.mark.parametrize("shape, dim", [((16, 3), 0), ((17, 2), 0), ((2, 4), 0), ((1,), 0), ((0, 3), 0),
                                        ((3, 7), 1)])
def test_each_new_rank_receives_exactly_its_new_chunk(shape: tuple[int, ...], dim: int) -> None:
    full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    moment = -full  # a per-element state, laid out as the parameter
    for old_world in range(1, 6):
        for new_world in range(1, 6):
            unit = _unit(full, dim, new_world)
            shards = [{"world_size": old_world, "units": [[{
                "fqn": "w", "param": _chunk(full, dim, old, old_world),
                "rows": {"exp_avg": _chunk(moment, dim, old, old_world)}, "values": {"step": 3}}]]}
                for old in range(old_world)]
            sent = [_rows_for_each_rank(old, shard, unit=unit, index=0) for old, shard in enumerate(shards)]
            for old in range(old_world):  # each row travels once: to one new rank, no more
                held = _chunk(full, dim, old, old_world).shape[dim]
                assert sum(sent[old][j][0]["param"].shape[dim] for j in range(new_world)) == held
            for j in range(new_world):
                pieces = [sent[old][j][0] for old in range(old_world)]
                assert all(p["fqn"] == "w" and p["values"] == {"step": 3} for p in pieces)
                got = torch.cat([p["param"] for p in pieces], dim)
                assert torch.equal(got, _chunk(full, dim, j, new_world)), (shape, old_world, new_world, j)
                state = torch.cat([p["rows"]["exp_avg"] for p in pieces], dim)
                assert torch.equal(state, _chunk(moment, dim, j, new_world)), (shape, old_world, new_world, j)


def test_a_shard_of_another_model_is_refused_naming_the_old_rank() -> None:
    full = torch.zeros(4, 2)
    shard = {"world_size": 2, "units": [[{"fqn": "w", "param": full[:2], "rows": {}, "values": {}}] * 2]}
    with pytest.raises(ValueError, match="old rank 1's shard holds 2 parameter"):
        _rows_for_each_rank(1, shard, unit=_unit(full, 0, 3), index=0)
    with pytest.raises(ValueError, match="old rank 1's shard holds 1 unit"):
        _rows_of_every_unit(1, shard, units=[_unit(full, 0, 3)] * 2)


def test_each_new_rank_gets_a_part_of_every_unit_in_unit_order() -> None:
    # Two units of other shapes, from old world 2 to new world 3: per new rank, one part a unit.
    a, b = torch.arange(10.0).reshape(5, 2), torch.arange(21.0).reshape(7, 3)
    shards = [{"world_size": 2, "units": [[{"fqn": "w", "param": _chunk(t, 0, old, 2), "rows": {},
                                            "values": {}}] for t in (a, b)]} for old in range(2)]
    units = [_unit(a, 0, 3), _unit(b, 0, 3)]
    sent = [_rows_of_every_unit(old, shard, units=units) for old, shard in enumerate(shards)]
    for j in range(3):
        for k, full in enumerate((a, b)):
            got = torch.cat([sent[old][j][k][0]["param"] for old in range(2)])
            assert torch.equal(got, _chunk(full, 0, j, 3)), (j, k)
