"""Metrics over every rank of a process group: sums, means, token-weighted means,
and per-sample results gathered back into the dataset's order.

Every helper takes an optional ``group`` (default: the default group) and must be
called by every rank of it, the same number of times and in the same order: each
issues collectives. Without torch.distributed initialised, or in a group of one,
they return the local result and issue nothing, so the same evaluation code runs
in one process and in many.

Validation that depends on what other ranks hold (counts, shapes, the total
weight) happens after the collective that tells every rank, so a bad input
raises the same ValueError on every rank instead of leaving some ranks waiting
in a collective that others never join.
"""

from __future__ import annotations

import logging
import numbers
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import torch
import torch.distributed as dist

from tandem.comm.group import GroupComm

__all__ = ["RunningMean", "all_reduce_mean", "all_reduce_sum", "gather_samples", "weighted_mean"]

logger = logging.getLogger(__name__)

Number = Union[int, float]
# One tensor, or a tuple, list or dict of them, each with one row per sample.
Samples = Union[torch.Tensor, Sequence[torch.Tensor], Mapping[Any, torch.Tensor]]


def _group_comm(group: dist.ProcessGroup | None) -> GroupComm | None:
    """The collectives of ``group``, or None when there is nobody to talk to
    (torch.distributed not initialised, or a group of one)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    comm = GroupComm(group)
    if comm.rank < 0:
        raise ValueError(f"rank {dist.get_rank()} is not a member of the process group it was "
                         "given; call metrics only on ranks of that group")
    return comm if comm.size > 1 else None


def _sum_tensor(value: torch.Tensor, comm: GroupComm | None, tag: str) -> torch.Tensor:
    """A new tensor holding the sum of ``value`` over ranks, on ``value``'s device."""
    local = value.detach()
    if local.dtype == torch.bool:
        local = local.long()          # count, as torch.sum does
    if comm is None:
        return local.clone()
    # A fresh contiguous buffer on the backend's device: the input stays untouched,
    # and a CPU metric still works under nccl.
    buffer = torch.empty(local.shape, dtype=local.dtype, device=comm.device)
    buffer.copy_(local)
    comm.all_reduce(buffer, tag=tag)
    return buffer.to(value.device)


def _sum_number(value: Number, comm: GroupComm | None, tag: str) -> Number:
    if isinstance(value, numbers.Integral):
        if comm is None:
            return int(value)
        buffer = torch.tensor([int(value)], dtype=torch.int64, device=comm.device)
        comm.all_reduce(buffer, tag=tag)
        return int(buffer.item())
    if comm is None:
        return float(value)
    buffer = torch.tensor([float(value)], dtype=torch.float64, device=comm.device)
    comm.all_reduce(buffer, tag=tag)
    return float(buffer.item())


def _check_reducible(value: Any, name: str) -> None:
    if not isinstance(value, (torch.Tensor, numbers.Real)):
        raise TypeError(f"{name} takes a tensor or a Python number, got {type(value).__name__}")


def all_reduce_sum(value: torch.Tensor | Number, group: dist.ProcessGroup | None = None
                   ) -> torch.Tensor | Number:
    """The sum of ``value`` over the ranks of ``group``, on every rank.

    Args:
        value: a tensor (any shape, the same on every rank) or a Python number.
        group: the process group; default: the default group.

    Returns:
        For a tensor, a new detached tensor of the same shape, dtype and device
        (bool tensors are counted and give int64, as with ``torch.sum``); the
        input is not modified. For a number, an int if it is an int, else a float.

    Raises:
        TypeError: ``value`` is neither a tensor nor a real number.
    """
    _check_reducible(value, "all_reduce_sum")
    comm = _group_comm(group)
    if isinstance(value, torch.Tensor):
        return _sum_tensor(value, comm, "all_reduce_sum")
    return _sum_number(value, comm, "all_reduce_sum")


