"""Pure shard arithmetic: which part of each DDP bucket a rank owns under ZeRO.

Each bucket's slice of the flat buffer is padded to a multiple of the world size
(Note [flat buffer layout] in tandem/ddp/plan.py), so it splits into equal,
contiguous per-rank shards: rank r owns elements ``[r * s, (r + 1) * s)`` of the
bucket, ``s = padded_numel // world``. A reduce-scatter of the bucket leaves
exactly that shard's averaged gradients on rank r. A shard cuts across
parameters; its pieces say which elements of which parameter it holds, which is
what an optimizer needs to step, and what a checkpoint needs to reassemble full
tensors at another world size.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tandem.ddp.plan import BucketSpec

__all__ = ["BucketShard", "ShardPiece", "ShardRun", "plan_runs", "shard_bucket"]


@dataclass(frozen=True)
class ShardPiece:
    """Elements ``[param_start, param_start + length)`` of parameter ``param``
    (flattened), stored at ``shard_offset`` in the shard."""

    param: int
    param_start: int
    length: int
    shard_offset: int


@dataclass(frozen=True)
class BucketShard:
    """Rank ``rank``'s shard of bucket ``bucket``: elements ``[start, start + length)``
    of the bucket's padded slice."""

    bucket: int
    rank: int
    start: int
    length: int
    pieces: tuple[ShardPiece, ...]

    @property
    def padding(self) -> int:
        """Elements of the shard that belong to no parameter (the bucket's padding)."""
        return self.length - sum(p.length for p in self.pieces)


def shard_bucket(spec: BucketSpec, world_size: int) -> list[BucketShard]:
    """Split one bucket into ``world_size`` equal shards, one per rank.

    Raises:
        ValueError: the bucket's padded size is not a multiple of ``world_size``
            (it was planned for another world size).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if spec.padded_numel % world_size:
        raise ValueError(
            f"bucket {spec.index} holds {spec.padded_numel} elements, not a multiple of "
            f"world_size={world_size}; plan the buckets with pad_to={world_size}")
    size = spec.padded_numel // world_size
    shards = []
    for rank in range(world_size):
        lo, hi = rank * size, (rank + 1) * size
        pieces = []
        for param, offset in zip(spec.params, spec.offsets):
            numel = _param_numel(spec, param, offset)
            start, end = max(lo, offset), min(hi, offset + numel)
            if start < end:
                pieces.append(ShardPiece(param=param, param_start=start - offset,
                                         length=end - start, shard_offset=start - lo))
        shards.append(BucketShard(bucket=spec.index, rank=rank, start=lo, length=size,
                                  pieces=tuple(pieces)))
    return shards


def _param_numel(spec: BucketSpec, param: int, offset: int) -> int:
    k = spec.params.index(param)
    end = spec.offsets[k + 1] if k + 1 < len(spec.offsets) else spec.numel
    return end - offset


@dataclass(frozen=True)
class ShardRun:
    """Elements ``[start, start + length)`` of this rank's shard of ``bucket``,
    all in param group ``group``: what a sharded optimizer steps as one flat
    tensor (Note [shard runs] in optimizer.py)."""

    bucket: int
    group: int
    start: int
    length: int
    pieces: tuple[ShardPiece, ...]


def plan_runs(specs: Iterable[BucketSpec], world_size: int, rank: int,
              group_of: dict[int, int]) -> list[ShardRun]:
    """Split ``rank``'s shard of every bucket into runs (Note [shard runs] in optimizer.py).

    Args:
        specs: the DDP bucket plan's buckets.
        world_size, rank: whose shard.
        group_of: parameter index -> param group; parameters absent from it are
            not optimized (their elements belong to no run).
    """
    runs = []
    for spec in specs:
        current: list[ShardPiece] = []
        for piece in shard_bucket(spec, world_size)[rank].pieces:
            group = group_of.get(piece.param)
            if current and (group != group_of.get(current[-1].param) or
                            piece.shard_offset != current[-1].shard_offset + current[-1].length):
                runs.append(_run(spec.index, group_of, current))
                current = []
            if group is not None:
                current.append(piece)
        if current:
            runs.append(_run(spec.index, group_of, current))
    return runs


def _run(bucket: int, group_of: dict[int, int], pieces: list[ShardPiece]) -> ShardRun:
    start = pieces[0].shard_offset
    end = pieces[-1].shard_offset + pieces[-1].length
    return ShardRun(bucket, group_of[pieces[0].param], start, end - start, tuple(pieces))
