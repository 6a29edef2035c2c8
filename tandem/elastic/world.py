"""One rank's part in an elastic job, for the Trainer and for a prepared loop
alike: its membership's decisions and world changes (Note [elastic trainer] in
run.py), the buddy copies of a sharded state (Note [buddy copies] in buddy.py),
the shards restored for a new world, one step back (Note [one step back]) and
the state shared with a replacement.

Its owner says what its loop goes back to (:class:`LoopPoints`: the Trainer's
counters, scheduler and scaler; a prepared loop's loaders and registered
objects) and where a lost shard is read from when its buddy copy is lost too
(:class:`Fallback`: the Trainer's checkpoints; a prepared loop has none)."""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from tandem.control.generation import Generation, MembershipError
from tandem.control.membership import Membership
from tandem.elastic.buddy import BuddyCopies, Located, ShardsLost
from tandem.elastic.run import ElasticRun, Resumed, share_state
from tandem.elastic.fsdp_shards import fsdp_shard, load_fsdp_shards
from tandem.elastic.zero_shards import load_zero_shards, zero_shard
from tandem.checkpoint.full_state import is_fully_sharded
from tandem.checkpoint.rng import capture_rng_state, restore_rng_state
from tandem.checkpoint.state import TrainingState, unwrap_model
from tandem.comm.p2p import isend, recv
from tandem.ddp.module import DistributedDataParallel
from tandem.zero.optimizer import ZeroOptimizer

__all__ = ["ElasticWorld", "Fallback", "LoopPoints", "TrainingStatePoints"]

logger = logging.getLogger(__name__)


class LoopPoints(Protocol):
    """What a loop goes back to when the shards go one step back (Note [one step back] in buddy.py)."""

    def capture(self) -> Any:
        """This rank's loop state, after a committed step (its step is the state's)."""
        ...

    def restore(self, point: Any) -> None:
        """Make ``point`` (one :meth:`capture` returned) the loop's state again."""
        ...


class TrainingStatePoints:
    """A :class:`TrainingState`'s counters, scheduler and scaler, and the RNG: the Trainer's loop state."""

    def __init__(self, state: TrainingState) -> None:
        self._state = state

    def capture(self) -> Any:
        state = self._state
        return (state.step, state.epoch, state.consumed,
                None if state.scheduler is None else copy.deepcopy(state.scheduler.state_dict()),
                None if state.scaler is None else copy.deepcopy(state.scaler.state_dict()),
                capture_rng_state())

    def complete(self) -> None:
        """Nothing: the Trainer steps its scheduler before the commit, so a point is whole when taken."""

    def restore(self, point: Any) -> None:
        state = self._state
        state.step, state.epoch, state.consumed, scheduler, scaler, rng = point
        if state.scheduler is not None:
            state.scheduler.load_state_dict(scheduler)
        if state.scaler is not None:
            state.scaler.load_state_dict(scaler)
        restore_rng_state(rng)


class Fallback(Protocol):
    """Where the whole state is read from when a shard and its buddy copy are both lost."""

    directory: Path

    def latest(self) -> Any:
        """The latest checkpoint, or None."""
        ...

    def resume(self, rank: int, share_all: Callable[[Any], list[Any]]) -> Any:
        """Load the latest checkpoint on every rank (a collective)."""
        ...