def all_reduce_mean(value: torch.Tensor | Number, group: dist.ProcessGroup | None = None
                    ) -> torch.Tensor | float:
    """The mean of ``value`` over the ranks of ``group`` (every rank weighing the
    same), on every rank. For ranks holding different numbers of samples, use
    :func:`weighted_mean` or :class:`RunningMean` instead.

    Args:
        value: a tensor (any shape, the same on every rank) or a Python number.
        group: the process group; default: the default group.

    Returns:
        For a tensor, a new detached tensor of the same shape and device; a
        floating or complex dtype is kept, integer and bool tensors give torch's
        default float dtype (as ``tensor / n`` does). For a number, a float.

    Raises:
        TypeError: ``value`` is neither a tensor nor a real number.
    """
    _check_reducible(value, "all_reduce_mean")
    comm = _group_comm(group)
    size = 1 if comm is None else comm.size
    if isinstance(value, torch.Tensor):
        return torch.true_divide(_sum_tensor(value, comm, "all_reduce_mean"), size)
    # Integers are summed exactly and divided once.
    return _sum_number(value, comm, "all_reduce_mean") / size


def _as_float64(value: torch.Tensor | Number, name: str, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"weighted_mean: {name} must hold one number, got a tensor of shape "
                             f"{tuple(value.shape)}; reduce it first (e.g. .sum())")
        return value.detach().reshape(()).to(device=device, dtype=torch.float64)
    if not isinstance(value, numbers.Real):
        raise TypeError(f"weighted_mean: {name} must be a tensor or a real number, got "
                        f"{type(value).__name__}")
    return torch.tensor(float(value), dtype=torch.float64, device=device)


def weighted_mean(total: torch.Tensor | Number, weight: torch.Tensor | Number,
                  group: dist.ProcessGroup | None = None) -> float:
    """Sum of ``total`` over ranks divided by the sum of ``weight`` over ranks.

    This is the mean over all samples (or tokens) of the job when each rank
    passes the sum of its values and how many it has: ranks that see more tokens
    count for more, unlike :func:`all_reduce_mean` of per-rank means. One
    all-reduce of two float64 numbers.

    Args:
        total: this rank's sum of values (a number or a one-element tensor).
        weight: this rank's count or weight (a number or a one-element tensor);
            0 for a rank that saw nothing.
        group: the process group; default: the default group.

    Returns:
        The weighted mean, the same float on every rank.

    Raises:
        TypeError, ValueError: ``total`` or ``weight`` is not one number (on
            the rank that passed it, before any collective).
        ValueError: the weights sum to zero (or less) over all ranks; raised on
            every rank, since all of them know the sum.
    """
    comm = _group_comm(group)
    device = torch.device("cpu") if comm is None else comm.device
    pair = torch.stack([_as_float64(total, "total", device), _as_float64(weight, "weight", device)])
    if comm is not None:
        comm.all_reduce(pair, tag="weighted_mean")
    total_sum, weight_sum = pair.tolist()
    if not weight_sum > 0:
        ranks = 1 if comm is None else comm.size
        rank = 0 if comm is None else comm.rank
        raise ValueError(
            f"weighted_mean (rank {rank}): the weights sum to {weight_sum} over {ranks} rank(s), "
            "so there is no mean; pass each rank's sample or token count as weight, and call it "
            "only after some rank has seen data")
    return total_sum / weight_sum


