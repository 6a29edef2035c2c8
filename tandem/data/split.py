"""How the rest of an epoch is cut into global batches over the ranks
(:class:`RestSplit`): pure arithmetic of sizes, no data and no process group.

# Note [exact split]
A fresh epoch is split as torch's sampler splits it: padded with samples from
the start of its order to a multiple of the world size R, so that every rank
gets as many samples (Note [resume position] in sampler.py). After an elastic
world change in the middle of an epoch that padding would repeat up to R - 1
samples: the rest ``order[start:]`` rarely divides by the new R. So a rest split
after a world change is exact instead (``DistributedSampler.set_epoch(...,
exact=True)``): nothing is padded, rank r takes positions ``start + r, start + r
+ R, ...`` of the order, and the ranks' shares differ by at most one sample.

DDP needs every rank in every step, so the ranks must still have the same number
of batches. With batch size B, global batch k is positions ``[start + k*R*B,
start + (k+1)*R*B)`` of the order (the sampler's interleaving puts rank r's k-th
batch there); every global batch but the last is full (B on every rank), and the
last holds ``m`` samples, rank r ``ceil((m - r) / R)`` of them. A rank with none
(``m <= r``, only when m < R) takes part with an empty batch: the tensors of a
collated sample with no rows, whose gradient is zero (``empty_batch`` in
batches.py). No sample is trained twice, and none is left out.

In the last global batch the ranks' batch sizes differ, so DDP's plain mean of
the ranks' gradients is no longer the gradient of the mean loss over the global
batch. Rank r's gradient g_r is that of its own mean loss over n_r samples; the
global batch's is ``sum_r (n_r / N) g_r`` with N = sum_r n_r. So rank r's
gradient counts ``w_r = n_r * R / N`` times before DDP divides by R
(:meth:`RestSplit.weight`; 1.0 exactly where the sizes are equal, so every other
batch, and every batch of a padded split, is unchanged bit for bit). The weights
of a global batch sum to R; an empty rank's is 0. They assume the loss is a
mean over the batch (the Trainer's contract, and what DDP's mean is right for):
with a sum loss DDP's mean is already ``1/R`` times the global sum's gradient,
whatever the sizes, and the weights would skew it.

Global batches are the unit, not optimizer steps: with gradient accumulation
each micro-batch is weighed in its own global batch, so a step over k
micro-batches is the mean of k global batches' gradients, as one process that
accumulates the same global batches computes it.

A split without ``exact`` is the same arithmetic over the padded rest, whose
length divides by R: every rank has the same count in every global batch, and
every weight is 1.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RestSplit"]


@dataclass(frozen=True)
class RestSplit:
    """The rest of an epoch, cut into global batches of ``world * batch_size``
    positions (Note [exact split]).

    Positions count from ``start`` in the epoch's order (padded where the
    sampler pads); global batch k covers ``[start + k*world*batch_size, ...)``.
    """

    start: int
    """Positions of the epoch's order consumed before this split."""
    length: int
    """Positions the split covers after ``start``, all ranks together."""
    world: int
    """Ranks sharing the split."""
    batch_size: int
    """Samples per rank per batch (a rank's last batch may hold fewer)."""
    drop_last: bool = False
    """Drop a last global batch of fewer than ``world * batch_size`` samples."""

    def __post_init__(self) -> None:
        for name in ("start", "length"):
            if getattr(self, name) < 0:
                raise ValueError(f"RestSplit: {name}={getattr(self, name)}, it must be at least 0")
        for name in ("world", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"RestSplit: {name}={getattr(self, name)}, it must be at least 1")

    @property
    def global_batch(self) -> int:
        """Samples of a full global batch."""
        return self.world * self.batch_size

    @property
    def num_batches(self) -> int:
        """Batches of every rank (the same on all ranks)."""
        full, tail = divmod(self.length, self.global_batch)
        return full + int(tail > 0 and not self.drop_last)

    @property
    def end(self) -> int:
        """The position after the last one trained: where the epoch ends."""
        return self.consumed_after(self.num_batches)

    def size_of(self, k: int) -> int:
        """Samples of global batch ``k``, all ranks together."""
        self._check_batch(k)
        return min(self.global_batch, self.length - k * self.global_batch)

    def counts(self, k: int) -> list[int]:
        """Samples of each rank in global batch ``k``."""
        return [self.count(rank, k) for rank in range(self.world)]

    def count(self, rank: int, k: int) -> int:
        """Samples of ``rank`` in global batch ``k``: every ``world``-th position from ``rank``."""
        size = self.size_of(k)
        return max(0, -(-(size - rank) // self.world))

    def weight(self, rank: int, k: int) -> float:
        """How many times ``rank``'s gradient of global batch ``k`` counts in DDP's
        mean over the ranks: ``n_rank * world / N`` (Note [exact split])."""
        return self.count(rank, k) * self.world / self.size_of(k)

    def positions(self, rank: int, k: int) -> range:
        """The positions (in the epoch's order) of ``rank``'s batch ``k``."""
        first = self.start + k * self.global_batch
        return range(first + rank, first + self.size_of(k), self.world)

    def consumed_after(self, batches: int) -> int:
        """The position reached once ``batches`` global batches are trained."""
        return self.start + min(batches * self.global_batch, self.length)

    def _check_batch(self, k: int) -> None:
        if not 0 <= k < self.num_batches:
            raise IndexError(f"RestSplit: global batch {k} is outside [0, {self.num_batches}) "
                             f"({self.length} positions in batches of {self.global_batch})")
