"""A second copy of each rank's shard, held by the next rank: :class:`BuddyCopies`.

# Note [buddy copies]
Under ZeRO a rank is the only one that holds its shard of the optimizer state,
and under fully_shard its shard of the parameters too, so when it dies in an
elastic job (Note [elastic trainer] in run.py) the survivors could not go
on without reading a checkpoint. So each rank also keeps a copy of the shard of
the rank before it (rank r holds rank r-1's, modulo the world size), refreshed
after every committed step: one more shard of memory per rank, one shard sent
and one received per step. ZeRO's shard is its rows of the optimizer state and
of the parameters (Note [elastic ZeRO] in zero_shards.py), fully_shard's its
rows of the parameters and their state (Note [elastic fully_shard] in
fsdp_shards.py). In a world change the ranks agree who provides each old
shard (:meth:`BuddyCopies.locate`), and each row of state then travels once,
to the rank that holds it next (:meth:`BuddyCopies.exchange`).
A lost rank's shard is then read from its buddy; any set of losses that does
not take a rank and the next one together is recovered from memory (one step
back when the rank died before its copy of the last step arrived: Note [one
step back]). When both are gone, the survivors say so and fall back to the
last checkpoint.

Each copy is stamped with the step it holds, and the recovery checks that every
shard it assembles has the same stamp and was laid out for the same world size.

# Note [a change cut short after its shards moved]
A change takes each rank's own shards as it begins (:meth:`BuddyCopies.own_shard`),
so that an attempt cut short by another loss before the shards were loaded
(the optimizer's state dropped by the new layout) starts the next one from
them. Once a rank has loaded the new world's shards, an attempt cut short after
that (a peer lost as the new world's copies are sent) finds some ranks whose
copies are the new world's (their sends completed) and others whose copies
are still the old world's: so a rank then offers both its own shards, the old
world's it took and the new world's it loaded (:meth:`BuddyCopies.laid_out`),
and each layout is assembled apart (a shard is fixed by its step, world size
and rank), the newest complete one taken, else the last checkpoint.

# Note [a grow's copies ride on its first step]
A world change ends with the new world's copies (:meth:`BuddyCopies.refresh`),
a round every member waits on before the first step of the new world; its
first step sends them again, one step on. Where the world only grew (Note [a
grow located without a gather] in world.py) the round is not needed: every old
rank's shard is held by its owner and, as copied at the step the grow was
admitted at, by the next old rank, so the old world's layout covers the new
world until its own copies are on every rank. So a grow sends none
(:meth:`BuddyCopies.cover`): each member keeps offering its own shard of the
old world (``_cover_own``) and its copy of the old world's (``held``, then
``_older`` once the first copies replace it), through the new world's first
step and its first copies, and drops them once its second copies arrived (the
first ones are then on every rank: a later change takes the new world's, one
step back where needed). A loss in the first step, or as its copies are sent,
assembles the old world's layout at the grow's step when the new world's is not
complete, and the job goes back to that step. A grow from a world of one (whose
shard has no copy) sends its copies as any other change does. Through those two
steps a member holds the old world's shard and copy beside the new world's, as
it does during the change itself. A change after a loss sends its copies as
before: the lost rank's shard is then held once, by its buddy, and the loss of
that buddy in the first step would leave it on no survivor.

# Note [one step back]
A rank can die while the copies are being sent (after step k was committed:
some ranks hold their neighbour's shard of step k, others still that of step
k-1), or, under ZeRO, inside the step's parameter all-gather (after every
rank agreed to step and updated its shard, before the step was committed). In
the first case the lost rank's shard of step k may be on no survivor; in the
second the survivors' own shards are of step k while the lost one's copy and
the loop state are of step k-1. Assembling step k from the first, or a mix of
k and k-1 from the second, would part the run from training on one process
(the soak found the second: a step's update applied twice on three quarters of
the optimizer state). So every rank also keeps its own shard as it was before
the latest update (:meth:`BuddyCopies.keep_own`, taken when the ranks have
agreed to step, before the optimizer changes anything), and the recovery
assembles the newest step that every old rank's shard is available at: step
k when every copy of step k arrived, else step k-1, from the survivors' kept
shards and the copies of step k-1 that the rank after the lost one still
holds (it replaces a copy only when the new one has arrived). The trainer then
goes back one step: the loop state of step k-1 (kept at each commit), and
under ZeRO the parameters, whose rows of step k-1 travel with each shard to
the ranks whose parameters are not of the step recovered.
That costs a second shard of memory per rank: the kept one, which replaces
the last at each step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tandem.comm.p2p import isend, recv
from tandem.comm.watched_call import watched
from tandem.comm.plain_data import all_gather_ints, all_to_all_with_tensors

__all__ = ["BuddyCopies", "Located", "ShardsLost"]

logger = logging.getLogger(__name__)


# What a rank can offer in a world change: its own shard, live and as kept before
# the last update (Note [one step back]), then, after an attempt cut short once its
# shards moved, the new world's too (Note [a change cut short after its shards
# moved]), its copy of the previous rank's, and after a grow the old world's own
# shard and copy (Note [a grow's copies ride on its first step]).
_MOST_OFFERS = 6
# What leads every message of an exchange: the sender's rider (no old rank is negative).
_RIDER = -1


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
        # Note [one step back]: this rank's shard before the latest update, and its step.
        self.kept: tuple[int, dict[str, Any]] | None = None
        # This rank's own shards as the change began: a failed attempt may have
        # dropped the optimizer's state before the shards were recovered.
        self._own: list[tuple[int, dict[str, Any]]] | None = None
        # Loaded, laid out for a new world, since _own was taken (Note [a change cut short after its shards moved]).
        self._laid_out = False
        # Note [a grow's copies ride on its first step]: the old world's own shard and the old
        # world's copy replaced by the new world's first, and how many refreshes they outlive.
        self._cover_own: list[tuple[int, dict[str, Any]]] = []
        self._older: _Held | None = None
        self._covering = 0

    def own_shard(self, take: Callable[[], list[tuple[int, dict[str, Any]]]]) -> list[tuple[int, dict[str, Any]]]:
        """This rank's shards as the current change of world began, each with its
        step (``take()`` the first time in a change): Note [one step back]; and,
        once the new world's are loaded, those too (``take()`` again: Note [a
        change cut short after its shards moved])."""
        if self._own is None:
            self._own = take()
        return self._own + take() if self._laid_out else self._own

    def laid_out(self) -> None:
        """This rank's shards are laid out for the new world now (loaded, from the
        old world's or a checkpoint): the one kept, of the old world, is of no
        use; a later attempt offers the live ones beside those taken as the
        change began (Note [a change cut short after its shards moved]); a
        replacement, which took none, offers the live ones only."""
        self.kept, self._laid_out = None, self._own is not None

    def cover(self, step: int) -> None:
        """A grow, laid out, sends no copies: the old world's own shard of
        ``step`` and its copy cover the new world until the new world's copies
        are on every rank (Note [a grow's copies ride on its first step])."""
        self._cover_own = [(at, shard) for at, shard in self._own or [] if at == step]
        self._own, self._laid_out, self._covering = None, False, 2

    def keep_own(self, step: int, shard: dict[str, Any], *, live: bool) -> None:
        """Keep ``shard``, this rank's of ``step``, before the optimizer updates it
        (Note [one step back]); ``live``: it holds the live tensors (views), which
        are copied, as the update will change them."""
        self.kept = (step, _copied(shard) if live else shard)

    def refresh(self, shard: dict[str, Any], step: int, members: tuple[str, ...], rank: int) -> None:
        """Send ``shard`` (this rank's, after ``step``) to the next rank and keep
        the previous rank's. A collective of the current group."""
        world = len(members)
        if world == 1:  # nobody to hold a copy; the change that led here is complete
            self.held, self._own, self._laid_out = None, None, False
            self._cover_own, self._older, self._covering = [], None, 0
            return
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        sending = isend({"step": step, "shard": shard}, nxt)  # a dead peer raises PeerLostError
        received = recv(prev)
        sending.wait()
        # The copies are current: a later loss starts a new change from these.
        self._own, self._laid_out = None, False
        if self._covering:  # Note [a grow's copies ride on its first step]
            self._covering -= 1
            self._older = self._older or self.held
        if not self._covering:
            self._cover_own, self._older = [], None
        self.held = _Held(members[prev], received["step"], received["shard"])

    @property
    def nbytes(self) -> int:
        """Memory the held copy's per-element tensors take (per-tensor scalars, such
        as Adam's step, are left out, as ``tandem plan`` leaves them out)."""
        return 0 if self.held is None else _tensor_bytes(self.held.shard)

    @property
    def kept_nbytes(self) -> int:
        """Memory the kept shard's per-element tensors take (Note [one step back])."""
        return 0 if self.kept is None else _tensor_bytes(self.kept[1])

    def locate(self, own: list[tuple[int, dict[str, Any]]] | None, survivors: tuple[str, ...],
               current: int | None = None, *, rider: Sequence[int] = (),
               check_riders: Callable[[list[list[int]]], None] | None = None) -> Located:
        """Which rank of the new group provides each old rank's shard, and at
        which step: its own (``own``, each with its step, Note [one step back];
        None on a replacement) or its copy of a lost rank's; and the step each
        rank's own replicated state is of (``current``: None where it has none,
        or where an update may have changed it). A collective of the new group
        (small: stamps and ranks only); the shards then travel part by part
        (:meth:`exchange`), so that no rank holds every shard at once. The held
        copy is kept until the next :meth:`refresh`: a loss during the change
        is recovered from the same copies. ``rider``: numbers of the caller's
        that go in the same gather (as many on every rank), every rank's of which
        ``check_riders`` is given, in rank order, before the shards are chosen
        (DDP's model check under ZeRO: Note [one gather for a world change's
        numbers] in tandem/train/trainer.py).

        Raises:
            ShardsLost: on every rank, naming the old ranks whose shard is gone.
        """
        mine = self._offered(own, survivors)
        offers = [(stamp, shard["rank"], shard["world_size"]) for stamp, shard in mine]
        # One round of numbers: whether ``current`` is set and it, then up to _MOST_OFFERS offers.
        assert len(offers) <= _MOST_OFFERS, f"a rank offers at most {_MOST_OFFERS} shards, got {offers}"
        header = [int(current is not None), current or 0, len(offers)]
        header += [n for offer in offers for n in offer] + [0] * 3 * (_MOST_OFFERS - len(offers))
        gathered = watched("all_gather of shard headers", all_gather_ints, header + list(rider))
        if check_riders is not None:
            check_riders([h[len(header):] for h in gathered])
        step, chosen = _choose([[(h[3 + 3 * k], h[4 + 3 * k], h[5 + 3 * k]) for k in range(h[2])] for h in gathered])
        here = dist.get_rank()
        return Located(len(chosen), {old: mine[k][1] for old, (new, k) in chosen.items() if new == here}, step,
                       [h[1] if h[0] else None for h in gathered])

    def _offered(self, own: list[tuple[int, dict[str, Any]]] | None,
                 survivors: tuple[str, ...]) -> list[tuple[int, dict[str, Any]]]:
        """What this rank can provide: its own shards and its copy of a lost rank's
        (after a grow, the old world's too: Note [a grow's copies ride on its first step])."""
        if own is None:
            return []
        mine = list(own) + self._cover_own
        for copy in (self.held, self._older):
            if copy is not None and copy.member not in survivors:
                mine.append((copy.step, copy.shard))
        return mine

    def exchange(self, located: Located, parts: Callable[[int, dict[str, Any]], list[Any]], *,
                 rider: Sequence[int] = (),
                 check_riders: Callable[[list[list[int]]], None] | None = None) -> dict[int, Any]:
        """What of every old rank's shard goes to this rank: ``parts(old, shard)[j]``
        is what of old rank ``old``'s shard new rank j takes, cut by the rank that
        provides the shard. Returns ``{old rank: part}`` for every old rank. A
        collective of the new group, in which each part travels once.
        ``rider`` and ``check_riders``: as :meth:`locate`'s, sent to every rank
        with its parts and checked before any part is returned (where the shards
        were located without a gather: Note [a grow located without a gather]
        in world.py)."""
        outgoing: list[list[tuple[int, Any]]] = [[(_RIDER, list(rider))] for _ in range(dist.get_world_size())]
        for old, shard in located.provided.items():
            for j, part in enumerate(parts(old, shard)):
                outgoing[j].append((old, part))
        received = watched("all_to_all of the old world's shards", all_to_all_with_tensors, outgoing)
        if check_riders is not None:
            check_riders([[int(n) for n in c[0][1]] for c in received])
        parts_here = dict(p for c in received for p in c[1:])
        return {r: parts_here[r] for r in range(located.old_world)}


@dataclass(frozen=True)
class Located:
    """Where the old world's shards are (:meth:`BuddyCopies.locate`)."""

    old_world: int
    """The world size the shards were laid out for."""
    provided: dict[int, dict[str, Any]]
    """The shards this rank provides, by old rank."""
    step: int
    """The step every provided shard is of (Note [one step back])."""
    current: list[int | None]
    """Per rank of the new group, the step its own replicated state (ZeRO's
    parameters) is of; None where it has none."""

    def behind(self) -> list[int]:
        """The ranks of the new group whose replicated state is not of :attr:`step`."""
        return [r for r, c in enumerate(self.current) if c != self.step]


def _choose(headers: list[list[tuple[int, int, int]]]) -> tuple[int, dict[int, tuple[int, int]]]:
    """The newest step at which every old rank's shard of one layout is provided
    (Note [one step back]), and for each old rank ``(new rank, index)`` of the
    first contribution of it. ``headers[n]`` lists new rank n's contributions as
    ``(step, old rank, old world size)``. A shard is fixed by its step, world
    size and rank, so shards of two world sizes are never assembled together (a
    change cut short after its shards moved leaves some ranks offering the old
    world's and others the new world's: Note [a change cut short after its
    shards moved]); where two layouts are complete at one step, the larger
    world's is taken (either holds the same state: the choice is only the same
    on every rank).

    Raises:
        ShardsLost: naming the old ranks whose shard is on no survivor in the
            layout of the survivors' newest step.
    """
    by_layout: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
    for new, contributions in enumerate(headers):
        for k, (stamp, old, world) in enumerate(contributions):
            by_layout.setdefault((stamp, world), {}).setdefault(old, (new, k))
    for layout in sorted(by_layout, reverse=True):
        if len(by_layout[layout]) == layout[1]:
            return layout[0], by_layout[layout]
    newest, world = max(by_layout)
    missing = [r for r in range(world) if r not in by_layout[(newest, world)]]
    stale = [r for r in missing if any(r in found for (_, w), found in by_layout.items() if w == world)]
    why = (f"the copies of old ranks {stale} are older than step {newest}, and no step is complete"
           if stale else "each was lost together with the rank that held its copy")
    raise ShardsLost(f"the shards of old ranks {missing} of world {world} are on no survivor: {why}")


def _copied(obj: Any) -> Any:
    """``obj`` (nested dicts, lists and tuples) with every tensor copied."""
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copied(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copied(v) for v in obj)
    return obj


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
