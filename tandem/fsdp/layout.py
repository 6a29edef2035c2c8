"""Pure shard arithmetic of fully_shard: where each parameter's dim-0 chunk sits
in a unit's flat buffers.

Nothing here touches a process group or a tensor's storage; the layout is a
function of shapes and the world size, tested with grids in one process.

# Note [unit buffers]
A unit (one ``fully_shard`` call) owns three flat buffers:

- the *shard* buffer, ``shard_numel`` elements on every rank: rank r's dim-0
  chunk of each parameter (``torch.chunk`` rows: ``ceil(rows / world)`` per
  rank, the last ranks possibly shorter or empty), each padded to the full
  chunk size, back to back in parameter order. The sharded parameters
  (DTensors, ``Shard(0)``) are views of it, so the optimizer steps it in place,
  and it is the all-gather's input as it is: no copy-in.
- the all-gather *output*, ``world * shard_numel``, rank-major: rank 0's shard
  buffer, then rank 1's, ...
- the *unsharded* buffer, the same size, parameter-major: parameter p's padded
  chunks of every rank back to back, so that the full parameter is a view of
  its first ``numel`` elements. One strided copy (``copy_out``) turns the
  gather output into it; its storage is freed when the unit reshards and
  reallocated (same tensor objects, so the tensors autograd saved stay valid)
  when it gathers again.

Gradients travel the other way: the unsharded gradients are copied rank-major
into the reduce-scatter input (``world`` blocks of ``shard_numel`` plus
``flag_numel`` control elements, Note [gradient flags] in unit.py), and rank r
receives its block, whose layout is the shard buffer's.

A parameter may be sharded on another dim (``shard_placement_fn`` returning
``Shard(d)``, as torch's FSDP2 takes it): "rows" are then its slices along
``d``, which must divide evenly among the ranks (as torch requires), and each
rank's chunk is stored contiguously in its shard buffer, so that the buffers,
the collectives and the gradient flags stay the same; only the copies between
the full parameter and the rank-major blocks move dim ``d`` first
(:attr:`ParamShard.shard_dim`).

Why not one flat shard that cuts parameters at arbitrary offsets (FSDP1,
Megatron-FSDP)? It would save the copy-out, but a rank's piece of a parameter
would not be a ``Shard(0)`` DTensor, and torch's optimizers, gradient clipping
and distributed checkpoints would need a second implementation. Measured on 2
gloo ranks the copy-out is 10-15% of the all-gather it follows (BENCHMARKS.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_MIN_UNIT_BYTES", "ParamShard", "UnitLayout", "plan_unit"]

DEFAULT_MIN_UNIT_BYTES = 256 * 1024  # Note [tiny units] in api.py
"""Units below this size join the unit of an enclosing ``fully_shard`` call:
about what one gloo collective moves in its fixed latency."""


@dataclass(frozen=True)
class ParamShard:
    """One parameter's place in a unit's buffers, for one rank."""

    shape: tuple[int, ...]
    rank: int                # whose chunk
    chunk_rows: int          # rows of a full chunk: ceil(rows / world)
    row_numel: int           # elements per row (a slice along shard_dim)
    local_rows: int          # rows this rank holds (chunk_rows, fewer, or 0)
    shard_offset: int        # where this parameter's chunk starts in the shard buffer
    unsharded_offset: int    # where the full parameter starts in the unsharded buffer
    shard_dim: int = 0       # the dim cut into rows (Shard(shard_dim))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def chunk_numel(self) -> int:
        """Elements of one padded chunk (every rank's block holds this many)."""
        return self.chunk_rows * self.row_numel

    @property
    def local_numel(self) -> int:
        return self.local_rows * self.row_numel

    @property
    def local_shape(self) -> tuple[int, ...]:
        d = self.shard_dim
        return (*self.shape[:d], self.local_rows, *self.shape[d + 1:])

    @property
    def row_start(self) -> int:
        """The first global row this rank holds."""
        return min(self.rank * self.chunk_rows, self.shape[self.shard_dim])


@dataclass(frozen=True)
class UnitLayout:
    """The buffers of one unit on one rank: the shard buffer holds this rank's
    chunk of each parameter along its shard dim (``ceil(rows / world_size)``
    rows, the last ranks' possibly fewer or none), each padded to the full
    chunk size, back to back in the unit's order; an all-gather puts every
    rank's shard buffer side by side."""

    # Note [unit buffers] at the top of this file.
    params: tuple[ParamShard, ...]
    world_size: int
    rank: int

    @property
    def shard_numel(self) -> int:
        """Elements of the shard buffer (and of each rank's block of the gather)."""
        return sum(p.chunk_numel for p in self.params)

    @property
    def unsharded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def numel(self) -> int:
        """Elements of the parameters themselves, without padding."""
        return sum(p.numel for p in self.params)

    @property
    def chunk_numels(self) -> list[int]:
        return [p.chunk_numel for p in self.params]


def plan_unit(shapes: Sequence[tuple[int, ...]], world_size: int, rank: int,
              shard_dims: Sequence[int] | None = None) -> UnitLayout:
    """Lay out the parameters of one unit for ``rank`` of ``world_size``.

    Args:
        shapes: the parameters' shapes, in the unit's order; each must have at
            least one dimension (a 0-d tensor has no dim to shard).
        shard_dims: the dim each parameter is sharded on (default: 0 for all);
            a dim other than 0 must divide evenly among the ranks.

    Raises:
        ValueError: a 0-d shape, a shard dim out of range or uneven, or a rank
            outside ``[0, world_size)``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    dims = list(shard_dims) if shard_dims is not None else [0] * len(shapes)
    if len(dims) != len(shapes):
        raise ValueError(f"shard_dims has {len(dims)} entries for {len(shapes)} shapes")
    params = []
    shard_offset = 0
    for k, (shape, d) in enumerate(zip(shapes, dims)):
        shape = tuple(int(s) for s in shape)
        if not shape:
            raise ValueError(f"parameter {k} is 0-dimensional: fully_shard shards a dim; "
                             "give it a dimension (e.g. shape (1,)) or pass it in ignored_params")
        if not 0 <= d < len(shape):
            raise ValueError(f"parameter {k} of shape {shape} cannot be sharded on dim {d}")
        if d and shape[d] % world_size:
            raise ValueError(f"parameter {k} of shape {shape} has {shape[d]} rows on dim {d}, not a multiple "
                             f"of the {world_size} ranks: a dim other than 0 must shard evenly")
        rows = shape[d]
        row_numel = math.prod(shape[:d] + shape[d + 1:])
        chunk_rows = -(-rows // world_size)
        local_rows = max(0, min(chunk_rows, rows - rank * chunk_rows))
        p = ParamShard(shape=shape, rank=rank, chunk_rows=chunk_rows, row_numel=row_numel, local_rows=local_rows,
                       shard_offset=shard_offset, unsharded_offset=shard_offset * world_size, shard_dim=d)
        params.append(p)
        shard_offset += p.chunk_numel
    return UnitLayout(params=tuple(params), world_size=world_size, rank=rank)
