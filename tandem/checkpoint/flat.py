"""Tensors held as flat ranges, through torch.distributed.checkpoint: each rank
saves and loads only its own elements, and DCP reshards between any two ways of
cutting a tensor.

# Note [flat shards in DCP]
ZeRO cuts its flat bucket buffers into equal contiguous shards, so a rank holds
of each parameter (and of its optimizer state) one or more ranges of the
parameter's elements in row-major order, not a slice along a dimension:
neither a DTensor nor anything else DCP saves. DCP describes a tensor's pieces
as boxes (an offset and a size per dimension) and reshards by intersecting the
boxes saved with the boxes asked for at load. A flat range of a row-major
tensor is a union of at most ``2 * ndim - 1`` boxes, each contiguous in memory
(a partial row, whole rows, a partial row; recursively for the partial rows):
:func:`flat_boxes`. A :class:`FlatShard` is one rank's ranges of one tensor; it
tells DCP its boxes for the save (``__create_write_items__``) and the load
(``__create_chunk_list__``), the protocol DCP uses for DTensor, and the planners
below hand DCP each box as a view of the rank's own memory. The checkpoint
therefore holds the tensor at its full shape under its usual key, exactly as if
a DTensor or a plain tensor had been saved: it loads into a fully-sharded model
or a single process with DCP's own planners, and back into flat shards cut for
any other world size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, \
    TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from tandem._compat import flatten_state_dict

__all__ = ["FlatLoadPlanner", "FlatPiece", "FlatSavePlanner", "FlatShard", "flat_boxes"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def flat_boxes(shape: Sequence[int], start: int, length: int) -> list[tuple[Box, int]]:
    """The boxes that make up elements ``[start, start + length)`` of a row-major
    tensor of ``shape``, in order, each with its first element's position within
    the range (Note [flat shards in DCP]). Pure arithmetic.

    Raises:
        ValueError: the range is not inside the tensor.
    """
    numel = math.prod(shape)
    if start < 0 or length < 0 or start + length > numel:
        raise ValueError(f"elements [{start}, {start + length}) are outside a tensor of shape "
                         f"{tuple(shape)} ({numel} elements)")
    out: list[tuple[Box, int]] = []
    _boxes(tuple(shape), start, length, 0, out)
    return out


def _boxes(shape: tuple[int, ...], start: int, length: int, at: int, out: list[tuple[Box, int]]) -> None:
    if length == 0:
        return
    if not shape:  # a 0-dim tensor: its one element
        out.append((((), ()), at))
        return
    inner = math.prod(shape[1:])
    row, offset = divmod(start, inner)
    if offset:  # a partial first row
        n = min(length, inner - offset)
        _row_boxes(shape, row, offset, n, at, out)
        row, length, at = row + 1, length - n, at + n
    whole = length // inner
    if whole:
        out.append((((row,) + (0,) * (len(shape) - 1), (whole,) + shape[1:]), at))
        row, length, at = row + whole, length - whole * inner, at + whole * inner
    if length:  # a partial last row
        _row_boxes(shape, row, 0, length, at, out)


def _row_boxes(shape: tuple[int, ...], row: int, offset: int, length: int, at: int,
               out: list[tuple[Box, int]]) -> None:
    inner: list[tuple[Box, int]] = []
    _boxes(shape[1:], offset, length, at, inner)
    out.extend((((row,) + offs, (1,) + sizes), pos) for (offs, sizes), pos in inner)


@dataclass(frozen=True)
class FlatPiece:
    """A range of a tensor's elements that this rank holds."""

    start: int
    """Its first element, in the tensor's row-major order."""
    values: torch.Tensor
    """The elements, 1-D (a view of the rank's own memory: a load writes into it)."""


class FlatShard:
    """This rank's elements of a tensor of ``shape``, as flat ranges (Note [flat
    shards in DCP]); a value of a state dict for ``dcp.save``/``dcp.load`` with the
    planners below. A rank may hold no piece of a tensor that others hold.

    Raises:
        ValueError: a piece outside the tensor, not 1-D, or of another dtype.
    """

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, pieces: Sequence[FlatPiece] = ()) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.pieces: list[FlatPiece] = []
        self._views: dict[tuple[int, ...], torch.Tensor] = {}
        self._chunks: list[ChunkStorageMetadata] = []
        for piece in pieces:
            self.add(piece)

    def add(self, piece: FlatPiece) -> None:
        """Add a range this rank holds (disjoint from the others)."""
        if piece.values.dim() != 1 or piece.values.dtype != self.dtype:
            raise ValueError(f"a FlatShard of dtype {self.dtype} takes 1-D pieces of that dtype, got "
                             f"{piece.values.dtype} of shape {tuple(piece.values.shape)}")
        self.pieces.append(piece)
        for (offsets, sizes), at in flat_boxes(self.shape, piece.start, piece.values.numel()):
            self._views[offsets] = piece.values.narrow(0, at, math.prod(sizes)).view(sizes)
            self._chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))

    def size(self) -> torch.Size:
        """The whole tensor's shape (DCP checks it against the checkpoint at load)."""
        return self.shape

    def box(self, offsets: Sequence[int] | None) -> torch.Tensor:
        """The view of the box at ``offsets``."""
        key = tuple(offsets or ())
        if key not in self._views:
            raise KeyError(f"this FlatShard holds no box at offsets {key}")
        return self._views[key]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=chunk, size=self.shape,
                              properties=TensorProperties.create_from_tensor(self._views[tuple(chunk.offsets)])))
                for chunk in self._chunks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return list(self._chunks)

    def __repr__(self) -> str:
        ranges = ", ".join(f"[{p.start}, {p.start + p.values.numel()})" for p in self.pieces)
        return f"FlatShard(shape={tuple(self.shape)}, dtype={self.dtype}, elements {ranges or 'none'})"


class FlatSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also saves :class:`FlatShard` values."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, FlatShard):
            return value.box(index.offset)
        return super().lookup_object(index)


class FlatLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which also loads into :class:`FlatShard` values
    (in place: each box is a view of the rank's memory). Tensors must be allocated
    (not on the meta device)."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        # The default set-up first re-allocates meta tensors, replacing every value
        # it does not know, FlatShards among them, by None; the rest is the same.
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, FlatShard):
            return value.box(index.offset)
        return super().lookup_tensor(index)
