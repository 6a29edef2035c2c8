"""The Trainer's side of an elastic job: its membership's decisions and world
changes (Note [elastic trainer] in tandem/elastic/run.py), the buddy copies of a sharded
state (Note [buddy copies] in tandem/elastic/buddy.py), the shards restored for a new world
and the state shared with a replacement."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from tandem.comm.membership import Membership, MembershipError
from tandem.elastic.buddy import BuddyCopies, ShardsLost
from tandem.elastic.run import ElasticRun, share_state
from tandem.elastic.fsdp_shards import fsdp_shard, load_fsdp_shards
from tandem.train.run_checkpoints import RunCheckpoints
from tandem.checkpoint.full_state import is_fully_sharded
from tandem.checkpoint.state import TrainingState
from tandem.comm.watched_call import watched

__all__ = ["ElasticWorld"]

logger = logging.getLogger(__name__)


class ElasticWorld:
    """One Trainer's elastic run and, for a sharded state, its buddy copies.

    Args:
        run: the run's membership decisions and world changes.
        model, optimizer, state: the Trainer's.
        checkpoints: the fall-back when a shard is lost with its buddy.
        sharded: a ZeroOptimizer or fully_shard model: keep buddy copies.
    """

    def __init__(self, run: ElasticRun, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainingState,
                 checkpoints: RunCheckpoints, *, sharded: bool) -> None:
        self.run, self._model, self._optimizer, self._state = run, model, optimizer, state
        self._checkpoints = checkpoints
        # Note [buddy copies]: under ZeRO and fully_shard each rank also holds the previous rank's shard.
        self.buddy = BuddyCopies() if sharded else None

    @property
    def membership(self) -> Membership:
        return self.run.membership

    def _own_shard(self) -> dict[str, Any]:
        """This rank's shard: a ZeRO optimizer's state, or a fully-sharded model's
        parameters and their state (Note [elastic fully_shard] in tandem/elastic/fsdp_shards.py)."""
        if is_fully_sharded(self._model):
            return fsdp_shard(self._model, self._optimizer)
        return cast(dict[str, Any], self._optimizer.sharded_state_dict())  # type: ignore[attr-defined]

    def own_shard(self) -> dict[str, Any] | None:
        """This rank's shard before the world changes (None without buddy copies)."""
        return self.buddy.own_shard(self._own_shard) if self.buddy is not None else None

    def refresh_buddy(self, rank: int) -> None:
        """Note [buddy copies]: send this rank's shard to the next rank after a step."""
        if self.buddy is not None:
            members = self.run.membership.generation.members
            self.buddy.refresh(self._own_shard(), self._state.step, members, rank)

    def restore_shards(self, own: dict[str, Any] | None, rank: int,
                       share_all: Callable[[Any], list[Any]]) -> int | None:
        """Every rank's shard of a ZeRO optimizer's state, or of a fully-sharded
        model and its optimizer's state, laid out for the new world: from the
        survivors and their buddy copies, else from the last checkpoint (whose
        step it returns)."""
        assert self.buddy is not None
        members = self.run.membership.generation.members
        fsdp = is_fully_sharded(self._model)
        try:
            if fsdp:  # Note [elastic fully_shard] in tandem/elastic/fsdp_shards.py: unit by unit
                located = self.buddy.locate(own, self._state.step, members)
            else:
                shards = self.buddy.recover(own, self._state.step, members)
        except ShardsLost as e:
            if self._checkpoints.latest() is None:
                raise MembershipError(f"rank {rank}: {e}, and {self._checkpoints.directory} holds no "
                                      "checkpoint to fall back to; the job cannot go on") from e
            logger.warning("rank %d: %s; falling back to the last checkpoint", rank, e)
            if fsdp:
                self._optimizer.state.clear()  # laid out for the old world; the checkpoint has it
            self._checkpoints.resume(rank, share_all)
            return self._state.step
        if fsdp:
            load_fsdp_shards(self._model, self._optimizer, functools.partial(self.buddy.gather_part, located))
            return None
        self._optimizer.load_sharded_state_dicts(shards)  # type: ignore[attr-defined]
        return None

    def share_state(self) -> None:
        """Rank 0's whole training state, on every rank (a replacement joined). A
        fully-sharded model's shards are in place already (Note [elastic
        fully_shard] in tandem/elastic/fsdp_shards.py): the rest, and its buffers, come from rank 0."""
        model, optimizer, state = self._model, self._optimizer, self._state
        if is_fully_sharded(model):
            groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            box: list[Any] = [(state.loop_state_dict(), groups)]  # a collective: every rank's RNG state
            watched("broadcast_object_list of the loop state", dist.broadcast_object_list, box, src=0)
            loop, groups = box[0]
            state.load_loop_state_dict(loop)
            for group, saved in zip(optimizer.param_groups, groups):
                group.update(saved)  # the scheduler's current learning rate, say
            for buffer in model.buffers():
                watched("broadcast of a buffer", dist.broadcast, buffer, src=0)
            return
        share_state(state)
