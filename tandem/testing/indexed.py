"""A regression data set whose samples carry their index, so that a test can
tell which samples each rank trained on in each step (an elastic job that
shrinks, grows or splits the rest of an epoch must train on each sample once)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

__all__ = ["IndexedSamples"]


class IndexedSamples(Dataset[tuple[torch.Tensor, tuple[torch.Tensor, int]]]):
    """``n`` samples ``(x, (y, i))``: ``x`` of ``features`` and ``y`` of
    ``targets`` normal values, drawn from a generator seeded with ``seed``, and
    ``i`` the sample's index. ``x`` and ``y`` are also whole tensors, for a
    reference that trains on a list of indices in one process."""

    def __init__(self, n: int, features: int, targets: int = 2, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, features, generator=g)
        self.y = torch.randn(n, targets, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, tuple[torch.Tensor, int]]:
        return self.x[i], (self.y[i], i)
