"""A ZeRO optimizer in an elastic job: this rank's shard (:func:`zero_shard`,
what the buddy copies hold), and the old world's shards laid out again for a
new one (:func:`load_zero_shards`).

# Note [elastic ZeRO]
Under ZeRO a rank is the only one that holds its rows of the optimizer state
(Adam's moments over its shard of each bucket: Note [shard runs] in
tandem/zero/optimizer.py). Its buddy copy (Note [buddy copies] in buddy.py)
holds that state as entries, one per piece of a parameter (``(index, start,
length, values)``: tandem/zero/state_dict.py), and the same pieces of the
parameters (``param_rows``), with which a rank whose parameters are not those
of the step recovered sets them again (Note [one step back] there).

When the world changes, every rank of the new world says which old shards it
holds and the step its own parameters are of, and all agree who provides each
shard (``BuddyCopies.locate``). The optimizer is laid out for the new world
(``reset_process_group``), so each provider knows every new rank's rows
(``ZeroOptimizer.rows_of_ranks``): it cuts each old shard's entries to each new
rank's rows (``cut_entries``) and one all-to-all sends each piece to the rank
that holds it next (``BuddyCopies.exchange``), so each element of the state
travels once. The parameters are replicated: they go, whole, only to the
ranks whose own are not of the step recovered (a replacement; a rank whose
update was in flight, or that goes back a step). Hyper-parameters travel with
every piece (a few numbers), as a checkpoint's shards hold them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any

from tandem.zero.optimizer import ZeroOptimizer
from tandem.zero.state_dict import cut_entries

__all__ = ["load_zero_shards", "zero_shard"]


def zero_shard(optimizer: ZeroOptimizer) -> dict[str, Any]:
    """This rank's shard of ``optimizer``'s state and its rows of the parameters,
    copied (Note [elastic ZeRO])."""
    return {**optimizer.sharded_state_dict(), "param_rows": optimizer.param_rows()}


def load_zero_shards(optimizer: ZeroOptimizer,
                     exchange: Callable[[Callable[[int, dict[str, Any]], list[Any]]], dict[int, Any]],
                     rows_to: Collection[int], rank: int) -> None:
    """Load every old rank's shard into ``optimizer`` (laid out for the new world
    already: ``reset_process_group``), each rank its own rows of the state, and
    the parameters on the ranks ``rows_to`` (Note [elastic ZeRO]).
    ``exchange(parts)`` returns, for every old rank, ``parts(old, shard)[r]`` of
    its shard, r being this rank (a collective)."""
    received = exchange(functools.partial(_parts_for_each_rank, rows=optimizer.rows_of_ranks(), rows_to=rows_to))
    parts = [received[old] for old in sorted(received)]
    if rank in rows_to:
        optimizer.load_param_rows([part["rows"] for part in parts])
    optimizer.load_rank_state([e for part in parts for e in part["entries"]], parts[0]["param_groups"],
                              parts[0]["shapes"], "the old world's shards")


def _parts_for_each_rank(old: int, shard: dict[str, Any], *, rows: list[list[tuple[int, int, int]]],
                         rows_to: Collection[int]) -> list[dict[str, Any]]:
    """What of old rank ``old``'s shard each new rank takes: its entries cut to
    that rank's ``rows``, the parameter rows where it sets its parameters, and
    the hyper-parameters and shapes the entries were taken with."""
    return [{"entries": cut_entries(shard["entries"], mine),
             "rows": shard["param_rows"] if r in rows_to else None,
             "param_groups": shard["param_groups"], "shapes": shard["shapes"]}
            for r, mine in enumerate(rows)]