class RunningMean:
    """A weighted mean accumulated locally over many steps and reduced across
    ranks once, when asked: epoch losses and evaluation metrics.

    ``update`` does no communication and, for tensors, no host-device sync (it
    keeps a float64 tensor on the value's device); ``compute`` issues one
    all-reduce and must be called on every rank of the group::

        loss_mean = RunningMean()
        for batch in loader:
            loss = model(batch).mean()
            loss_mean.update(loss, weight=len(batch))
        epoch_loss = loss_mean.compute()   # the mean over every sample of every rank

    Args:
        group: the process group to reduce over; default: the default group.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._total: torch.Tensor | float = 0.0
        self._weight: torch.Tensor | float = 0.0

    def update(self, value: torch.Tensor | Number, weight: torch.Tensor | Number = 1) -> None:
        """Add ``value`` with ``weight``, on this rank only.

        Args:
            value: a mean over ``weight`` samples (a number or one-element tensor;
                a tensor is detached).
            weight: how many samples (or tokens) ``value`` stands for. An
                update with weight 0 (an empty batch, whose mean is NaN) adds
                nothing.

        Raises:
            TypeError, ValueError: ``value`` or ``weight`` is not one number, or
                a number ``weight`` is negative.
        """
        if isinstance(weight, numbers.Real) and weight < 0:
            raise ValueError(f"RunningMean.update: weight={weight} is negative; pass the number "
                             "of samples or tokens that value averages over")
        value = self._scalar(value, "value")
        weight = self._scalar(weight, "weight")
        # An empty batch has a NaN mean and weight 0: it must add nothing. A tensor
        # weight is tested on its device, so that update never syncs.
        contribution: torch.Tensor | float
        if isinstance(weight, torch.Tensor):
            contribution = torch.where(weight == 0, 0.0, value * weight)
        elif weight == 0:
            return
        else:
            contribution = value * weight
        self._total = self._total + contribution
        self._weight = self._weight + weight

    @staticmethod
    def _scalar(x: torch.Tensor | Number, name: str) -> torch.Tensor | float:
        if isinstance(x, torch.Tensor):
            if x.numel() != 1:
                raise ValueError(f"RunningMean.update: {name} must hold one number, got a tensor "
                                 f"of shape {tuple(x.shape)}; pass its mean with weight=its numel")
            # float64 so that an epoch of small updates does not drift.
            return x.detach().reshape(()).to(torch.float64)
        if not isinstance(x, numbers.Real):
            raise TypeError(f"RunningMean.update: {name} must be a tensor or a real number, got "
                            f"{type(x).__name__}")
        return float(x)

    def compute(self) -> float:
        """The weighted mean of every update on every rank since the last reset.

        Returns:
            The same float on every rank.

        Raises:
            ValueError: no rank has added any weight (on every rank).
        """
        return weighted_mean(self._total, self._weight, self.group)

    def reset(self) -> None:
        """Forget every update on this rank (call it on every rank)."""
        self._total = 0.0
        self._weight = 0.0


def _flatten(values: Samples) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Samples]]:
    """The tensors of ``values`` and a function that puts results back in its shape."""
    if isinstance(values, torch.Tensor):
        return [values], lambda xs: xs[0]
    if isinstance(values, Mapping):
        keys = list(values)
        names, tensors = keys, [values[k] for k in keys]

        def rebuild(xs: list[torch.Tensor]) -> Samples:
            return dict(zip(keys, xs))
    elif isinstance(values, (tuple, list)):
        kind = type(values)
        names, tensors = list(range(len(values))), list(values)

        def rebuild(xs: list[torch.Tensor]) -> Samples:
            # A namedtuple takes its fields as arguments, not one iterable.
            return kind(*xs) if hasattr(kind, "_fields") else kind(xs)
    else:
        raise TypeError("gather_samples takes a tensor, or a tuple, list or dict of tensors; "
                        f"got {type(values).__name__}")
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"gather_samples: element {name!r} is a {type(t).__name__}, not a tensor")
    return tensors, rebuild


def _share_of(values: Samples, tensors: list[torch.Tensor], num_samples: int) -> dict[str, Any]:
    """What every rank must agree on before anything is gathered."""
    structure: tuple[str, Any]
    if isinstance(values, Mapping):
        structure = ("dict", tuple(repr(k) for k in values))
    else:
        structure = (type(values).__name__, len(tensors))
    return {"structure": structure, "num_samples": num_samples,
            "rows": [t.shape[0] if t.dim() else None for t in tensors],
            "tails": [(tuple(t.shape[1:]), str(t.dtype)) for t in tensors]}


def _check_shares(shares: list[dict[str, Any]], rank: int) -> int:
    """Raise the same ValueError on every rank unless the ranks hold equal shares
    of one sampler's epoch; return the rows per rank."""
    world = len(shares)

    def per_rank(key: str) -> str:
        return ", ".join(f"rank {r}: {s[key]}" for r, s in enumerate(shares))

    prefix = f"gather_samples (rank {rank} of {world})"
    for key, what in (("structure", "the same kind of values"), ("num_samples", "the same num_samples"),
                      ("tails", "tensors of the same trailing shapes and dtypes")):
        if any(s[key] != shares[0][key] for s in shares):
            raise ValueError(f"{prefix}: every rank must pass {what}; got {per_rank(key)}")
    for r, share in enumerate(shares):
        if None in share["rows"] or len(set(share["rows"])) > 1:
            raise ValueError(f"{prefix}: rank {r}'s tensors must all have one row per sample "
                             f"(the same first dimension); their first dimensions are "
                             f"{share['rows']}")
    counts = [s["rows"][0] if s["rows"] else 0 for s in shares]
    if len(set(counts)) > 1:
        raise ValueError(
            f"{prefix}: ranks hold different numbers of samples ("
            + ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
            + "); gather_samples expects the equal shares a DistributedSampler gives, so pass "
            "each rank's results for a whole epoch of its DistributedSampler (start=0)")
    num_samples = shares[0]["num_samples"]
    held = counts[0] * world
    # A sampler pads (or with drop_last drops) fewer than `world` samples.
    if num_samples < 0 or abs(held - num_samples) >= world:
        raise ValueError(
            f"{prefix}: num_samples={num_samples}, but the ranks hold {counts[0]} samples each, "
            f"{held} in all; a DistributedSampler over {world} ranks pads or drops fewer than "
            f"{world}. Pass len(dataset) as num_samples")
    return counts[0]


