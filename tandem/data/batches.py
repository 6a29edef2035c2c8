"""One rank's batches of a :class:`~tandem.data.split.RestSplit`: what its
DataLoader yields, an empty batch where the rank has no sample left, and each
batch's weight (Note [exact split] in split.py). Used by the prepared loaders
and by the Trainer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tandem._tree import iter_tensors, map_tensors
from tandem.data.split import RestSplit

__all__ = ["PlannedBatch", "empty_batch", "planned_batches"]


@dataclass(frozen=True)
class PlannedBatch:
    """One batch of a rank, with its place in the split."""

    batch: Any
    """What the DataLoader yielded, or an empty batch."""
    index: int
    """The global batch it belongs to (0 for the first of the split)."""
    count: int
    """This rank's samples in it (0: an empty batch)."""
    weight: float
    """How many times its gradient counts in DDP's mean (:meth:`RestSplit.weight`)."""


def planned_batches(batches: Iterator[Any], split: RestSplit, rank: int,
                    empty: Callable[[], Any]) -> Iterator[PlannedBatch]:
    """``rank``'s batches of ``split``: as many as every other rank's, each from
    ``batches`` (a DataLoader over the sampler whose split it is) or, where the
    rank has no sample, ``empty()``."""
    for k in range(split.num_batches):
        count = split.count(rank, k)
        if count:
            batch = next(batches, _END)
            if batch is _END:
                raise RuntimeError(
                    f"rank {rank}: the DataLoader ended after {k} batches, but the split of the "
                    f"epoch's rest gives every rank {split.num_batches}; its sampler and batch size "
                    "must be those the split was made from (DistributedSampler.split)")
        else:
            batch = empty()
        yield PlannedBatch(batch, k, count, split.weight(rank, k))


_END = object()


def empty_batch(collate_fn: Callable[[list[Any]], Any], dataset: Any) -> Any:
    """A batch of no sample: ``collate_fn([dataset[0]])`` with every tensor cut
    to no rows. A model's layers give it an empty output and zero gradients,
    so a rank left without a sample still takes part in the step (Note [exact split]).

    Raises:
        TypeError: the collated batch holds no tensor, so it cannot be emptied.
    """
    batch = collate_fn([dataset[0]])
    if not any(t.dim() > 0 for t in iter_tensors(batch)):
        raise TypeError(
            f"a rank left with no sample in the last step of an epoch split after a world change "
            f"needs an empty batch, but collate_fn returned a {type(batch).__name__} without tensors "
            "of a batch dimension; collate into tensors (or tuples, lists, dicts of them)")
    return map_tensors(_no_rows, batch)


def _no_rows(t: torch.Tensor) -> torch.Tensor:
    return t[:0] if t.dim() > 0 else t
