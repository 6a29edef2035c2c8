"""A copy of a state in CPU memory that later training steps cannot change: what
a save in the background writes (Note [saves in the background] in
tandem/train/background_saves.py).

# Note [staging buffers]
:meth:`Stager.stage` walks a state (dicts, lists and tuples of tensors,
DTensors, :class:`~tandem.checkpoint.flat.FlatShard` values and plain objects)
and returns the same structure with every tensor copied into a CPU buffer that
the stager keeps, keyed by the tensor's place in the structure. The next save
of a state of the same layout copies into the same buffers: no allocation and,
on a CPU, no first touch of fresh pages (on a GPU the buffers are pinned, and
the copies run without blocking until one synchronisation at the end). Reusing
them is safe because a buffer is only read by the write it was staged for, and
the next stage starts after that write finished (at most one in flight). A
tensor that appears under several keys (tied weights) is copied once, and
shares its copy, as ``torch.save`` would store it once. Objects that are not
tensors are deep-copied: a list that training appends to (the history) is
written as it was when staged.

The buffers hold a second copy of the state in host memory for the life of
the stager: the price of a save that does not stop training.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch

from tandem._compat import dtensor_like, dtensor_local
from tandem.dtensor import is_distributed

__all__ = ["Stager"]

Path = tuple[Any, ...]  # a value's place in the state: its keys and indices
_ATOMS = (bool, int, float, complex, str, bytes, torch.dtype, torch.device)


class Stager:
    """Copies states into CPU buffers that it keeps from one :meth:`stage` to the
    next (Note [staging buffers])."""

    def __init__(self) -> None:
        self._buffers: dict[Path, torch.Tensor] = {}
        self._on_gpu = False

    @property
    def nbytes(self) -> int:
        """The bytes of the buffers held."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @torch.no_grad()
    def stage(self, state: Any) -> Any:
        """``state`` with every tensor copied into this stager's CPU buffers and
        every other object deep-copied. The result is valid until the next call.

        Raises:
            TypeError: a tensor subclass it does not know how to copy, named by
                its place in the state.
        """
        self._on_gpu = False
        copies: dict[tuple[Any, ...], torch.Tensor] = {}
        staged = self._walk(state, (), copies)
        if self._on_gpu:
            torch.cuda.synchronize()  # the non-blocking copies have landed before a thread reads them
        return staged

    def _walk(self, value: Any, path: Path, copies: dict[tuple[Any, ...], torch.Tensor]) -> Any:
        if value is None or type(value) in _ATOMS:  # immutable: a long history stays cheap to stage
            return value
        if isinstance(value, dict):
            return type(value)((k, self._walk(v, path + (k,), copies)) for k, v in value.items())
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(self._walk(v, path + (i,), copies) for i, v in enumerate(value))
        # A FlatShard exists only once its module (which loads torch.distributed.checkpoint) is imported.
        flat = sys.modules.get("tandem.checkpoint.flat")
        if flat is not None and isinstance(value, flat.FlatShard):
            pieces = [flat.FlatPiece(p.start, self._copy(p.values, path + ("piece", i), copies))
                      for i, p in enumerate(value.pieces)]
            return flat.FlatShard(value.shape, value.dtype, pieces)
        if is_distributed(value):
            return dtensor_like(self._copy(dtensor_local(value), path, copies), value)
        if isinstance(value, torch.Tensor):
            if type(value) not in (torch.Tensor, torch.nn.Parameter):
                raise TypeError(f"cannot stage {'.'.join(map(str, path)) or 'the state'}: a "
                                f"{type(value).__name__}, which is neither a plain tensor nor a DTensor")
            return self._copy(value, path, copies)
        return copy.deepcopy(value)

    def _copy(self, t: torch.Tensor, path: Path, copies: dict[tuple[Any, ...], torch.Tensor]) -> torch.Tensor:
        same = (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                t.stride()) if t.numel() else None
        if same is not None and same in copies:
            return copies[same]
        on_gpu = t.device.type == "cuda"
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype:
            buffer = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=on_gpu)
            self._buffers[path] = buffer
        buffer.copy_(t.detach(), non_blocking=on_gpu)
        self._on_gpu |= on_gpu
        if same is not None:
            copies[same] = buffer
        return buffer
