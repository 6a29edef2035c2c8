"""A fully-sharded model in an elastic job: this rank's shard of the parameters
and of their optimizer state (:func:`fsdp_shard`, what the buddy copies hold),
and the old world's shards laid out again for a new one (:func:`load_fsdp_shards`).

# Note [elastic fully_shard]
Under fully_shard a rank is the only one that holds its rows of every
parameter and of the parameters' optimizer state (Adam's moments are DTensors
laid out as the parameters). So its buddy copy (Note [buddy copies] in
buddy.py) holds both: per unit, per parameter, the local rows of the
parameter and of each per-element state tensor, and the per-tensor values
(Adam's step) as they are. It costs one shard of parameters and one of
optimizer state per rank, and sending them to the next rank after every step.

When the world changes (a loss, or a replacement joining: the same path),
every rank of the new world

1. says which old shards it holds (its own and, for a lost rank, its copy),
   and all agree who provides each one (``BuddyCopies.locate``); a shard on
   no survivor raises ShardsLost before anything is changed, and the job
   falls back to the last checkpoint;
2. lays the units out for the new world (Note [regrouped units] in
   tandem/fsdp/regroup.py);
3. receives from each old rank's provider the rows of each parameter of each
   unit, and of each state tensor, that fall in its own new rows
   (``BuddyCopies.exchange``, one all-to-all for the whole model: the old
   chunks are consecutive rows, and so are the new, so each row travels once,
   to the rank that holds it next), and, unit by unit, concatenates them in
   old rank order: its new rows. No unit is ever whole on a rank; what a rank
   receives is its new shard, one shard more of memory until it is loaded
   (fewer rounds than an all-to-all a unit, whose latency a world change
   waits on).

The optimizer keeps its parameter objects: regroup.py re-points each sharded
parameter in place, so ``param_groups`` and the keys of ``optimizer.state``
stay valid, and only the state's values are replaced by new DTensors over the
new mesh (the old ones are laid out for the old world). A replacement's
optimizer has no state yet; it receives all of it the same way. Replacing
the parameter objects instead would have meant rewriting ``param_groups``,
and would have left a scheduler, a gradient clipper or a user holding stale
tensors.

Hyper-parameters (``param_groups``) are the same on every rank and are not
part of a shard; a replacement gets rank 0's scheduler and counters with the
rest of the loop state (world.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tandem._compat import dtensor_api, dtensor_local
from tandem.fsdp.regroup import units_of
from tandem.fsdp.unit import ShardedUnit

__all__ = ["fsdp_shard", "load_fsdp_shards"]

FORMAT = "tandem.fsdp_shard.v1"


def fsdp_shard(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shard of a fully-sharded ``model`` and of ``optimizer``'s
    state (Note [elastic fully_shard]): views of the live tensors, no copy and
    no communication. ``units`` lists, per unit in module order, per parameter:
    ``{"fqn", "param": local rows, "rows": {key: local rows of a per-element
    state}, "values": {key: any other state}}``."""
    DTensor = dtensor_api()[0]
    units = units_of(model)
    rank, world = (units[0].comm.rank, units[0].comm.size) if units else (0, 1)
    pieces = []
    for unit in units:
        params = []
        for m in unit.params.managed:
            state = optimizer.state.get(m.sharded, {})
            rows = {k: dtensor_local(v).detach() for k, v in state.items()
                    if isinstance(v, DTensor) and v.shape == m.sharded.shape}
            params.append({"fqn": m.fqn, "param": dtensor_local(m.sharded).detach(), "rows": rows,
                           "values": {k: v for k, v in state.items() if k not in rows}})
        pieces.append(params)
    return {"format": FORMAT, "rank": rank, "world_size": world, "units": pieces}


