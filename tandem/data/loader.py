"""This rank's share of a DataLoader (:class:`DistributedLoader`), built by
``tandem.prepare`` from a one-process DataLoader, and the gather that undoes the
split for metrics (:func:`gather_for_metrics`).

# Note [prepared loaders]
A prepared loader is a new ``torch.utils.data.DataLoader`` over the same
dataset, with the original's batch size, collate function, workers, pinning,
``drop_last`` and generator, whose sampler is a :class:`tandem.DistributedSampler`
(shuffling when the original's sampler was a ``RandomSampler``). Three choices:

- ``batch_size`` stays per rank, as in Accelerate's default (``split_batches=False``):
  one step of R ranks consumes R * batch_size samples. Global batch size, and
  so learning rate, scale with the world size; keep them fixed by dividing the
  batch size by R before ``prepare``.
- The sampler pads (never drops): every rank gets ``ceil(n / R)`` samples, the
  last ``R * ceil(n / R) - n`` positions repeating samples from the start of the
  epoch's order, as torch's sampler and Accelerate's ``even_batches`` do, so no
  rank waits in a collective for a batch that never comes.
  :func:`gather_for_metrics` drops exactly those repeats. After an elastic
  world change in the middle of an epoch the rest is split without padding
  instead (Note [exact split] in tandem/data/split.py): every rank still gets
  the same number of batches (an empty one where it has no sample left), and
  :attr:`DistributedLoader.batch_weight` says how much each counts.
- Each ``iter(loader)`` starts the next epoch: the first iteration yields epoch
  0, the k-th epoch k - 1, as if ``sampler.set_epoch`` had been called before
  each (the classic pitfall of a forgotten ``set_epoch`` cannot happen).
  Accelerate counts the same way. :meth:`DistributedLoader.set_epoch` chooses
  the epoch (and resume position) of the next iteration explicitly.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from tandem._tree import iter_tensors, to_device
from tandem.comm.group import GroupComm
from tandem.data.batches import PlannedBatch, empty_batch, planned_batches
from tandem.data.metrics import Samples, gather_samples
from tandem.data.sampler import DistributedSampler
from tandem.data.split import RestSplit

__all__ = ["DistributedLoader", "LoaderSpec", "distributed_loader", "gather_for_metrics", "loader_spec"]


@dataclass(frozen=True)
class LoaderSpec:
    """What a prepared loader keeps of the original, and what the ranks must agree on."""

    index: int
    dataset_size: int
    batch_size: int
    shuffle: bool
    seed: int
    drop_last: bool

    def describe(self) -> str:
        return (f"loader {self.index}: {self.dataset_size} samples, batch_size {self.batch_size}, "
                f"shuffle={self.shuffle}, seed {self.seed}, drop_last={self.drop_last}")


def loader_spec(loader: DataLoader, index: int, seed: int | None) -> LoaderSpec:
    """Read (and check) what a DistributedSampler needs from ``loader``."""
    where = f"prepare: dataloader {index}"
    if not isinstance(loader, DataLoader):
        raise TypeError(f"{where} is a {type(loader).__name__}, not a torch.utils.data.DataLoader")
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(f"{where} reads an IterableDataset ({type(loader.dataset).__name__}), which a "
                         "sampler cannot split across ranks; shard it yourself by rank, or use a "
                         "map-style dataset")
    if loader.batch_size is None:
        raise ValueError(f"{where} has a custom batch_sampler ({type(loader.batch_sampler).__name__}); "
                         "prepare splits samples, not batches: pass batch_size= (and shuffle=) instead")
    sampler = loader.sampler
    if isinstance(sampler, (DistributedSampler, torch.utils.data.distributed.DistributedSampler)):
        raise ValueError(f"{where} already has a DistributedSampler; pass the loader over the whole "
                         "dataset (shuffle=True or False) and prepare splits it")
    if isinstance(sampler, RandomSampler):
        size = len(cast(Sized, loader.dataset))
        if sampler.replacement or sampler.num_samples != size:
            raise ValueError(f"{where}: a RandomSampler with replacement={sampler.replacement}, "
                             f"num_samples={sampler.num_samples} (dataset of {size}) cannot be split "
                             "across ranks; use shuffle=True without them")
        shuffle = True
    elif isinstance(sampler, SequentialSampler):
        shuffle = False
    else:
        raise ValueError(f"{where} has a {type(sampler).__name__} sampler; prepare knows how to split "
                         "a RandomSampler (shuffle=True) or a SequentialSampler (shuffle=False) only")
    if seed is None:
        generator = getattr(sampler, "generator", None) or loader.generator
        seed = generator.initial_seed() if generator is not None else 0
    return LoaderSpec(index=index, dataset_size=len(cast(Sized, loader.dataset)),
                       batch_size=loader.batch_size, shuffle=shuffle, seed=int(seed),
                       drop_last=bool(loader.drop_last))


_PASSED_THROUGH = ("num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
                   "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers",
                   "pin_memory_device", "in_order")


def distributed_loader(loader: DataLoader, spec: LoaderSpec, comm: GroupComm,
                        device: torch.device | None) -> DistributedLoader:
    sampler = DistributedSampler(cast(Sized, loader.dataset), num_replicas=comm.size, rank=comm.rank,
                                 shuffle=spec.shuffle, seed=spec.seed, drop_last=False)
    return DistributedLoader(_loader_over(loader, spec.batch_size, sampler), device)


def _loader_over(loader: DataLoader, batch_size: int, sampler: DistributedSampler) -> DataLoader:
    """A DataLoader like ``loader`` (its dataset and options) over ``sampler``."""
    accepted = inspect.signature(DataLoader.__init__).parameters
    options = {name: getattr(loader, name) for name in _PASSED_THROUGH
               if name in accepted and hasattr(loader, name)}
    return DataLoader(loader.dataset, batch_size=batch_size, sampler=sampler, **options)


# What a prepared loader is: Note [prepared loaders] at the top of this file.
class DistributedLoader:
    """This rank's share of a DataLoader, one epoch per iteration, as
    ``tandem.prepare`` makes it.

    Iterating it yields what the original DataLoader would for this rank's
    samples under a :class:`tandem.DistributedSampler`, each batch moved to
    ``device``. ``batch_size`` stays per rank: one step of R ranks consumes
    R * batch_size samples. Every rank gets as many samples: the sampler pads
    the epoch with samples from its start, as torch's does
    (:func:`gather_for_metrics` drops the repeats). Each ``iter()`` starts the
    next epoch (0, 1, 2, ...), so the order reshuffles without a ``set_epoch``
    call; :meth:`set_epoch` sets the next one explicitly (e.g. when resuming).

    Attributes:
        loader: the underlying ``torch.utils.data.DataLoader``.
        sampler: its :class:`tandem.DistributedSampler`.
        device: where batches are moved, or None to leave them where collate put them.
    """

    def __init__(self, loader: DataLoader, device: torch.device | None) -> None:
        self.loader = loader
        self.sampler = cast(DistributedSampler, loader.sampler)
        self.device = device
        self._epoch = 0
        self._fresh = True     # the sampler is set for _epoch, and no iteration has used it yet
        self._yielded = 0      # samples this rank received in the current iteration
        self._split = self._new_split()  # the current iteration's global batches (Note [exact split])
        self._index = 0        # global batches of _split yielded so far
        self._weight = 1.0     # the weight of the batch yielded last
        # Note [elastic prepare] in tandem/elastic/loop.py: an elastic loop's position.
        self._active = False   # an iteration started and has not reached its end
        self._committed = 0    # positions of _epoch that the job's committed steps consumed
        self._resplit = False  # the world changed: the iteration goes on from _committed
        self.before_batch: Callable[[], None] | None = None  # an elastic loop's step boundary
        self.before_end: Callable[[], None] | None = None  # and its check before an iteration ends
        self.on_weight: Callable[[float], None] | None = None  # told each batch's weight (Note [exact split])

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_size(self) -> int:
        """Samples per batch on this rank (not across ranks)."""
        return cast(int, self.loader.batch_size)

    @property
    def drop_last(self) -> bool:
        return self.loader.drop_last

    @property
    def epoch(self) -> int:
        """The epoch of the iteration in progress, or of the next one after :meth:`set_epoch`."""
        return self._epoch

    @property
    def yielded(self) -> int:
        """Samples this rank has received so far in the current iteration."""
        return self._yielded

    @property
    def remaining(self) -> int:
        """Samples of the dataset the current iteration covers, all ranks together
        (the dataset size, less a resume position)."""
        return self.sampler.dataset_size - self._split.start

    @property
    def batch_weight(self) -> float:
        """How many times the gradient of the batch yielded last counts in DDP's
        mean over the ranks: 1.0, except in the last batch of an epoch split
        exactly after a world change, whose ranks' batches differ in size: there
        a rank's gradient counts in proportion to its batch size, so that the
        mean is the gradient of the global batch's mean loss. :attr:`on_weight`
        is told it."""
        return self._weight  # Note [exact split] in tandem/data/split.py

    def set_epoch(self, epoch: int, start: int = 0, *, exact: bool = False) -> None:
        """Make the next iteration yield ``epoch``, after the first ``start`` samples
        the whole job consumed (see :meth:`tandem.DistributedSampler.set_epoch`,
        and its ``exact``); later iterations continue with ``epoch + 1``,
        ``epoch + 2``, ... from their start."""
        self.sampler.set_epoch(epoch, start, exact=exact)
        self._epoch = epoch
        self._fresh = True

    def __len__(self) -> int:
        """Batches of this rank in an epoch (that of :attr:`epoch`)."""
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if not self._fresh:
            self.sampler.set_epoch(self._epoch + 1)
            self._epoch += 1
        self._fresh = False
        self._active, self._resplit = True, False
        return self._batches(self._start_split())

    def _new_split(self) -> RestSplit:
        return self.sampler.split(self.batch_size, self.drop_last)

    def _start_split(self) -> Iterator[PlannedBatch]:
        """This rank's batches of what the sampler is set to; counts restart."""
        self._yielded, self._index = 0, 0
        self._split = self._new_split()
        self._committed = self.sampler.start
        return planned_batches(iter(self.loader), self._split, self.sampler.rank, self._empty_batch)

    def _empty_batch(self) -> Any:
        return empty_batch(self.loader.collate_fn, self.dataset)

    def _batches(self, batches: Iterator[PlannedBatch]) -> Iterator[Any]:
        while True:
            if self.before_batch is not None:  # may change the world, and so set _resplit
                self.before_batch()
            if self._resplit:  # Note [elastic prepare]: the rest of the epoch, over the new world
                self._resplit = False
                # Note [exact split]: mid-epoch, the rest is split without padding.
                self.sampler.set_epoch(self._epoch, self._committed, exact=self._committed > 0)
                batches = self._start_split()
            planned = next(batches, None)
            if planned is None and self.before_end is not None:
                # Note [an epoch's last step] in tandem/elastic/loop.py: the loop may go back a step.
                self.before_end()
                if self._resplit:
                    continue
            if planned is None:
                self._active = False
                self._set_weight(1.0)
                return
            self._index += 1
            self._yielded += planned.count
            self._set_weight(planned.weight)
            batch = planned.batch
            yield batch if self.device is None else to_device(batch, self.device)

    def _set_weight(self, weight: float) -> None:
        self._weight = weight
        if self.on_weight is not None:
            self.on_weight(weight)

    # ------------------------------------------------------------------ an elastic loop
    def commit(self) -> None:
        """A step of an elastic loop committed: what this iteration yielded so far,
        on every rank, is consumed."""
        # Note [elastic prepare] in tandem/elastic/loop.py.
        if self._active:
            consumed = self._split.consumed_after(self._index)
            self._committed = min(consumed, self.sampler.dataset_size)

    @property
    def committed(self) -> tuple[int, int]:
        """``(epoch, positions)``: what the job's committed steps consumed of the
        epoch of the iteration in progress (or of the last one)."""
        return self._epoch, self._committed

    def go_back(self, committed: tuple[int, int]) -> bool:
        """Make an earlier :attr:`committed` this iteration's again: an elastic loop
        went back a step, and the step's samples come again at the next batch
        (after :meth:`regroup`). False, changing nothing, when that epoch's
        iteration is no longer in progress."""
        # Why a loop goes back: Note [one step back] in tandem/elastic/buddy.py.
        epoch, positions = committed
        if epoch != self._epoch or not self._active:
            return False
        self._committed = positions
        return True

    @property
    def active(self) -> bool:
        """Whether an iteration has started and not reached its end."""
        return self._active

    def position(self) -> tuple[int, int]:
        """``(epoch, start)`` that a replacement's loader takes up: where this
        loader's iteration in progress goes on, else where its next one starts.
        A replacement takes up a ``start`` past 0 with ``exact``, as this loader
        goes on after the world changed: the rest of the epoch split without
        padding."""
        # Note [exact split] in tandem/data/split.py.
        if self._active:
            return self._epoch, self._committed
        if self._fresh:
            return self._epoch, self.sampler.start
        return self._epoch + 1, 0

    def regroup(self, num_replicas: int, rank: int) -> None:
        """Split over a new world (an elastic job's changed): an iteration in
        progress goes on, from its next batch, with the positions that its
        committed steps did not consume; a later one splits its whole epoch. Past
        the start of an epoch, the rest is split exactly: no sample padded or
        repeated, and every rank still gets as many batches (an empty one where
        it has no sample left)."""
        # Note [elastic prepare] in tandem/elastic/loop.py; Note [exact split] in tandem/data/split.py.
        old = self.sampler
        sampler = DistributedSampler(cast(Sized, self.dataset), num_replicas=num_replicas, rank=rank,
                                     shuffle=old.shuffle, seed=old.seed, drop_last=old.drop_last)
        sampler.set_epoch(old.epoch, old.start, exact=old.start > 0)
        self.loader = _loader_over(self.loader, self.batch_size, sampler)
        self.sampler = sampler
        self._resplit = self._active

    def __repr__(self) -> str:
        return (f"DistributedLoader(rank {self.sampler.rank} of {self.sampler.num_replicas}, "
                f"{len(self.sampler)} of {self.sampler.dataset_size} samples, batch_size "
                f"{self.batch_size}, shuffle={self.sampler.shuffle}, epoch {self._epoch})")



