"""What a :class:`~tandem.train.trainer.Trainer` holds and how it is set up for a
world: the wrapped model, the non-finite guard, samplers and loaders (built
again when an elastic world changes), and the config's derived values; the
first of the Trainer's layers (trainer.py lists them)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sized
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tandem.data import DistributedSampler
from tandem.ddp.checks import NonFinite
from tandem.train.buddy import BuddyCopies
from tandem.train.config import CheckpointFormat, Precision, TrainerConfig
from tandem.train.elastic import ElasticRun
from tandem.train.probes import is_ddp
from tandem.train.rng import rank_seed
from tandem.train.sharded import is_fully_sharded
from tandem.train.state import TrainingState

__all__ = ["Metric", "TrainerBase"]

logger = logging.getLogger(__name__)

Metric = Callable[[torch.Tensor, torch.Tensor], Any]


class TrainerBase:
    """The Trainer's first layer: its state (set by ``Trainer.__init__``) and its set-up."""

    config: TrainerConfig
    rank: int
    world_size: int
    _elastic: ElasticRun | None
    _in_step: bool  # between a step's first forward and its decision (an elastic world)
    _buddy: BuddyCopies | None  # Note [buddy copies]: an elastic job under ZeRO
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]
    metrics: dict[str, Metric]
    scaler: Any  # a GradScaler under fp16, else None
    _scaled: Any  # what the scaler unscales and steps
    _guard: NonFinite | None
    _autocast: Callable[[], Any]
    train_data: Dataset
    eval_data: Dataset | None
    _collate_fn: Callable[[list[Any]], Any] | None
    sampler: DistributedSampler
    train_loader: DataLoader
    eval_loader: DataLoader | None
    state: TrainingState
    checkpoint_dir: Path
    checkpoint_format: CheckpointFormat

    def _build_loaders(self) -> None:
        """The samplers and loaders of this world (built again when an elastic world changes)."""
        self.sampler = DistributedSampler(cast(Sized, self.train_data), num_replicas=self.world_size,
                                          rank=self.rank, shuffle=self.config.shuffle, seed=self.config.seed,
                                          drop_last=self.config.drop_last)
        self.train_loader = self._loader(self.train_data, self.sampler, self.config.batch_size,
                                         self._collate_fn)
        self.eval_loader = None
        if self.eval_data is not None:
            eval_sampler = DistributedSampler(cast(Sized, self.eval_data), num_replicas=self.world_size,
                                              rank=self.rank, shuffle=False)
            self.eval_loader = self._loader(self.eval_data, eval_sampler,
                                            self.config.eval_batch_size or self.config.batch_size,
                                            self._collate_fn)

    def _wrap(self, model: nn.Module) -> nn.Module:
        alone = self.world_size == 1 and self._elastic is None  # an elastic world may grow
        if alone or is_ddp(model) or is_fully_sharded(model):
            return model
        from tandem.ddp import DistributedDataParallel
        options = dict(self.config.ddp_options)
        if self.config.nonfinite is not None and self._precision is not Precision.FP16:
            options["check_finite"] = self.config.nonfinite
        return DistributedDataParallel(model, **options)

    def _nonfinite_guard(self) -> NonFinite | None:
        """What a step with NaN/Inf gradients does, when the Trainer must look
        (the GradScaler looks itself under fp16). A DDP model checks, and agrees
        across ranks, by itself; a single process checks its own gradients."""
        wanted = self._nonfinite
        if self._precision is Precision.FP16:
            return None
        if is_ddp(self.model):
            has = getattr(self.model, "check_finite", None)
            if wanted is not None and has is not wanted:
                raise ValueError(
                    f"rank {self.rank}: nonfinite={wanted.value!r}, but the model is a "
                    f"DistributedDataParallel built with check_finite="
                    f"{None if has is None else has.value!r}; pass check_finite={wanted.value!r} "
                    "when wrapping it, or leave nonfinite unset")
            return has
        if wanted is not None and self.world_size > 1:
            raise ValueError(f"nonfinite={wanted.value!r} is not supported with a fully-sharded model "
                             "yet; with precision='fp16' its GradScaler skips non-finite steps on "
                             "every rank together")
        return wanted

    def _loader(self, data: Dataset, sampler: DistributedSampler, batch_size: int,
                collate_fn: Callable[[list[Any]], Any] | None) -> DataLoader:
        # A generator of its own: otherwise each iter() draws the workers' base seed from
        # the global torch RNG, and a run resumed mid-epoch (one extra iter()) would
        # continue with dropout masks shifted by one draw. Note [exact resume] in state.py.
        generator = torch.Generator().manual_seed(rank_seed(self.config.seed, self.rank))
        return DataLoader(data, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                          num_workers=self.config.num_workers, generator=generator,
                          pin_memory=self.device.type == "cuda")

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step, all ranks together (a full step)."""
        return self.config.batch_size * self.config.grad_accum * self.world_size

    # TrainerConfig.__post_init__ normalises these fields; they are typed for what a caller passes.
    @property
    def _precision(self) -> Precision:
        return cast(Precision, self.config.precision)

    @property
    def _nonfinite(self) -> NonFinite | None:
        return cast("NonFinite | None", self.config.nonfinite)

    @property
    def _output_dir(self) -> Path:
        return cast(Path, self.config.output_dir)

    def _share_all(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, on every rank."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out