def load_fsdp_shards(model: nn.Module, optimizer: torch.optim.Optimizer,
                     exchange: Callable[[Callable[[int, dict[str, Any]], list[Any]]], dict[int, Any]]) -> None:
    """Load every old rank's shard into ``model`` (laid out for the new world
    already: ``reset_process_group``) and ``optimizer`` (Note [elastic
    fully_shard]). ``exchange(parts)`` returns, for every old rank,
    ``parts(old, shard)[r]`` of its shard, r being this rank (a collective).

    Raises:
        ValueError: the shards name other units or parameters than the model's.
    """
    units = units_of(model)
    if not units:
        return
    received = exchange(functools.partial(_rows_of_every_unit, units=units))
    for index, unit in enumerate(units):
        pieces = [received[old][index] for old in sorted(received)]
        for k, m in enumerate(unit.params.managed):
            old = [piece[k] for piece in pieces]
            wrong = next((o["fqn"] for o in old if o["fqn"] != m.fqn), None)
            if wrong is not None:
                raise ValueError(f"rank {unit.comm.rank}: the old world's shard holds '{wrong}' "
                                 f"where unit '{unit.name}' has '{m.fqn}': every rank must build and "
                                 "fully_shard the same model")
            d = m.spec.shard_dim
            with torch.no_grad():
                dtensor_local(m.sharded).copy_(torch.cat([o["param"] for o in old], d))
            state: dict[str, Any] = {}
            for key in old[0]["rows"]:
                local = torch.cat([o["rows"][key] for o in old], d).to(unit.config.shard_device).contiguous()
                state[key] = unit.params.to_dtensor(local, m.spec)
            for key, value in old[0]["values"].items():
                state[key] = value.clone() if torch.is_tensor(value) else value
            if state:
                optimizer.state[m.sharded] = state
            else:
                optimizer.state.pop(m.sharded, None)


def _rows_of_every_unit(old: int, shard: dict[str, Any], *, units: list[ShardedUnit]) -> list[Any]:
    """What of old rank ``old``'s shard each new rank holds: per new rank, per
    unit, :func:`_rows_for_each_rank`'s part."""
    if len(shard["units"]) != len(units):
        raise ValueError(f"rank {units[0].comm.rank}: old rank {old}'s shard holds {len(shard['units'])} "
                         f"unit(s), the model {len(units)}: every rank must build and fully_shard the same model")
    per_unit = [_rows_for_each_rank(old, shard, unit=unit, index=i) for i, unit in enumerate(units)]
    return [list(parts) for parts in zip(*per_unit)]


def _rows_for_each_rank(old: int, shard: dict[str, Any], *, unit: ShardedUnit, index: int) -> list[Any]:
    """What of old rank ``old``'s piece of unit ``index`` (in ``shard``, of
    :func:`fsdp_shard`) each new rank holds: per new rank, per parameter, the
    rows of the parameter and of each per-element state that fall in that rank's
    new chunk (none, where they do not meet), with the per-tensor values."""
    piece = shard["units"][index]
    managed = unit.params.managed
    if len(piece) != len(managed):
        raise ValueError(f"rank {unit.comm.rank}: old rank {old}'s shard holds {len(piece)} parameter(s) in unit "
                         f"'{unit.name}', which has {len(managed)}: every rank must build and fully_shard the "
                         "same model")
    out: list[list[dict[str, Any]]] = [[] for _ in range(unit.comm.size)]
    for m, p in zip(managed, piece):
        d = m.spec.shard_dim
        rows = m.spec.shape[d]
        start = min(old * -(-rows // shard["world_size"]), rows)  # the old chunk's first row
        held = p["param"].shape[d]
        for j, to in enumerate(out):
            first = min(j * m.spec.chunk_rows, rows)  # new rank j's chunk
            lo, hi = max(start, first), min(start + held, first + m.spec.chunk_rows, rows)
            at, n = (lo - start, hi - lo) if hi > lo else (0, 0)
            to.append({"fqn": p["fqn"], "param": p["param"].narrow(d, at, n),
                       "rows": {key: v.narrow(d, at, n) for key, v in p["rows"].items()}, "values": p["values"]})
    return out
