"""A second copy of each rank's shard, held by the next rank: :class:`BuddyCopies`.

# Note [buddy copies]
Under ZeRO a rank is the only one that holds its shard of the optimizer state,
and under fully_shard its shard of the parameters too, so when it dies in an
elastic job (Note [elastic trainer] in run.py) the survivors could not go
on without reading a checkpoint. So each rank also keeps a copy of the shard of
the rank before it (rank r holds rank r-1's, modulo the world size), refreshed
after every committed step: one more shard of memory per rank, one shard sent
and one received per step. ZeRO's shard is its optimizer's
``sharded_state_dict()``, and every rank receives every old shard at once
(:meth:`BuddyCopies.recover`); fully_shard's is the parameters' and their
state's rows (Note [elastic fully_shard] in fsdp_shards.py), which travel one
unit at a time (:meth:`BuddyCopies.locate`, :meth:`BuddyCopies.gather_part`).
A lost rank's shard is then read from its buddy; any set of losses that does
not take a rank and the next one together is recovered from memory. When both
are gone, or a copy is older than the survivors' own shards (the rank died
while the copies were being sent), the survivors say so and fall back to the
last checkpoint.

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
from tandem.comm.watched_call import watched

__all__ = ["BuddyCopies", "Located", "ShardsLost"]

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
        """Memory the held copy's per-element tensors take (per-tensor scalars, such
        as Adam's step, are left out, as ``tandem plan`` leaves them out)."""
        return 0 if self.held is None else _tensor_bytes(self.held.shard)

    def recover(self, own: dict[str, Any] | None, step: int, survivors: tuple[str, ...]) -> list[dict[str, Any]]:
        """Every shard of the old world, in old rank order, from the survivors'
        own shards (``own``, after ``step``; None on a replacement, which has
        none) and their copies of the lost ones. A collective of the new group,
        whose old members are ``survivors``. Every rank receives every shard
        (ZeRO's optimizer state; fully_shard's goes by :meth:`locate`).

        Raises:
            ShardsLost: on every rank, naming the old ranks whose shard is gone.
        """
        mine: list[tuple[int, dict[str, Any]]] = [] if own is None else [(step, own)]
        if own is not None and self._complete is not None:
            mine = self._complete
        elif own is not None and self.held is not None and self.held.member not in survivors:
            mine.append((self.held.step, self.held.shard))
        gathered: list[Any] = [None] * dist.get_world_size()
        watched("all_gather_object of buddy copies", dist.all_gather_object, gathered, mine)
        self.held = None
        chosen = _choose([[(stamp, shard["rank"], shard["world_size"]) for stamp, shard in c] for c in gathered])
        shards = {old: gathered[new][k][1] for old, (new, k) in chosen.items()}
        result = [shards[r] for r in range(len(shards))]
        current = next(c for c in gathered if c)[0][0]
        self._complete = [(current, shard) for shard in result]
        return result

    def locate(self, own: dict[str, Any] | None, step: int, survivors: tuple[str, ...]) -> Located:
        """Which rank of the new group provides each old rank's shard: its own
        (``own``, after ``step``; None on a replacement) or its copy of a lost
        rank's. A collective of the new group (small: stamps and ranks only);
        the shards then travel part by part (:meth:`gather_part`), so that no
        rank holds every shard at once. The held copy is kept until the next
        :meth:`refresh`: a loss during the change is recovered from the same
        copies.

        Raises:
            ShardsLost: on every rank, naming the old ranks whose shard is gone.
        """
        mine: list[tuple[int, dict[str, Any]]] = [] if own is None else [(step, own)]
        if own is not None and self.held is not None and self.held.member not in survivors:
            mine.append((self.held.step, self.held.shard))
        headers: list[Any] = [None] * dist.get_world_size()
        watched("all_gather_object of shard headers", dist.all_gather_object, headers,
                [(stamp, shard["rank"], shard["world_size"]) for stamp, shard in mine])
        chosen = _choose(headers)
        here = dist.get_rank()
        return Located(len(chosen), {old: mine[k][1] for old, (new, k) in chosen.items() if new == here})

    def gather_part(self, located: Located, part: Callable[[dict[str, Any]], Any]) -> list[Any]:
        """``part(shard)`` of every old rank's shard, in old rank order, on every
        rank. A collective of the new group."""
        gathered: list[Any] = [None] * dist.get_world_size()
        watched("all_gather_object of lost shards", dist.all_gather_object, gathered,
                [(old, part(shard)) for old, shard in located.provided.items()])
        parts = dict(p for c in gathered for p in c)
        return [parts[r] for r in range(located.old_world)]


@dataclass(frozen=True)
class Located:
    """Where the old world's shards are (:meth:`BuddyCopies.locate`)."""

    old_world: int
    """The world size the shards were laid out for."""
    provided: dict[int, dict[str, Any]]
    """The shards this rank provides, by old rank."""


def _choose(headers: list[list[tuple[int, int, int]]]) -> dict[int, tuple[int, int]]:
    """For each old rank, ``(new rank, index)`` of the contribution that provides
    its shard: the first whose step is the survivors' own. ``headers[n]`` lists
    new rank n's contributions as ``(step, old rank, old world size)``, its own
    shard first.

    Raises:
        ShardsLost: naming the old ranks whose shard is on no survivor.
    """
    first = next(c for c in headers if c)  # a survivor's own shard: the step every shard must hold
    current, old_world = first[0][0], first[0][2]
    chosen: dict[int, tuple[int, int]] = {}
    stale: set[int] = set()
    for new, contributions in enumerate(headers):
        for k, (stamp, old, _) in enumerate(contributions):
            if stamp != current:
                stale.add(old)
            elif old not in chosen:
                chosen[old] = (new, k)
    missing = [r for r in range(old_world) if r not in chosen]
    if missing:
        why = (f"the copies of old ranks {sorted(stale & set(missing))} are older than step {current}"
               if stale & set(missing) else "each was lost together with the rank that held its copy")
        raise ShardsLost(f"the shards of old ranks {missing} are on no survivor: {why}")
    return chosen


def _tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors of more than zero dimensions in ``obj`` (nested
    dicts, lists and tuples)."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size() if obj.dim() > 0 else 0
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0