def gather_samples(values: Samples, num_samples: int,
                   group: dist.ProcessGroup | None = None) -> Samples:
    """Every rank's per-sample results, in the sampler's global order, on every rank.

    Evaluation over a :class:`~tandem.data.DistributedSampler` leaves each rank
    with the results of its share, padding duplicates included. This undoes the
    split: rank ``r``'s ``k``-th row came from global position ``k * R + r``, so
    the rows are gathered, interleaved back into that order and cut to
    ``num_samples``, which drops the padding. With ``shuffle=False`` the result
    is in dataset order; with ``shuffle=True`` it follows the epoch's
    permutation. Either way a metric over it counts each sample once.

    Args:
        values: this rank's results in the order its sampler yielded them (a
            whole epoch, sampler ``start`` 0): a tensor, or a tuple, list or
            dict of tensors, each with one row per sample.
        num_samples: the dataset's length.
        group: the process group; default: the default group.

    Returns:
        The same kind of value as ``values``, each tensor holding ``num_samples``
        rows (fewer under ``drop_last``), on the input's device.

    Raises:
        TypeError: ``values`` is not a tensor or a container of tensors (on the
            rank that passed it, before any collective).
        ValueError: on every rank, when the ranks' row counts, trailing shapes,
            dtypes, kinds of container or ``num_samples`` differ, or do not fit
            a DistributedSampler's split of ``num_samples`` samples.
    """
    tensors, rebuild = _flatten(values)
    num_samples = operator.index(num_samples)
    share = _share_of(values, tensors, num_samples)
    comm = _group_comm(group)
    shares = [share] if comm is None else comm.all_gather_object(share, tag="gather_samples")
    rows = _check_shares(shares, 0 if comm is None else comm.rank)
    world = len(shares)
    logger.debug("gather_samples: %d ranks x %d rows -> %d samples, %d tensor(s)",
                 world, rows, min(rows * world, num_samples), len(tensors))
    return rebuild([_gather_rows(t, comm)[:num_samples] for t in tensors])


def _gather_rows(tensor: torch.Tensor, comm: GroupComm | None) -> torch.Tensor:
    """All ranks' rows of ``tensor`` in global order: row k of rank r at k * R + r."""
    local = tensor.detach()
    if comm is None:
        return local
    buffer = local.to(comm.device).contiguous()
    parts = comm.all_gather(buffer, tag="gather_samples")
    # [R, m, ...] stacked on dim 1 is [m, R, ...]: row-major reading interleaves ranks.
    rows = local.shape[0] * len(parts)
    return torch.stack(parts, dim=1).reshape(rows, *local.shape[1:]).to(tensor.device)
