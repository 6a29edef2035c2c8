"""The Trainer's side of an elastic job: :class:`ElasticRun` and the
:class:`WorldChange` it reports.

# Note [elastic trainer]
With ``TrainerConfig(elastic=True)`` a dead rank costs at most the step in
flight, and nothing is read from disk:

1. The step decides before the optimizer moves (Note [elastic membership] in
   tandem.control.membership): every member steps, or none does. A collective that
   fails, or a member seen dead, makes it ``abort``.
2. The survivors catch the failure (:func:`is_peer_failure`), agree on the next
   generation, rebuild the default group (tandem.control.elastic_group.enter_generation), and
   the Trainer rebuilds what depends on the world: the DDP reducer
   (``ElasticWorld.reset_model``: ``reset_process_group(broadcast=False)``, which checks that every rank
   holds the same model and keeps each rank's values: the members' are equal,
   and a replacement gets the state next), the sampler and the loaders.
3. The epoch goes on from ``state.consumed``, the positions of the epoch's
   global order that committed steps used: the sampler splits the rest over the
   new world without padding (Note [exact split] in tandem/data/split.py), so no
   sample is lost or seen twice; a rank left with none in the last step trains
   an empty batch, and that step's uneven batches are weighed in the loss so
   that it equals one process on its global batch. The dropped step is redone
   by the new world.
4. A replacement builds its model, optimizer and Trainer in a world of its own,
   then asks to join (Note [a replacement builds first] in
   tandem/control/elastic_group.py); the member that completes a step's count sees
   it and decides ``prepare``: the members build the new group with it while
   they train the next step, whose decision is ``grow`` (Note [a group built
   ahead] there). After that step every member, and the replacement, enter
   the next generation and rebuild for it; rank 0 (a member that trained
   all along) sends the training state (model, optimizer, scheduler, scaler,
   counters; each rank keeps its own RNG stream) to each rank that has none,
   point to point, its tensors as bytes (:func:`share_state`). Under ZeRO and
   fully_shard the shards come from every live rank instead, a fully-sharded
   model's rows each to the rank that holds them next (Note [buddy copies] in
   buddy.py, Note [elastic fully_shard] in fsdp_shards.py), and rank 0 sends
   only what no shard holds (``ElasticWorld.share_state``).

# Note [a join cut short]
A member can die while a replacement is being admitted: the members' rebuild
fails, and so does the replacement's wait for its state (the shards, or rank
0's message). Both are a peer's failure: the replacement takes part in the
next change like a member, with no state of its own to offer, and the rebuild
of that change sends the state to whoever still has none. Which ranks want it
is asked of the group (:meth:`ElasticRun.ranks_wanting_state`), not read from who
joined in this change, as a rank whose rebuild completed just before the loss
was seen would disagree with one whose rebuild did not. A replacement that
dies as it is admitted is the same case seen from the members. A replacement
counts as holding the state only once the whole rebuild has completed: the
state reaches it from rank 0 alone, so a member lost after that (while the
new world's buddy copies are sent, say) leaves it with a state whose shards
no other rank's recovery would match; it then wants the state again.

A loop the user writes gets the same through ``tandem.prepare(elastic=...)``
(Note [elastic prepare] in loop.py), with this module's pieces.

Only failures of peers are caught: an exception of this rank's own (a bug, bad
data) ends this rank as before, and the others go on without it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from tandem.control.elastic_group import GroupAhead, ask_to_join, enter_generation
from tandem.control.generation import Decision, ElasticConfig, Generation, MembershipError
from tandem.control.membership import Membership
from tandem.comm.peers import PeerLostError
from tandem.checkpoint.state import TrainingState
from tandem.comm.watched_call import watched
from tandem.comm.p2p import isend, recv
from tandem.comm.plain_data import all_gather_object

__all__ = ["ElasticRun", "Resumed", "StepAbandoned", "WorldChange", "elastic_config", "first_sentence",
           "is_peer_failure", "share_state"]

logger = logging.getLogger(__name__)


class StepAbandoned(RuntimeError):
    """A member was seen dead before this step's decision: no rank steps."""


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` says a peer is gone (rather than this rank's own fault)."""
    if isinstance(error, MembershipError):
        return False
    if isinstance(error, (PeerLostError, StepAbandoned, dist.DistNetworkError)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "gloo" in text.lower() or "Connection closed by peer" in text or "Connection reset" in text)


def elastic_config(elastic: bool | ElasticConfig | None, where: str) -> ElasticConfig | None:
    """The settings an ``elastic=`` argument asks for, or None for a job that is not
    elastic: None follows ``tandem run --elastic`` (which sets ``TANDEM_ELASTIC=1``),
    True takes :class:`ElasticConfig`'s defaults. ``where`` names the argument's owner."""
    if elastic is None:
        elastic = os.environ.get("TANDEM_ELASTIC") == "1"
    if isinstance(elastic, ElasticConfig):
        return elastic
    if isinstance(elastic, bool):
        return ElasticConfig() if elastic else None
    raise TypeError(f"{where}: elastic must be a bool, an ElasticConfig or None, got {elastic!r}")


def first_sentence(error: BaseException) -> str:
    """What a peer's failure says, for the log: its first sentence (a
    PeerLostError goes on about restarts, which an elastic job does not need)."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text.split(". The collective cannot complete")[0]


def share_state(state: TrainingState, wanting: Sequence[int]) -> None:
    """Rank 0's whole training state, on the ranks ``wanting`` it (replacements
    that joined: Note [elastic trainer], 4), sent to each point to point, its
    tensors as bytes (tandem.send); the other members, which hold it, do
    nothing. Each rank keeps its own RNG stream, so no rank's is sent. Not for a
    sharded state, whose ``state_dict`` is a collective (``ElasticWorld.share_state``)."""
    rank = dist.get_rank()
    if rank == 0:
        sent = state.state_dict(rng=False)
        for pending in [isend(sent, r) for r in wanting]:
            pending.wait()
    elif rank in wanting:
        state.load_state_dict(recv(0))


@dataclass(frozen=True)
class Resumed:
    """Where a world change's rebuild took the training state back to."""

    step: int
    """The steps committed in the state gone back to (Note [step numbers] in tandem/comm/ledger.py)."""
    checkpoint: bool
    """Read from the last checkpoint (a shard and its buddy copy both lost); else
    one step back on the survivors (Note [one step back] in buddy.py)."""


@dataclass(frozen=True)
class WorldChange:
    """One change of an elastic job's world, as the log and the Trainer's history show it."""

    generation: int
    """The new generation's number."""
    step: int
    """The steps committed when the new world goes on: it goes on with step
    ``step + 1`` (Note [step numbers] in tandem/comm/ledger.py)."""
    lost: dict[int, str]
    """The ranks that are gone (their rank in the old world) and their member ids."""
    joined: tuple[str, ...]
    """Member ids of the replacements admitted."""
    world_size: int
    """The new world size."""
    previous_world_size: int
    cause: str
    """What was seen: the failed collective, or "replacement waiting"."""
    detect_s: float
    """From the start of the failed step to the failure being seen."""
    regroup_s: float
    """From then to the new group being ready, the state shared."""
    steps_lost: int
    """Steps whose work was dropped: the one in flight, or every step since the
    checkpoint the state came from."""
    seen_at: float = 0.0
    """When the failure (or the replacement) was seen: wall-clock seconds (``time.time()``)."""
    checkpoint_step: int | None = None
    """Set when the state could not be recovered from live ranks (a shard and its
    buddy copy both lost): the step of the checkpoint it was read from instead."""
    stepped_back: bool = False
    """The survivors went one step back (Note [one step back] in buddy.py)."""
    connect_s: float = 0.0
    """The part of ``regroup_s`` spent agreeing on the new generation and
    building its group; the rest rebuilt what depends on the world and shared the state."""
    built_ahead_from: int | None = None
    """The steps committed when the members began building the new group while
    they trained (Note [a group built ahead] in tandem/control/elastic_group.py);
    None where it was built in the change."""

    def describe(self) -> str:
        what = []
        if self.lost:
            what.append("lost " + ", ".join(f"rank {r} (member {m})" for r, m in sorted(self.lost.items())))
        if self.joined:
            what.append("admitted " + ", ".join(self.joined))
        head = (f"elastic: {'; '.join(what) or 'regrouped'} -> world {self.previous_world_size} -> "
                f"{self.world_size} (generation {self.generation}), going on with step {self.step + 1}; ")
        if not self.lost:  # a replacement admitted: no failure to see, nothing redone
            ahead = (f" (its group built ahead from step {self.built_ahead_from + 1} on)"
                     if self.built_ahead_from is not None else "")
            return f"{head}admitting took {self.regroup_s:.2f} s{ahead}{self._fallback()}"
        return (f"{head}failure seen after {self.detect_s:.2f} s, regroup took {self.regroup_s:.2f} s, "
                f"{self.steps_lost} step(s) redone{self._fallback()}. Cause: {self.cause}")

    def _fallback(self) -> str:
        if self.stepped_back:
            return ", one step back (a copy of the last step's shard had not arrived)"
        if self.checkpoint_step is None:
            return ""
        return (f", the state read from the checkpoint of step {self.checkpoint_step} (a shard and "
                "its buddy copy were both lost)")

    def record(self) -> dict[str, Any]:
        return {"kind": "elastic", "step": self.step, "generation": self.generation,
                "lost_ranks": sorted(self.lost), "joined": list(self.joined),
                "world_size": self.world_size, "previous_world_size": self.previous_world_size,
                "detect_s": self.detect_s, "regroup_s": self.regroup_s, "steps_lost": self.steps_lost,
                "cause": self.cause, "checkpoint_step": self.checkpoint_step, "stepped_back": self.stepped_back,
                "seen_at": self.seen_at, "connect_s": self.connect_s, "built_ahead_from": self.built_ahead_from}


class ElasticRun:
    """Decides each step with the other members and changes the world when
    members die or replacements wait (Note [elastic trainer]).

    Args:
        membership: this process's membership of the job.
    """

    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self.changes: list[WorldChange] = []
        self.grow_pending = False
        # A replacement (ids j1, j2, ...) gets the training state from a live peer.
        self.needs_state = membership.member.startswith("j")
        self._step_started = time.monotonic()
        self._ahead: GroupAhead | None = None  # the next generation's group, built as this trains

    def step_started(self) -> None:
        self._step_started = time.monotonic()

    def grown_from(self, after: Generation) -> Generation | None:
        """The generation before ``after`` when ``after`` only added members to it (a
        replacement admitted, nobody lost: each member keeps its rank), else None.
        Read from the store, so that a replacement, which was in neither, answers
        as the members do."""
        before = self.membership.generation_numbered(after.number - 1)
        grew = after.world_size > before.world_size and after.members[:before.world_size] == before.members
        return before if grew else None

    def ranks_wanting_state(self, wants: list[bool] | None = None) -> list[int]:
        """The ranks of the current group that have no training state yet: a
        replacement admitted in this change, or in an earlier one whose rebuild a
        loss cut short (Note [a join cut short]). A collective of the group,
        unless the caller gathered each rank's ``needs_state`` already (``wants``)."""
        if wants is None:
            gathered: list[Any] = [None] * dist.get_world_size()
            watched("all_gather_object of who wants the state", all_gather_object, gathered, self.needs_state)
            wants = [bool(w) for w in gathered]
        if wants[0]:
            raise MembershipError(
                f"elastic: rank 0 (member {self.membership.generation.members[0]}) of generation "
                f"{self.membership.generation.number} is a replacement whose state never arrived: every member "
                "that held the training state is gone; resume the job from its last checkpoint")
        return [r for r, wanted in enumerate(wants) if wanted]

    def decide(self, step: int) -> None:
        """Wait for the decision of the step after ``step`` committed steps; raises
        :class:`StepAbandoned` on abort."""
        decision = self.membership.decide_step(step)
        if decision is Decision.ABORT:
            raise StepAbandoned(f"member {self.membership.member}: step {step + 1} was abandoned: a member "
                                "of the group is gone")
        if decision is Decision.PREPARE:  # Note [a group built ahead] in tandem/control/elastic_group.py
            self._ahead = GroupAhead(self.membership, step + 1)
        self.grow_pending = decision is Decision.GROW

    def change_world(self, cause: BaseException | None, step: int, *, in_step: bool,
                     rebuild: Callable[[Generation, Generation], Resumed | None]) -> WorldChange:
        """Agree on the next generation, enter it (the default group is rebuilt) and
        call ``rebuild(before, after)`` for what depends on the world; it returns
        where the state went back to (a checkpoint, or one step), else None.
        ``cause`` is the failure (None for a planned grow); ``step`` the steps committed."""
        seen, seen_at = time.monotonic(), time.time()
        before = self.membership.generation
        if cause is not None:
            self.membership.abort_step(step)
        # The heartbeat watch of a failed collective has seen these go stale already.
        known = ({before.members[r]: why for r, why in cause.lost.items() if 0 <= r < before.world_size}
                 if isinstance(cause, PeerLostError) else {})
        generation = self.membership.next_generation(known_dead=known)
        ahead, self._ahead = self._ahead, None
        enter_generation(self.membership, generation, ahead=ahead)
        built_ahead_from = ahead.step if ahead is not None and ahead.generation == generation else None
        connected = time.monotonic()
        text = "replacement waiting" if cause is None else first_sentence(cause)
        change = WorldChange(
            generation=generation.number, step=step,
            lost={before.rank_of(m): m for m in generation.lost_since(before)},
            joined=generation.joined_since(before), world_size=generation.world_size,
            previous_world_size=before.world_size, cause=text,
            detect_s=seen - self._step_started if cause is not None else 0.0,
            regroup_s=time.monotonic() - seen, steps_lost=int(in_step and cause is not None),
            seen_at=seen_at, connect_s=connected - seen, built_ahead_from=built_ahead_from)
        self.changes.append(change)  # recorded even if a peer is lost again while rebuilding
        resumed = rebuild(before, generation)
        self.grow_pending = False
        change = dataclasses.replace(change, regroup_s=time.monotonic() - seen)
        if resumed is not None:
            change = dataclasses.replace(change, step=resumed.step,
                                         checkpoint_step=resumed.step if resumed.checkpoint else None,
                                         stepped_back=not resumed.checkpoint,
                                         steps_lost=change.steps_lost + step - resumed.step)
        self.changes[-1] = change
        return change

    def join(self, rebuild: Callable[[Generation, Generation], Resumed | None],
             report: Callable[[WorldChange], None]) -> None:
        """A replacement, built in its world of one, asks to join, enters the
        generation that admits it, and calls ``rebuild`` as the members do in
        that change (Note [a replacement builds first] in
        tandem/control/elastic_group.py); a member lost meanwhile makes it take part
        in the next change (Note [a join cut short])."""
        before = self.membership.generation
        try:
            ask_to_join(self.membership, lambda generation: rebuild(before, generation))
        except Exception as e:
            if not is_peer_failure(e):
                raise
            self.regroup(e, 0, in_step=False, rebuild=rebuild, report=report)

    def regroup(self, cause: BaseException | None, step: int, *, in_step: bool,
                rebuild: Callable[[Generation, Generation], Resumed | None],
                report: Callable[[WorldChange], None]) -> None:
        """:meth:`change_world` until a change completes, calling ``report`` with each:
        a member lost while the world is rebuilt (a replacement that died as it
        joined, say) starts the next change at once. Any other failure is raised."""
        while True:
            known = len(self.changes)
            try:
                change = self.change_world(cause, step, in_step=in_step, rebuild=rebuild)
            except Exception as e:
                if not is_peer_failure(e):
                    raise
                if len(self.changes) > known:  # the change happened; the next one starts now
                    report(self.changes[-1])
                cause = e
                continue
            report(change)
            return
