"""The Trainer in an elastic job: when the world changes, regroup, rebuild what
depends on it and go on (Note [elastic trainer] in elastic.py); the fourth of
the Trainer's layers (trainer.py lists them)."""

from __future__ import annotations

import functools
import logging
from typing import Any, cast

import torch.distributed as dist
from torch import nn

from tandem.comm.bootstrap import elastic_membership
from tandem.comm.membership import Generation, MembershipError
from tandem.fsdp.regroup import check_regroupable
from tandem.train.buddy import ShardsLost
from tandem.checkpoint.one_rank import latest_checkpoint
from tandem.train.precision import ShardedGradients
from tandem.train.elastic import ElasticRun, WorldChange, elastic_config, share_state
from tandem.train.elastic_fsdp import fsdp_shard, load_fsdp_shards
from tandem.train.history import History
from tandem.train.progress import Progress
from tandem.train.sharded import is_fully_sharded
from tandem.train.trainer_checkpoints import TrainerCheckpoints

__all__ = ["ElasticTrainer"]

logger = logging.getLogger(__name__)


class ElasticTrainer(TrainerCheckpoints):
    """The Trainer's fourth layer: the elastic run, world changes, the state shared with a replacement."""

    def _elastic_run(self, model: nn.Module) -> ElasticRun | None:
        elastic = elastic_config(self.config.elastic, "TrainerConfig")
        if elastic is None:
            return None
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("TrainerConfig(elastic=...) needs a process group: call tandem.init() first")
        if is_fully_sharded(model):
            check_regroupable(model, self.rank)  # Note [regrouped units] in tandem/fsdp/regroup.py
        return ElasticRun(elastic_membership(elastic))

    @property
    def world_changes(self) -> list[WorldChange]:
        """Every change of an elastic job's world this Trainer went through (also
        in the history, as records of kind ``"elastic"``)."""
        return [] if self._elastic is None else list(self._elastic.changes)

    def _change_world(self, cause: BaseException | None, history: History, progress: Progress) -> None:
        """Note [elastic trainer] in elastic.py: regroup, rebuild what depends on the world, go on."""
        assert self._elastic is not None
        in_step, self._in_step = self._in_step, False

        def rebuild(before: Generation, after: Generation) -> int | None:
            own = self._buddy.own_shard(self._own_shard) if self._buddy is not None else None
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.optimizer.zero_grad(set_to_none=True)
            self.model.reset_process_group()  # type: ignore[operator]
            resumed = None
            if self._buddy is not None:
                if not is_fully_sharded(self.model):
                    self.optimizer.reset_process_group()  # type: ignore[attr-defined]
                resumed = self._restore_shards(own)
            self._build_loaders()
            if after.joined_since(before):
                self._share_state()
            self._refresh_buddy()  # copies for the new world, before its first step
            return resumed

        self._elastic.regroup(cause, self.state.step, in_step=in_step, rebuild=rebuild,
                              report=lambda change: self._report(change, history, progress))

    def _report(self, change: WorldChange, history: History, progress: Progress) -> None:
        logger.warning("rank %d: %s", self.rank, change.describe())
        progress.say(change.describe())
        history.append(change.record())

    def _own_shard(self) -> dict[str, Any]:
        """This rank's shard: a ZeRO optimizer's state, or a fully-sharded model's
        parameters and their state (Note [elastic fully_shard] in elastic_fsdp.py)."""
        if is_fully_sharded(self.model):
            return fsdp_shard(self.model, self.optimizer)
        return cast(dict[str, Any], self.optimizer.sharded_state_dict())  # type: ignore[attr-defined]

    def _refresh_buddy(self) -> None:
        """Note [buddy copies]: send this rank's shard to the next rank after a step."""
        if self._buddy is not None and self._elastic is not None:
            generation = self._elastic.membership.generation
            self._buddy.refresh(self._own_shard(), self.state.step, generation.members, self.rank)

    def _restore_shards(self, own: dict[str, Any] | None) -> int | None:
        """Every rank's shard of a ZeRO optimizer's state, or of a fully-sharded
        model and its optimizer's state, laid out for the new world: from the
        survivors and their buddy copies, else from the last checkpoint (whose
        step it returns)."""
        assert self._buddy is not None and self._elastic is not None
        members = self._elastic.membership.generation.members
        fsdp = is_fully_sharded(self.model)
        try:
            if fsdp:  # Note [elastic fully_shard] in elastic_fsdp.py: unit by unit
                located = self._buddy.locate(own, self.state.step, members)
            else:
                shards = self._buddy.recover(own, self.state.step, members)
        except ShardsLost as e:
            if latest_checkpoint(self.checkpoint_dir) is None:
                raise MembershipError(f"rank {self.rank}: {e}, and {self.checkpoint_dir} holds no "
                                      "checkpoint to fall back to; the job cannot go on") from e
            logger.warning("rank %d: %s; falling back to the last checkpoint", self.rank, e)
            if fsdp:
                self.optimizer.state.clear()  # laid out for the old world; the checkpoint has it
            self._resume()
            return self.state.step
        if fsdp:
            load_fsdp_shards(self.model, self.optimizer,
                             functools.partial(self._buddy.gather_part, located))
            return None
        self.optimizer.load_sharded_state_dicts(shards)  # type: ignore[attr-defined]
        if self.scaler is not None:
            self._scaled = ShardedGradients(self.optimizer, cast(Any, self.model).reducer.grad_shards)
        return None

    def _share_state(self) -> None:
        """Rank 0's whole training state, on every rank (a replacement joined). A
        fully-sharded model's shards are in place already (Note [elastic
        fully_shard] in elastic_fsdp.py): the rest, and its buffers, come from rank 0."""
        if is_fully_sharded(self.model):
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            box: list[Any] = [(self.state.loop_state_dict(), groups)]  # a collective: every rank's RNG state
            dist.broadcast_object_list(box, src=0)
            loop, groups = box[0]
            self.state.load_loop_state_dict(loop)
            for group, saved in zip(self.optimizer.param_groups, groups):
                group.update(saved)  # the scheduler's current learning rate, say
            for buffer in self.model.buffers():
                dist.broadcast(buffer, src=0)
            return
        share_state(self.state)