# ---------------------------------------------------------------------- in the loop

def gather_for_metrics(values: Samples, loader: DistributedLoader,
                       group: dist.ProcessGroup | None = None) -> Samples:
    """Every rank's results for the samples ``loader`` yielded last, each sample
    once, in the epoch's order, on every rank.

    ``values`` holds this rank's results (one row per sample) of the last ``k``
    samples ``loader`` yielded in its current iteration: one batch, inside the
    loop, or ``torch.cat`` of every batch, after it. The rows of all ranks are
    gathered and interleaved back into the sampler's order, and the padding
    that made the ranks' shares equal (samples repeated from the start of the
    epoch) is dropped: a metric over the result counts each sample of the
    dataset once. A collective: call it on every rank, at the same point of the
    loop.

    Args:
        values: a tensor, or a tuple, list or dict of tensors, each with ``k``
            rows (the same ``k`` on every rank).
        loader: the :class:`DistributedLoader` the samples came from.
        group: the process group the loader's sampler splits over (default:
            the default group).

    Returns:
        The same kind of value, each tensor with at most ``k * world_size`` rows.

    Raises:
        TypeError: ``values`` holds no tensor with a first dimension.
        ValueError: ``k`` exceeds what ``loader`` yielded in this iteration, or
            the ranks' values differ in rows, shapes or kinds (on every rank).
    """
    rows = _rows(values)
    if loader.sampler.exact:
        raise RuntimeError(
            f"gather_for_metrics (rank {loader.sampler.rank}): the loader's epoch was split again after "
            "a world change, without padding (Note [exact split] in tandem/data/split.py), so the ranks "
            "hold different numbers of samples; gather over an iteration that started in this world")
    if rows > loader.yielded:
        raise ValueError(
            f"gather_for_metrics (rank {loader.sampler.rank}): values hold {rows} rows, but the loader "
            f"yielded {loader.yielded} samples in this iteration; pass the results of the samples it "
            "yielded last (one batch, or every batch since the iteration started)")
    world = loader.sampler.num_replicas
    # Rank-local sample i stands at position i * world + rank of what the iteration covers
    # (tandem/data/sampler.py); positions past `remaining` are padding.
    before = loader.yielded - rows
    keep = max(0, min(rows * world, loader.remaining - before * world))
    return gather_samples(values, keep, group)


def _rows(values: Samples) -> int:
    first = next(iter_tensors(values), None)
    if first is None or first.dim() == 0:
        raise TypeError("gather_for_metrics takes a tensor, or a tuple, list or dict of tensors, each "
                        f"with one row per sample; got {type(values).__name__} without such a tensor")
    return first.shape[0]
