"""The world size of each step of an elastic run, from the world changes it
recorded: what one process replays to check the run (:func:`world_sizes`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["world_sizes"]


def world_sizes(changes: Sequence[Mapping[str, Any]], *, start_world: int, samples: int, batch: int) -> list[int]:
    """World size per step of an epoch of ``samples`` at ``batch`` a rank:
    ``start_world`` until each change's ``step``, then its ``world_size`` (the
    changes in the order of their step and ``generation``)."""
    worlds: list[int] = []
    world, consumed = start_world, 0
    pending = sorted(changes, key=lambda c: (c["step"], c["generation"]))
    while consumed < samples:
        while pending and pending[0]["step"] == len(worlds):
            world = pending.pop(0)["world_size"]
        worlds.append(world)
        consumed += world * batch
    return worlds
