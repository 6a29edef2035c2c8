"""``tandem.data.DistributedSampler``: torch's sampler, plus resuming in the middle
of an epoch, at the same or at a different world size.

Every epoch has one global order of the dataset (a seeded permutation, or the
dataset order), padded or truncated to a multiple of the world size; rank ``r``
takes every ``num_replicas``-th position of it from position ``r``. Without a
resume position this is exactly :class:`torch.utils.data.distributed.DistributedSampler`,
index for index.
"""

from __future__ import annotations

import itertools
import logging
import operator
from collections.abc import Iterator, Sequence, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from tandem.data.split import RestSplit

__all__ = ["DistributedSampler"]

logger = logging.getLogger(__name__)

# Note [resume position]
# ~~~~~~~~~~~~~~~~~~~~~~
# ``start`` counts positions of the epoch's global order that the whole job has
# already consumed (all ranks together). What is left, ``order[start:]``, is
# split exactly as a whole epoch is: without drop_last it is padded to a
# multiple of the world size R with samples taken from the START of the epoch's
# order (cycling through the order if more are needed than it holds); with
# drop_last it is cut down to a multiple of R. Rank r then takes every R-th
# position from r.
#
# Why the padding comes from the start of the order and not from the start of
# what is left: at an unchanged R and a start that is a multiple of R, the
# remaining length n - start needs the same padding as n does, and the
# uninterrupted run padded with order[0], order[1], ... too. So the resumed
# global order is exactly the uninterrupted one minus its first ``start``
# positions, and rank r yields what it would have yielded after its first
# start / R samples: a resumed run is bit-identical to one that never stopped.
# At a different R every sample not yet consumed is still yielded exactly once,
# plus fewer than R padding samples (or, with drop_last, fewer than R dropped).
# That is the split for a loop that only knows a sampler: every rank gets as
# many samples, so none waits in a collective for a batch that never comes.
# tandem's own loaders split the rest after an elastic world change exactly
# instead (``exact=True``: no padding, Note [exact split] in split.py), and make
# up for the uneven shares themselves.


def _epoch_order(size: int, *, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The epoch's global order of dataset indices, before padding."""
    if not shuffle:
        return list(range(size))
    # The same generator and seed arithmetic as torch's sampler, so orders match.
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(size, generator=generator).tolist()


def _remaining_length(size: int, start: int, num_replicas: int, drop_last: bool,
                      exact: bool = False) -> int:
    """How many positions are left after ``start``, padded or cut to a multiple of
    ``num_replicas`` (see Note [resume position]); with ``exact``, never padded."""
    left = size - start
    if drop_last:
        return left - left % num_replicas
    if exact:
        return left
    return left + (-left) % num_replicas


def _remaining_positions(order: Sequence[int], start: int, num_replicas: int,
                         drop_last: bool, exact: bool = False) -> list[int]:
    """The rest of the epoch's global order after ``start``, padded or cut to a
    multiple of ``num_replicas`` (see Note [resume position]), or with ``exact``
    only cut (Note [exact split] in split.py)."""
    remaining = list(order[start:])
    total = _remaining_length(len(order), start, num_replicas, drop_last, exact)
    if total <= len(remaining):
        return remaining[:total]
    # Padding is only needed when something is left, so ``order`` is not empty here.
    padding = total - len(remaining)
    return remaining + list(itertools.islice(itertools.cycle(order), padding))


def _as_int(name: str, value: Any) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"DistributedSampler: {name} must be an int, got {value!r} "
                        f"of type {type(value).__name__}") from None


