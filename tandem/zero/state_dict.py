"""State-dict conversion for ZeRO: between a rank's flat shard runs (Note [shard
runs] in optimizer.py) and torch's per-parameter optimizer format.

Pure functions of runs, state dicts and shapes: no process group. A rank's state
travels as *entries*, one per piece of a run: ``(state index, param_start,
length, {key: value})``, where a value is the piece's slice of an element-wise
state tensor (Adam's moments) or, for per-parameter scalars (Adam's ``step``),
the scalar itself. Entries of all ranks, whatever the world size, assemble into
torch's format, which is what makes checkpoints reshardable.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.zero.layout import ShardRun

__all__ = ["SHARD_FORMAT", "Entry", "assemble_state", "entries_of_run", "run_state_from"]

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
    first = run.pieces[0].param
    run_state = {}
    for key, value in entries[0].items():
        if _is_elementwise(value, param_numels[first]):
            parts = [s[key].reshape(-1).narrow(0, piece.param_start, piece.length)
                     for s, piece in zip(entries, run.pieces)]
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
