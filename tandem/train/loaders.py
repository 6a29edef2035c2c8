"""The Trainer's data for one world: the training sampler (set_epoch and
mid-epoch resume) and loader, and the evaluation loader; built again when an
elastic world changes."""

from __future__ import annotations

import math
from collections.abc import Callable, Sized
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset

from tandem.data import DistributedSampler
from tandem.train.config import TrainerConfig
from tandem.checkpoint.rng import rank_seed

__all__ = ["Loaders"]


class Loaders:
    """The samplers and loaders of rank ``rank`` in a world of ``world_size``."""

    def __init__(self, train_data: Dataset, eval_data: Dataset | None,
                 collate_fn: Callable[[list[Any]], Any] | None, config: TrainerConfig,
                 device: torch.device, rank: int, world_size: int) -> None:
        self._config, self._device, self._rank, self.world_size = config, device, rank, world_size
        self.sampler = DistributedSampler(cast(Sized, train_data), num_replicas=world_size, rank=rank,
                                          shuffle=config.shuffle, seed=config.seed, drop_last=config.drop_last)
        self.train = self._loader(train_data, self.sampler, config.batch_size, collate_fn)
        self.eval: DataLoader | None = None
        if eval_data is not None:
            eval_sampler = DistributedSampler(cast(Sized, eval_data), num_replicas=world_size, rank=rank,
                                              shuffle=False)
            self.eval = self._loader(eval_data, eval_sampler, config.eval_batch_size or config.batch_size,
                                     collate_fn)

    def _loader(self, data: Dataset, sampler: DistributedSampler, batch_size: int,
                collate_fn: Callable[[list[Any]], Any] | None) -> DataLoader:
        # A generator of its own: otherwise each iter() draws the workers' base seed from
        # the global torch RNG, and a run resumed mid-epoch (one extra iter()) would
        # continue with dropout masks shifted by one draw. Note [exact resume] in tandem/checkpoint/state.py.
        generator = torch.Generator().manual_seed(rank_seed(self._config.seed, self._rank))
        return DataLoader(data, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                          num_workers=self._config.num_workers, generator=generator,
                          pin_memory=self._device.type == "cuda")

    @property
    def samples_per_rank(self) -> int:
        """Samples of one whole epoch on each rank (the sampler pads or drops to equal shares)."""
        n = self.sampler.dataset_size
        return n // self.world_size if self._config.drop_last else math.ceil(n / self.world_size)

    @property
    def steps_per_epoch(self) -> int:
        micro_batches = math.ceil(self.samples_per_rank / self._config.batch_size)
        return math.ceil(micro_batches / self._config.grad_accum)
