"""Models and data for tests/tools/test_check.py: entry points that ``tandem check``
imports in its spawned ranks (this directory is on their path)."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

import tandem

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 12  # 12 splits over 2 and 3 ranks


def mlp() -> nn.Module:
    return nn.Sequential(OrderedDict(fc=nn.Linear(IN, HIDDEN), act=nn.Tanh(), head=nn.Linear(HIDDEN, OUT)))


class Blocks(nn.Module):
    """An MLP whose layers sit in a ModuleList, so that fully_shard makes one unit per layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, OUT)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


def blocks() -> nn.Module:
    return Blocks()


class BlocksBF16(Blocks):
    """Blocks cast to bfloat16 before sharding, as ``model.to(torch.bfloat16)`` does: fp32 data in, fp32 out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(torch.bfloat16)).float()


def blocks_bf16() -> nn.Module:
    return BlocksBF16().to(torch.bfloat16)


def batchnorm() -> nn.Module:
    return nn.Sequential(OrderedDict(fc=nn.Linear(IN, HIDDEN), bn=nn.BatchNorm1d(HIDDEN), act=nn.ReLU(),
                                     head=nn.Linear(HIDDEN, OUT)))


def batchnorm_synced() -> nn.Module:
    return tandem.SyncBatchNorm.convert_sync_batchnorm(batchnorm())


def batchnorm_torch_synced() -> nn.Module:
    return nn.SyncBatchNorm.convert_sync_batchnorm(batchnorm())


def _dropout() -> nn.Module:
    return nn.Sequential(OrderedDict(fc=nn.Linear(IN, HIDDEN), act=nn.ReLU(), drop=nn.Dropout(0.5),
                                     head=nn.Linear(HIDDEN, OUT)))


def dropout_same_seed() -> nn.Module:
    """Leaves every rank's generator where the tool's seed put it: the same masks on every rank."""
    return _dropout()


def dropout_per_rank() -> nn.Module:
    """Seeds each rank differently after building the model, as tandem's digits example does."""
    model = _dropout()
    tandem.seed_everything(0, per_rank=True)
    return model


def regression(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: float targets (the default loss is MSE)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def classification(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer targets (the default loss is cross-entropy)."""
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(BATCH, IN, generator=g), torch.randint(0, OUT, (BATCH,), generator=g)


def strided_shards(step: int, rank: int | None = None, world_size: int | None = None) -> tuple[torch.Tensor, ...]:
    """The user's own sharding, done right: rank r takes samples r, r+n, r+2n, ..."""
    x, y = regression(step)
    if rank is None or world_size is None:
        return x, y
    return x[rank::world_size], y[rank::world_size]


def same_shard_everywhere(step: int, rank: int | None = None,
                          world_size: int | None = None) -> tuple[torch.Tensor, ...]:
    """A sharding bug: every rank trains on the first 1/n of the global batch."""
    x, y = regression(step)
    if rank is None or world_size is None:
        return x, y
    per = x.shape[0] // world_size
    return x[:per], y[:per]
