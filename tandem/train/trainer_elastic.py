"""The Trainer in an elastic job: when the world changes, regroup, rebuild what
depends on it and go on (Note [elastic trainer] in elastic.py); the fourth of
the Trainer's layers (trainer.py lists them)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist
from torch import nn

from tandem.comm.bootstrap import elastic_membership
from tandem.comm.membership import ElasticConfig, Generation
from tandem.train.elastic import ElasticRun, WorldChange, is_peer_failure
from tandem.train.history import History
from tandem.train.progress import Progress
from tandem.train.sharded import is_fully_sharded
from tandem.train.trainer_checkpoints import TrainerCheckpoints

__all__ = ["ElasticTrainer"]

logger = logging.getLogger(__name__)


class ElasticTrainer(TrainerCheckpoints):
    """The Trainer's fourth layer: the elastic run, world changes, the state shared with a replacement."""

    def _elastic_run(self, model: nn.Module) -> ElasticRun | None:
        elastic = self.config.elastic
        if elastic is None:  # `tandem run --elastic` asks for it
            elastic = ElasticConfig() if os.environ.get("TANDEM_ELASTIC") == "1" else False
        if not isinstance(elastic, ElasticConfig):
            return None
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("TrainerConfig(elastic=...) needs a process group: call tandem.init() first")
        if is_fully_sharded(model) or bool(getattr(model, "zero_stage", 0)):
            raise ValueError(f"rank {self.rank}: elastic training supports DistributedDataParallel models "
                             "so far, not fully_shard or ZeRO (a dead rank takes its shard with it); "
                             "pass the plain model, or leave elastic unset")
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

        def rebuild(before: Generation, after: Generation) -> None:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.optimizer.zero_grad(set_to_none=True)
            self.model.reset_process_group()  # type: ignore[operator]
            self._build_loaders()
            if after.joined_since(before):
                self._share_state()

        while True:
            try:
                change = self._elastic.change_world(cause, self.state.step, in_step=in_step,
                                                    rebuild=rebuild)
            except Exception as e:
                if not is_peer_failure(e):
                    raise
                # Lost another member while rebuilding (a replacement that died as it
                # joined, say): the change happened, and the next one starts now.
                self._report(self._elastic.changes[-1], history, progress)
                cause = e
                continue
            self._report(change, history, progress)
            return

    def _report(self, change: WorldChange, history: History, progress: Progress) -> None:
        logger.warning("rank %d: %s", self.rank, change.describe())
        progress.say(change.describe())
        history.append(change.record())

    def _share_state(self) -> None:
        """Rank 0's whole training state, on every rank (a replacement joined)."""
        box: list[Any] = [self.state.state_dict()]  # a collective: every rank's RNG state is gathered
        dist.broadcast_object_list(box, src=0)
        self.state.load_state_dict(box[0])