class ElasticWorld:
    """One rank's elastic run and, for a sharded state, its buddy copies.

    Args:
        run: the run's membership decisions and world changes.
        model, optimizer, state: the owner's (``state.step`` counts committed steps).
        points: what the owner's loop goes back to with the shards (Note [one step back]).
        fallback: where the state is read from when a shard is lost with its
            buddy (the Trainer's checkpoints); None: the job cannot go on then.
        sharded: a ZeroOptimizer or fully_shard model: keep buddy copies.
    """

    def __init__(self, run: ElasticRun, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainingState,
                 points: LoopPoints, fallback: Fallback | None, *, sharded: bool) -> None:
        self.run, self._model, self._optimizer, self._state = run, model, optimizer, state
        self._loop_points, self._fallback = points, fallback
        # Note [buddy copies]: under ZeRO and fully_shard each rank also holds the previous rank's shard.
        self.buddy = BuddyCopies() if sharded else None
        # Note [one step back]: whether the optimizer may have changed this rank's shard
        # since the last commit, and the loop state of the last two commits.
        self._updating = False
        self._points: list[tuple[int, Any]] = []  # (step, (the loop's point, the optimizer's param groups))
        # ZeRO's shard as sent after the last commit: a copy the update leaves as it
        # is, and the shard the next step keeps (built once a step, not twice).
        self._sent: tuple[int, dict[str, Any]] | None = None
        # The shards were laid out by a grow from a world of more than one: :meth:`changed`
        # sends no copies (Note [a grow's copies ride on its first step] in buddy.py).
        self._grown = False

    # ------------------------------------------------------------------ a step's decision
    def step_started(self) -> None:
        self.run.step_started()

    def decide(self, step: int) -> None:
        """Every member steps, or none (Note [elastic trainer] in
        tandem/elastic/run.py); once agreed, this rank's shard is kept as it is
        before the optimizer changes it (Note [one step back])."""
        self.run.decide(step)
        if self.buddy is not None:
            # fully_shard's shard is views of the live tensors; ZeRO's is copied already.
            step, sent = self._state.step, self._sent
            shard = sent[1] if sent is not None and sent[0] == step else self._own_shard()
            self.buddy.keep_own(step, shard, live=is_fully_sharded(self._model))
            self._updating = True

    @property
    def membership(self) -> Membership:
        return self.run.membership

    def _own_shard(self) -> dict[str, Any]:
        """This rank's shard: a ZeRO optimizer's state and its rows of the
        parameters (Note [one step back] in tandem/elastic/buddy.py), or a
        fully-sharded model's parameters and their state (Note [elastic
        fully_shard] in tandem/elastic/fsdp_shards.py)."""
        if is_fully_sharded(self._model):
            return fsdp_shard(self._model, self._optimizer)
        return zero_shard(cast(ZeroOptimizer, self._optimizer))

    def _own_shards(self) -> list[tuple[int, dict[str, Any]]]:
        """This rank's shards with their steps: the live one unless the optimizer
        may have changed it since the last commit, and the one kept before the
        latest update (Note [one step back])."""
        assert self.buddy is not None
        own = [] if self._updating else [(self._state.step, self._own_shard())]
        if self.buddy.kept is not None and (self._updating or self.buddy.kept[0] != self._state.step):
            own.append(self.buddy.kept)
        return own

    def own_shard(self) -> list[tuple[int, dict[str, Any]]] | None:
        """This rank's shards before the world changes, each with its step (None
        without buddy copies)."""
        if self.buddy is None or self.run.needs_state:
            return None  # a replacement whose state has not arrived: Note [a join cut short]
        return self.buddy.own_shard(self._own_shards)

    def refresh_buddy(self, rank: int) -> None:
        """After a committed step: note its loop state, and send this rank's shard
        to the next rank (Note [buddy copies])."""
        if self.buddy is not None:
            self._note_point()
            members = self.run.membership.generation.members
            shard = self._own_shard()
            self._sent = None if is_fully_sharded(self._model) else (self._state.step, shard)
            self.buddy.refresh(shard, self._state.step, members, rank)

    def changed(self, rank: int) -> None:
        """A world change is complete: note its loop state, and send the new
        world's copies, unless the world only grew (Note [a grow's copies ride
        on its first step] in tandem/elastic/buddy.py)."""
        if self.buddy is None or not self._grown:
            self.refresh_buddy(rank)
            return
        self._grown = False
        self._note_point()
        self._sent = None
        self.buddy.cover(self._state.step)

    def _note_point(self) -> None:
        """The loop state of the step just committed, and the one before: what the
        shards go back to (Note [one step back])."""
        self._updating = False
        # The learning rates with it: a scheduler's state does not set them (fully_shard's shard lacks them).
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in self._optimizer.param_groups]
        self._points = [*self._points[-1:], (self._state.step, (self._loop_points.capture(), groups))]

    def restore_shards(self, own: list[tuple[int, dict[str, Any]]] | None, rank: int,
                       share_all: Callable[[Any], list[Any]] | None = None, *,
                       grown_from: Generation | None = None, rider: Sequence[int] = (),
                       check_riders: Callable[[list[list[int]]], None] | None = None) -> Resumed | None:
        """Every rank's shard of a ZeRO optimizer's state (and the parameters),
        or of a fully-sharded model and its optimizer's state, laid out for the
        new world: from the survivors and their buddy copies, one step back where
        a copy of the last step did not arrive (Note [one step back]), else from
        the last checkpoint (``share_all`` gathers an object of every rank for it:
        given with a fall-back). Returns where the loop state went back to, if it did.
        ``grown_from``: the generation before, where the change only added
        members to it (:meth:`ElasticRun.grown_from`): the shards are located
        without a gather (Note [a grow located without a gather]). ``rider``:
        the caller's numbers, which ride on the change's first collective here
        (the shards' headers, else their exchange) before any shard is loaded,
        every rank's given to ``check_riders`` (DDP's model check: Note [one
        gather for a world change's numbers] in tandem/train/trainer.py)."""
        assert self.buddy is not None
        members = self.run.membership.generation.members
        fsdp = is_fully_sharded(self._model)
        # The step this rank's parameters are of, where it holds them (ZeRO's are replicated).
        current = None if own is None or self._updating else self._state.step
        try:
            if grown_from is not None:
                located = self._located_in_a_grow(own, grown_from, rank)
            else:
                located = self.buddy.locate(own, members, current, rider=rider, check_riders=check_riders)
        except ShardsLost as e:
            fallback = self._fallback
            if fallback is None:
                raise MembershipError(f"rank {rank}: {e}; a loop of your own keeps no checkpoint for tandem to "
                                      "fall back to, so the job cannot go on: restart it from your last "
                                      "checkpoint (the Trainer falls back to its own)") from e
            if fallback.latest() is None:
                raise MembershipError(f"rank {rank}: {e}, and {fallback.directory} holds no "
                                      "checkpoint to fall back to; the job cannot go on") from e
            assert share_all is not None, "a fall-back reads the checkpoint with share_all"
            logger.warning("rank %d: %s; falling back to the last checkpoint", rank, e)
            if fsdp:
                self._optimizer.state.clear()  # laid out for the old world; the checkpoint has it
            fallback.resume(rank, share_all)
            self.run.needs_state = False  # every rank's state is the checkpoint's
            self._forget_kept()
            return Resumed(self._state.step, checkpoint=True)
        exchange = (functools.partial(self.buddy.exchange, located, rider=rider, check_riders=check_riders)
                    if grown_from is not None else functools.partial(self.buddy.exchange, located))
        if fsdp:  # Note [elastic fully_shard] in tandem/elastic/fsdp_shards.py
            load_fsdp_shards(self._model, self._optimizer, exchange)
        else:  # Note [elastic ZeRO] in tandem/elastic/zero_shards.py
            load_zero_shards(cast(ZeroOptimizer, self._optimizer), exchange, located.behind(), rank)
        self._forget_kept()
        self._grown = grown_from is not None and grown_from.world_size > 1
        step = located.step
        if own is None or step == self._state.step:
            return None  # a replacement's loop state comes from rank 0 (share_state)
        self._go_back(step, rank)
        return Resumed(step, checkpoint=False)

    def _located_in_a_grow(self, own: list[tuple[int, dict[str, Any]]] | None, before: Generation,
                           rank: int) -> Located:
        """Where the old world's shards are when the world only grew (Note [a grow
        located without a gather]).

        # Note [a grow located without a gather]
        A replacement is admitted at a step boundary that every member
        committed and copied (the ``grow`` decision), with no member lost: each
        member keeps its rank and holds its own shard of that step, live; so
        each old rank's shard is provided by the member of that rank, at the
        step committed, and the replicated state of every member is of that
        step, the replacements' of none. Every rank knows as much from the
        generations alone, so :meth:`BuddyCopies.locate`'s gather of headers is
        skipped (a round every member waits on); a replacement, whose own step
        is not the members', locates the same shards (the step is not used
        beyond the members' own check here)."""
        step = self._state.step
        provided: dict[int, dict[str, Any]] = {}
        if rank < before.world_size:  # a member; the replacements hold nothing yet
            live = [shard for at, shard in own or [] if at == step]
            if not live or self._updating:
                raise MembershipError(f"rank {rank}: the world grew from generation {before.number}, but this "
                                      f"member holds no live shard of step {step} (it holds steps "
                                      f"{[at for at, _ in own or []]}): a grow admits only at a committed step")
            provided[rank] = live[0]
        world = dist.get_world_size()
        return Located(before.world_size, provided, step, [step] * before.world_size +
                       [None] * (world - before.world_size))

    def _forget_kept(self) -> None:
        """The shards are laid out for the new world now: the kept one, for the old, is
        of no use, and a later attempt offers the live ones too (Note [a change cut
        short after its shards moved] in buddy.py)."""
        assert self.buddy is not None
        self.buddy.laid_out()
        self._sent = None
        self._updating = self._grown = False

    def _go_back(self, step: int, rank: int) -> None:
        """Note [one step back]: the loop state of ``step``, which the shards are of."""
        point = next((p for s, p in self._points if s == step), None)
        if point is None:
            raise MembershipError(f"rank {rank}: the shards were recovered at step {step}, but this rank "
                                  f"kept the loop state of steps {[s for s, _ in self._points]} only")
        loop_point, groups = point
        self._loop_points.restore(loop_point)
        for group, saved in zip(self._optimizer.param_groups, groups):
            group.update(saved)
        self._state.step = step
        logger.warning("rank %d: a copy of the last step's shard did not arrive before the loss: "
                       "going back to step %d", rank, step)

    def reset_model(self, *, check: bool = True) -> None:
        """The model over the new default group, where it has one to reset (a bare
        model, as local steps train, has none). DDP checks that every rank holds
        the same model (unless not ``check``: the caller gathers
        :meth:`model_digest` and calls :meth:`check_model`) and keeps each rank's
        values: the members' are equal, and a replacement gets the state next
        (Note [elastic trainer] in run.py). fully_shard lays its units out again,
        and issues collectives again (Note [a broken step goes on] in loop.py)."""
        model: Any = self._model
        if isinstance(model, DistributedDataParallel):
            model.reset_process_group(broadcast=False, check=check)
        elif hasattr(model, "reset_process_group"):
            model.reset_process_group()

    def model_digest(self) -> list[int]:
        """What DDP's model check compares (:meth:`DistributedDataParallel.model_digest`);
        none for a model DDP does not wrap."""
        model = self._model
        return model.model_digest() if isinstance(model, DistributedDataParallel) else []

    def check_model(self, digests: list[list[int]]) -> None:
        """DDP's model check of every rank's :meth:`model_digest`, gathered by the caller."""
        model = self._model
        if isinstance(model, DistributedDataParallel):
            model.check_model(digests)

    def post_model_digest(self) -> None:
        """Post :meth:`model_digest` in the job's store, where a grow reads it (Note [a
        grow checked in the store] in tandem/train/trainer.py); nothing to post for a
        model DDP does not wrap."""
        digest = self.model_digest()
        if digest:
            self.membership.post_model_digest(digest)

    def grown_digests(self, before: Generation, after: Generation) -> list[list[int]] | None:
        """Every rank's :meth:`model_digest` in ``after``, a grow of ``before``, read
        from the store without a collective: the members' as ``before``'s rank 0
        posted it (they hold one model: their own change checked it), the
        replacements' as each posted it. Empty for a model DDP does not wrap; None
        when one is missing or junk (Note [a grow checked in the store] in
        tandem/train/trainer.py)."""
        if not self.model_digest():
            return []
        joiners = list(after.members[before.world_size:])
        got = self.membership.model_digests([before.members[0], *joiners])
        if got is None:
            return None
        return [got[0]] * before.world_size + got[1:]

    def share_state(self, wanting: list[int]) -> None:
        """Rank 0's whole training state, on the ranks ``wanting`` it (replacements
        that joined), sent to each point to point. With buddy copies, what the
        shards hold is in place already (:meth:`restore_shards`): the
        optimizer's state, and the parameters it steps (ZeRO's rows,
        fully_shard's shards: Note [elastic fully_shard] in
        tandem/elastic/fsdp_shards.py). Then only the rest comes from rank 0: the
        loop state, the optimizer's hyper-parameters, and the model's buffers and
        the parameters no shard holds (frozen ones)."""
        optimizer, state = self._optimizer, self._state
        if self.buddy is None:
            share_state(state, wanting)
            return
        rest = self._not_in_shards()
        rank = dist.get_rank()
        if rank == 0:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            sent = {"loop": state.loop_state_dict(rng=False),  # each rank keeps its own RNG stream
                    "groups": groups, "rest": rest}
            for pending in [isend(sent, r) for r in wanting]:
                pending.wait()
            return
        if rank not in wanting:
            return
        got = recv(0)
        if sorted(got["rest"]) != sorted(rest):
            raise MembershipError(f"rank {rank}: rank 0's model has buffers and parameters "
                                  f"{sorted(got['rest'])} beside the shards, this rank's {sorted(rest)}: every "
                                  "rank must build the same model")
        state.load_loop_state_dict(got["loop"])
        for group, saved in zip(optimizer.param_groups, got["groups"]):
            group.update(saved)  # the scheduler's current learning rate, say
        with torch.no_grad():
            for name, tensor in rest.items():
                tensor.copy_(got["rest"][name])

    def _not_in_shards(self) -> dict[str, torch.Tensor]:
        """The model's tensors that no shard holds, by name: its buffers, and
        (beside a ZeRO optimizer) the parameters the optimizer does not step."""
        module = unwrap_model(self._model)
        rest: dict[str, torch.Tensor] = dict(module.named_buffers())
        if not is_fully_sharded(self._model):  # fully_shard's shards hold every parameter
            stepped = {id(p) for g in self._optimizer.param_groups for p in g["params"]}
            rest.update((n, p) for n, p in module.named_parameters() if id(p) not in stepped)
        return rest
