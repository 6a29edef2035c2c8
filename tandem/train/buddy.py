"""A second copy of each rank's shard, held by the next rank: :class:`BuddyCopies`.

# Note [buddy copies]
Under ZeRO a rank is the only one that holds its shard of the optimizer state,
so when it dies in an elastic job (Note [elastic trainer] in elastic.py) the
survivors could not go on without reading a checkpoint. So each rank also keeps
a copy of the shard of the rank before it (rank r holds rank r-1's, modulo the
world size), refreshed after every committed step: one more shard of memory per
rank, one shard sent and one received per step. A lost rank's shard is then
read from its buddy; any set of losses that does not take a rank and the next
one together is recovered from memory. When both are gone, or a copy is older
than the survivors' own shards (the rank died while the copies were being sent),
the survivors say so and fall back to the last checkpoint.

Each copy is stamped with the step it holds, and the recovery checks that every
shard it assembles has the same stamp.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tandem.comm.p2p import isend, recv

__all__ = ["BuddyCopies", "ShardsLost"]

logger = logging.getLogger(__name__)


class ShardsLost(RuntimeError):
    """Some old rank's shard is on no survivor (it and its buddy are both gone,
    or the buddy's copy is older than the others' shards)."""


@dataclass
class _Held:
    member: str
    step: int
    shard: dict[str, Any]


class BuddyCopies:
    """The copy of the previous rank's shard that this rank holds (Note [buddy copies])."""

    def __init__(self) -> None:
        self.held: _Held | None = None
        # Every old rank's shard, from the last recovery, until the next refresh: a
        # loss during the change itself (a replacement dying as it joins) is then
        # recovered from these rather than from shards laid out for a world that
        # never trained.
        self._complete: list[tuple[int, dict[str, Any]]] | None = None
        # This rank's own shard as the change began: a failed attempt may have
        # dropped the optimizer's state before the shards were recovered.
        self._own: dict[str, Any] | None = None

    def own_shard(self, take: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """This rank's shard as the current change of world began (``take()`` the
        first time in a change)."""
        if self._own is None:
            self._own = take()
        return self._own

    def refresh(self, shard: dict[str, Any], step: int, members: tuple[str, ...], rank: int) -> None:
        """Send ``shard`` (this rank's, after ``step``) to the next rank and keep
        the previous rank's. A collective of the current group."""
        world = len(members)
        if world == 1:  # nobody to hold a copy; the change that led here is complete
            self.held, self._complete, self._own = None, None, None
            return
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        sending = isend({"step": step, "shard": shard}, nxt)  # a dead peer raises PeerLostError
        received = recv(prev)
        sending.wait()
        # The copies are current: a later loss starts a new change from these.
        self._complete = None
        self._own = None
        self.held = _Held(members[prev], received["step"], received["shard"])

    @property
    def nbytes(self) -> int:
        """Memory the held copy's per-element state takes (per-tensor scalars, such
        as Adam's step, are left out, as ``tandem plan`` leaves them out)."""
        if self.held is None:
            return 0
        return sum(v.numel() * v.element_size() for e in self.held.shard["entries"]
                   for v in e[3].values() if torch.is_tensor(v) and v.dim() > 0)

    def recover(self, own: dict[str, Any] | None, step: int, survivors: tuple[str, ...]) -> list[dict[str, Any]]:
        """Every shard of the old world, in old rank order, from the survivors'
        own shards (``own``, after ``step``; None on a replacement, which has
        none) and their copies of the lost ones. A collective of the new group,
        whose old members are ``survivors``.

        Raises:
            ShardsLost: on every rank, naming the old ranks whose shard is gone.
        """
        mine: list[tuple[int, dict[str, Any]]] = [] if own is None else [(step, own)]
        if own is not None and self._complete is not None:
            mine = self._complete
        elif own is not None and self.held is not None and self.held.member not in survivors:
            mine.append((self.held.step, self.held.shard))
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        self.held = None
        contributions = [c for c in gathered if c]
        current = contributions[0][0][0]  # a survivor's own shard: the step every shard must hold
        old_world = contributions[0][0][1]["world_size"]
        shards: dict[int, dict[str, Any]] = {}
        stale: set[int] = set()
        for entries in contributions:
            for stamp, shard in entries:
                if stamp == current:
                    shards[shard["rank"]] = shard
                else:
                    stale.add(shard["rank"])
        missing = [r for r in range(old_world) if r not in shards]
        if missing:
            why = (f"the copies of old ranks {sorted(stale & set(missing))} are older than step {current}"
                   if stale & set(missing) else "each was lost together with the rank that held its copy")
            raise ShardsLost(f"the optimizer-state shards of old ranks {missing} are on no survivor: {why}")
        result = [shards[r] for r in range(old_world)]
        self._complete = [(current, shard) for shard in result]
        return result
