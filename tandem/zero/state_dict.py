"""State-dict conversion for ZeRO: between a rank's flat shard runs (Note [shard
runs] in optimizer.py) and torch's per-parameter optimizer format.

Pure functions of runs, state dicts and shapes: no process group. A rank's state
travels as *entries*, one per piece of a run: ``(state index, param_start,
length, {key: value})``, where a value is the piece's slice of an element-wise
state tensor (Adam's moments) or, for per-parameter scalars (Adam's ``step``),
the scalar itself. Entries of all ranks, whatever the world size, assemble into
torch's format, which is what makes checkpoints reshardable.

Shards read from files are checked before they are assembled
(:func:`check_shards`): a shard from another save, model or optimizer would
otherwise be cut into the wrong elements without an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from tandem.zero.layout import ShardRun

__all__ = ["SHARD_FORMAT", "Entry", "assemble_state", "check_shards", "cut_entries", "entries_of_run",
           "run_state_from"]

SHARD_FORMAT = "tandem.zero.sharded/1"

Entry = tuple[int, int, int, dict[str, Any]]


def entries_of_run(run: ShardRun, run_state: dict[str, Any], index: dict[int, int]) -> list[Entry]:
    """Split one run's optimizer state into per-piece entries (tensors on the CPU).

    Args:
        run: the run.
        run_state: the wrapped optimizer's state for the run's flat tensor.
        index: parameter index (the reducer's) -> torch state-dict index.
    """
    entries = []
    for piece in run.pieces:
        offset = piece.shard_offset - run.start
        values = {}
        for key, value in run_state.items():
            if _is_elementwise(value, run.length):
                values[key] = value.narrow(0, offset, piece.length).detach().cpu().clone()
            else:
                values[key] = value.detach().cpu().clone() if torch.is_tensor(value) else value
        entries.append((index[piece.param], piece.param_start, piece.length, values))
    return entries


def cut_entries(entries: Sequence[Entry], rows: Sequence[tuple[int, int, int]]) -> list[Entry]:
    """What of ``entries`` falls in ``rows`` (``(state index, start, length)``:
    a rank's pieces at another world size): each entry cut to its overlap with
    each row of its parameter, element-wise values as views, per-parameter
    scalars as they are. Entries that cover a parameter's elements once, cut to
    rows that do, cover each element of the rows once."""
    by_param: dict[int, list[tuple[int, int]]] = {}
    for idx, start, length in rows:
        by_param.setdefault(idx, []).append((start, start + length))
    out: list[Entry] = []
    for idx, start, length, values in entries:
        for lo, hi in by_param.get(idx, ()):
            first, end = max(start, lo), min(start + length, hi)
            if first < end:
                out.append((idx, first, end - first,
                            {k: v.narrow(0, first - start, end - first) if _is_elementwise(v, length) else v
                             for k, v in values.items()}))
    return out


def assemble_state(per_rank: list[list[Entry]], param_groups: list[dict[str, Any]],
                   shapes: dict[int, tuple[int, ...]]) -> dict[str, Any]:
    """torch's optimizer state dict (per-parameter full state) from every rank's entries."""
    state: dict[int, dict[str, Any]] = {}
    for entries in per_rank:
        for idx, start, length, values in entries:
            slot = state.setdefault(idx, {})
            for key, value in values.items():
                if _is_elementwise(value, length):
                    if key not in slot:
                        slot[key] = torch.zeros(_numel(shapes[idx]), dtype=value.dtype)
                    slot[key].narrow(0, start, length).copy_(value)
                else:
                    slot.setdefault(key, value)
    for idx, slot in state.items():
        for key, value in slot.items():
            if _is_elementwise(value, _numel(shapes[idx])) and value.dim() == 1:
                slot[key] = value.view(shapes[idx])
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}


def check_shards(shards: Sequence[dict[str, Any]], sources: Sequence[str],
                 shapes: dict[int, tuple[int, ...]], names: dict[int, str],
                 group_sizes: Sequence[int]) -> None:
    """Check that ``shards`` (one per saving rank, in any order) form one complete
    save that fits an optimizer with these parameters.

    Args:
        shards: sharded state dicts (``ZeroOptimizer.sharded_state_dict``).
        sources: where each came from (a file name), for the errors.
        shapes: the optimizer's parameter shapes, by torch state-dict index.
        names: the parameters' names, by the same index.
        group_sizes: the number of parameters in each of its param groups.

    Raises:
        ValueError: naming the source, and the parameter and state key where there
            is one: not a shard, shards of different saves or missing ranks, other
            param groups, another shape, state keys that differ between shards,
            or state that does not cover a parameter.
    """
    def name(idx: int) -> str:
        return f"parameter '{names[idx]}' (index {idx})" if idx in names else f"parameter index {idx}"

    for shard, src in zip(shards, sources):
        if not isinstance(shard, dict) or shard.get("format") != SHARD_FORMAT:
            found = shard.get("format") if isinstance(shard, dict) else type(shard).__name__
            raise ValueError(f"{src}: not a {SHARD_FORMAT} shard (format {found!r})")
    if not shards:
        raise ValueError(f"expected a non-empty list of {SHARD_FORMAT} shards")
    world = shards[0]["world_size"]
    by_rank: dict[int, str] = {}
    for shard, src in zip(shards, sources):
        if shard["world_size"] != world:
            raise ValueError(f"{src} was saved by a world of {shard['world_size']} ranks, {sources[0]} "
                             f"by {world}: they are not from the same save")
        if shard["rank"] in by_rank:
            raise ValueError(f"{by_rank[shard['rank']]} and {src} both hold rank {shard['rank']}'s shard")
        by_rank[shard["rank"]] = src
    if sorted(by_rank) != list(range(world)):
        missing = sorted(set(range(world)) - set(by_rank))
        raise ValueError(f"need the shards of all {world} ranks of the save, ranks {missing} are missing "
                         f"(got {', '.join(sources)})")
    for shard, src in zip(shards, sources):
        saved_sizes = [len(g["params"]) for g in shard["param_groups"]]
        if saved_sizes != list(group_sizes):
            raise ValueError(f"{src}: the param groups hold {saved_sizes} parameters, this optimizer's "
                             f"hold {list(group_sizes)}")
        saved = {int(k): tuple(v) for k, v in shard["shapes"].items()}
        for idx in sorted(set(saved) | set(shapes)):
            if saved.get(idx) != shapes.get(idx):
                raise ValueError(f"{src}: {name(idx)} has shape {saved.get(idx)} in the checkpoint, "
                                 f"{shapes.get(idx)} in the model")
    keys: dict[int, tuple[frozenset[str], str]] = {}
    covered: dict[int, int] = {}
    for shard, src in zip(shards, sources):
        for idx, start, length, values in shard["entries"]:
            numel = _numel(shapes[idx]) if idx in shapes else None
            if numel is None or start < 0 or length < 0 or start + length > numel:
                raise ValueError(f"{src}: state for elements [{start}, {start + length}) of {name(idx)}, "
                                 f"which has {numel} elements")
            first = keys.setdefault(idx, (frozenset(values), src))
            if first[0] != frozenset(values):
                raise ValueError(f"{name(idx)} has state {sorted(first[0])} in {first[1]} but "
                                 f"{sorted(values)} in {src}")
            covered[idx] = covered.get(idx, 0) + length
    for idx, n in sorted(covered.items()):
        if n != _numel(shapes[idx]):
            raise ValueError(f"{name(idx)}: the shards ({', '.join(sources)}) hold its state "
                             f"{sorted(keys[idx][0])} for {n} of its {_numel(shapes[idx])} elements")


def run_state_from(run: ShardRun, state: dict[int, dict[str, Any]], index: dict[int, int],
                   param_numels: list[int], device: torch.device) -> dict[str, Any] | None:
    """One run's flat optimizer state, cut from torch's per-parameter ``state``
    (None when its parameters have no state yet).

    Args:
        param_numels: element count of each parameter, by the reducer's index.
    """
    entries = [state.get(index[piece.param]) for piece in run.pieces]
    if not entries or entries[0] is None:
        return None
    # A run's parameters are stepped together: all have state once the first has.
    states = cast("list[dict[str, Any]]", entries)
    first = run.pieces[0].param
    run_state = {}
    for key, value in states[0].items():
        if _is_elementwise(value, param_numels[first]):
            parts = [s[key].reshape(-1).narrow(0, piece.param_start, piece.length)
                     for s, piece in zip(states, run.pieces)]
            run_state[key] = torch.cat(parts).to(device)
        else:
            run_state[key] = value.clone() if torch.is_tensor(value) else value
    return run_state


def _is_elementwise(value: Any, numel: int) -> bool:
    """A state tensor with one value per element (not a 0-dim scalar like ``step``)."""
    return torch.is_tensor(value) and value.dim() >= 1 and value.numel() == numel


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