# Resuming: Note [resume position] above.
class DistributedSampler(Sampler[int]):
    """Give each rank its own share of a dataset, every sample once per epoch.

    Each epoch, the global order (``torch.randperm`` seeded with ``seed + epoch``
    when ``shuffle``, else the dataset order) is padded by repeating samples from
    its start until its length is a multiple of ``num_replicas`` or, with
    ``drop_last``, cut down to the largest multiple. Rank ``r`` yields positions
    ``r, r + num_replicas, r + 2 * num_replicas, ...``, so every rank yields the
    same number of samples. This equals
    :class:`torch.utils.data.distributed.DistributedSampler` index for index.

    Beyond torch's sampler, ``set_epoch(epoch, start)`` resumes an epoch after
    the first ``start`` samples the whole job consumed, and ``state_dict()`` /
    ``load_state_dict()`` carry that position in a checkpoint. At the same world
    size the resumed ranks yield exactly what the uninterrupted run would have;
    at another world size the samples not yet consumed are split over the new
    ranks as a whole epoch is: each yielded once, and fewer than
    ``num_replicas`` repeated as padding (or, with ``drop_last``, left out).

    Warning:
        Call :meth:`set_epoch` at the start of every epoch, before iterating the
        :class:`~torch.utils.data.DataLoader`. Without it the epoch stays 0 and
        every epoch sees the same order::

            sampler = DistributedSampler(dataset)
            loader = DataLoader(dataset, batch_size=32, sampler=sampler)
            for epoch in range(start_epoch, num_epochs):
                sampler.set_epoch(epoch)
                for batch in loader:
                    ...

    Args:
        dataset: a dataset with ``__len__``; its length is read once, here.
        num_replicas: number of ranks sharing the dataset. Default: the world
            size of the default process group if torch.distributed is
            initialised, else 1.
        rank: this rank's index in ``[0, num_replicas)``. Default: the rank in
            the default process group if torch.distributed is initialised,
            else 0.
        shuffle: permute the dataset each epoch (seeded, the same on all ranks).
        seed: base of the permutation's seed; must be the same on all ranks.
        drop_last: drop the tail that would not divide evenly instead of padding.

    Raises:
        TypeError: ``dataset`` has no length, or an argument is not an int.
        ValueError: ``num_replicas < 1``, ``rank`` outside ``[0, num_replicas)``,
            or an empty dataset with ``drop_last``.
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        self.dataset = dataset
        self._dataset_size = _dataset_length(dataset)
        self._num_replicas, self._rank = _resolve_replicas(num_replicas, rank)
        self._shuffle = bool(shuffle)
        self._seed = _as_int("seed", seed)
        self._drop_last = bool(drop_last)
        if self._drop_last and self._dataset_size == 0:
            raise ValueError(
                "DistributedSampler: the dataset is empty and drop_last=True, so every rank "
                "would yield nothing; check the dataset (len(dataset) == 0)")
        self._epoch = 0
        self._start = 0
        self._exact = False
        logger.debug("DistributedSampler: rank %d of %d, %d samples, shuffle=%s, seed=%d, "
                     "drop_last=%s", self._rank, self._num_replicas, self._dataset_size,
                     self._shuffle, self._seed, self._drop_last)

    @property
    def epoch(self) -> int:
        """The epoch whose order is yielded (set by :meth:`set_epoch`)."""
        return self._epoch

    @property
    def start(self) -> int:
        """Positions of this epoch's global order already consumed by the whole
        job before this iteration (all ranks together; set by :meth:`set_epoch`)."""
        return self._start

    @property
    def exact(self) -> bool:
        """Whether the rest of this epoch is split without padding: set by
        :meth:`set_epoch`."""
        return self._exact  # Note [exact split] in tandem/data/split.py

    @property
    def num_replicas(self) -> int:
        """Number of ranks sharing the dataset."""
        return self._num_replicas

    @property
    def rank(self) -> int:
        """This rank's index in ``[0, num_replicas)``."""
        return self._rank

    @property
    def dataset_size(self) -> int:
        """``len(dataset)``, read at construction."""
        return self._dataset_size

    @property
    def shuffle(self) -> bool:
        """Whether each epoch permutes the dataset."""
        return self._shuffle

    @property
    def seed(self) -> int:
        """Base seed of the permutation (epoch ``e`` uses ``seed + e``)."""
        return self._seed

    @property
    def drop_last(self) -> bool:
        """Whether the uneven tail is dropped rather than padded."""
        return self._drop_last

    def set_epoch(self, epoch: int, start: int = 0, *, exact: bool = False) -> None:
        """Choose the epoch to yield and, to resume it, how much of it is done.

        Args:
            epoch: the epoch number; with ``shuffle`` it seeds the order
                (``seed + epoch``), so each epoch gets a different order.
            start: how many samples of this epoch the whole job (all ranks
                together) has already consumed, counted as positions of the
                epoch's global order. 0 for a fresh epoch. At the same world
                size use a multiple of ``num_replicas`` (``steps * batch_size *
                num_replicas``) to continue exactly where the job stopped.
            exact: split the rest without padding: every sample left is
                yielded once and none twice, but the ranks' shares differ by up
                to one sample.
                For tandem's loaders after an elastic world change, which give
                a rank left short an empty batch and weigh the uneven ones.

        Warning:
            With ``exact``, a plain DataLoader over this sampler may
            give one rank a batch fewer than another, and DDP then waits for it
            forever; iterate it through :class:`tandem.data.DistributedLoader`
            or the Trainer, which keep the ranks' batch counts equal.

        Raises:
            ValueError: ``start`` is negative or larger than the dataset.
        """
        # exact: Note [exact split] in tandem/data/split.py.
        epoch = _as_int("epoch", epoch)
        start = _as_int("start", start)
        if not 0 <= start <= self._dataset_size:
            raise ValueError(
                f"DistributedSampler (rank {self._rank}): start={start} is outside "
                f"[0, {self._dataset_size}] for a dataset of {self._dataset_size} samples; "
                "pass the number of samples of this epoch already consumed by all ranks "
                "together, or start the next epoch with set_epoch(epoch + 1) if it is finished")
        self._epoch = epoch
        self._start = start
        self._exact = bool(exact)
        if start:
            logger.info("DistributedSampler (rank %d of %d): resuming epoch %d after %d of %d "
                        "samples%s", self._rank, self._num_replicas, epoch, start,
                        self._dataset_size, ", split exactly" if exact else "")

    def __iter__(self) -> Iterator[int]:
        size = _dataset_length(self.dataset)
        if size != self._dataset_size:
            raise RuntimeError(
                f"DistributedSampler (rank {self._rank}): the dataset had {self._dataset_size} "
                f"samples at construction and has {size} now; build a new sampler after "
                "changing the dataset")
        order = _epoch_order(size, shuffle=self._shuffle, seed=self._seed, epoch=self._epoch)
        positions = _remaining_positions(order, self._start, self._num_replicas, self._drop_last,
                                         self._exact)
        return iter(positions[self._rank::self._num_replicas])

    def __len__(self) -> int:
        """Number of samples this rank yields for the current epoch and start."""
        return len(range(self._rank, self._total(), self._num_replicas))

    def _total(self) -> int:
        """Positions the ranks yield together, from :attr:`start`."""
        return _remaining_length(self._dataset_size, self._start, self._num_replicas, self._drop_last,
                                 self._exact)

    def split(self, batch_size: int, drop_last: bool = False) -> RestSplit:
        """What the ranks yield from :attr:`start`, cut into global batches of
        ``batch_size`` per rank.

        Args:
            batch_size: samples per rank per batch.
            drop_last: a DataLoader's ``drop_last``: a last global batch that is
                not full is dropped on every rank.
        """
        # Note [exact split] in tandem/data/split.py.
        return RestSplit(start=self._start, length=self._total(), world=self._num_replicas,
                         batch_size=batch_size, drop_last=drop_last)

    def state_dict(self) -> dict[str, Any]:
        """Where this sampler stands, for a checkpoint: ``epoch``, ``start``, and
        what fixes the order (``seed``, ``shuffle``, ``dataset_size``).

        ``start`` is what :meth:`set_epoch` was given; it does not advance while
        iterating (a DataLoader's workers read ahead, so only the training loop
        knows what was consumed): save ``dict(sampler.state_dict(), start=done)``
        where ``done`` is ``sampler.start`` plus the samples all ranks consumed since.
        """
        return {"epoch": self._epoch, "start": self._start, "seed": self._seed,
                "shuffle": self._shuffle, "dataset_size": self._dataset_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the same epoch, after ``start`` samples.

        The world size may differ from the saving job's: the samples not yet
        consumed are then split over this sampler's ranks as a whole epoch is
        (padded or, with ``drop_last``, cut to a multiple of ``num_replicas``).

        Args:
            state: a dict from :meth:`state_dict`.

        Raises:
            ValueError: a key is missing, or ``shuffle``, ``seed`` (when
                shuffling) or the dataset size differ from this sampler's, so
                the saved position would point into a different order.
        """
        missing = [k for k in ("epoch", "start", "seed", "shuffle", "dataset_size") if k not in state]
        if missing:
            raise ValueError(f"DistributedSampler.load_state_dict: the state has no {missing}; "
                             "pass a dict made by DistributedSampler.state_dict()")
        differences = []
        if bool(state["shuffle"]) != self._shuffle:
            differences.append(f"shuffle={state['shuffle']} was saved, this sampler has "
                               f"shuffle={self._shuffle}")
        # The seed only shapes the order when shuffling.
        if self._shuffle and state["seed"] != self._seed:
            differences.append(f"seed={state['seed']} was saved, this sampler has seed={self._seed}")
        if state["dataset_size"] != self._dataset_size:
            differences.append(f"a dataset of {state['dataset_size']} samples was saved, this "
                               f"sampler has {self._dataset_size}")
        if differences:
            raise ValueError(
                f"DistributedSampler (rank {self._rank}): cannot resume, the saved order differs: "
                + "; ".join(differences)
                + ". Build the sampler with the saved settings to resume this epoch")
        self.set_epoch(state["epoch"], state["start"])


def _dataset_length(dataset: Any) -> int:
    try:
        return len(dataset)
    except TypeError:
        raise TypeError(f"DistributedSampler needs a dataset with a length; "
                        f"{type(dataset).__name__} has no __len__") from None


def _resolve_replicas(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """``num_replicas`` and ``rank``, defaulting to the default process group, or to
    a world of one when torch.distributed is not initialised."""
    initialised = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    num_replicas = _as_int("num_replicas", num_replicas)
    rank = _as_int("rank", rank)
    if num_replicas < 1:
        raise ValueError(f"DistributedSampler: num_replicas={num_replicas}, it must be at least 1 "
                         "(the number of ranks sharing the dataset)")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"DistributedSampler: rank={rank} is outside [0, {num_replicas - 1}] "
                         f"for num_replicas={num_replicas}; pass this process's rank among the "
                         "ranks sharing the dataset")
    return num_replicas, rank
