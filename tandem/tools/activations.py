"""What one forward saves for backward, per block, and what checkpointing the
blocks would save instead: the activation part of ``tandem plan``.

# Note [checkpointed activations]
Without checkpointing a rank holds, at the start of backward, every tensor
autograd saved in forward (Note [measured activations] in plan.py). With
each block checkpointed (torch's ``checkpoint_wrapper`` per block, as
torchtitan applies it; non-reentrant), a block's forward saves nothing but
keeps its inputs for the recomputation, and its backward first recomputes
its own forward, which saves what it saved the first time. So the most held
at once is

    outside + sum over blocks of their inputs + max over blocks of (saved - inputs)

where ``outside`` is what the rest of the model saves (embedding, head, loss),
and a block's ``saved`` counts the storages first saved while it ran (a block
that saves its input, as a LayerNorm does, counts it once, with its inputs).
Each storage is counted once, as in Note [measured activations]. The
recomputation's transients (the gradients flowing through the block) are not
activations and not counted, here as without checkpointing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn

from tandem._tree import iter_tensors

__all__ = ["ActivationRecorder", "BlockActivations", "storage_of"]


@dataclass(frozen=True)
class BlockActivations:
    """One block's share of the activations (Note [checkpointed activations])."""

    name: str
    saved: int
    """Bytes of the storages first saved for backward while the block ran (its inputs among them
    if it saves them)."""
    inputs: int
    """Bytes of its tensor inputs: what a checkpointed block keeps from forward to backward."""

    @property
    def recomputed(self) -> int:
        """What its recomputation in backward saves beyond the inputs it kept."""
        return max(0, self.saved - self.inputs)


def checkpointed_bytes(total: int, blocks: Sequence[BlockActivations]) -> int:
    """The activations held at most with every block of ``blocks`` checkpointed,
    from ``total`` (the activations without checkpointing) and what each block
    saved (Note [checkpointed activations])."""
    if not blocks:
        return total
    outside = total - sum(b.saved for b in blocks)
    return outside + sum(b.inputs for b in blocks) + max(b.recomputed for b in blocks)


class ActivationRecorder:
    """``with ActivationRecorder(model, blocks): loss = ...(model(x))``: counts the
    storages autograd saves (leaving out ``model``'s parameters and buffers),
    attributed to the outermost of the named ``blocks`` running when they were
    saved."""

    def __init__(self, model: nn.Module, blocks: Sequence[str] = ()) -> None:
        modules = dict(model.named_modules())
        missing = [b for b in blocks if b not in modules]
        if missing:
            raise ValueError(f"activation checkpointing: no module named {', '.join(map(repr, missing))} in "
                             f"{type(model).__name__} (blocks are module paths such as 'layers.0')")
        self._modules = [(name, modules[name]) for name in blocks]
        self._held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self._saved: dict[int, tuple[int, str | None]] = {}   # storage -> (bytes, block)
        self._inputs: dict[str, dict[int, int]] = {name: {} for name in blocks}
        self._running: list[str] = []
        self._before: set[int] = set()   # storages saved outside the blocks before the first one ran
        self._started = False             # a block has run
        self._handles: list[Any] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def total(self) -> int:
        """Bytes of every distinct storage saved."""
        return sum(nbytes for nbytes, _ in self._saved.values())

    @property
    def saved_storages(self) -> frozenset[int]:
        """The storages saved (their keys, as :func:`storage_of` gives them)."""
        return frozenset(self._saved)

    @property
    def outside_before(self) -> int:
        """Bytes of the storages saved outside the blocks before the first block ran
        (the embeddings'), alive until the end of backward."""
        return sum(nbytes for ptr, (nbytes, _) in self._saved.items() if ptr in self._before)

    def blocks(self) -> tuple[BlockActivations, ...]:
        saved = {name: 0 for name, _ in self._modules}
        for nbytes, block in self._saved.values():
            if block is not None:
                saved[block] += nbytes
        return tuple(BlockActivations(name, saved[name], sum(self._inputs[name].values()))
                     for name, _ in self._modules)

    def __enter__(self) -> ActivationRecorder:
        for name, module in self._modules:
            self._handles.append(module.register_forward_pre_hook(
                lambda m, args, kwargs, name=name: self._enter(name, (args, kwargs)), with_kwargs=True))
            self._handles.append(module.register_forward_hook(lambda m, args, out: self._exit()))
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._hooks.__exit__(exc_type, exc, tb)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _enter(self, name: str, inputs: Any) -> None:
        self._started = True
        if not self._running:
            for t in iter_tensors(inputs):
                ptr, nbytes = storage_of(t)
                if ptr not in self._held:
                    self._inputs[name][ptr] = nbytes
        self._running.append(name)

    def _exit(self) -> None:
        self._running.pop()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = storage_of(t)
        if ptr not in self._held and ptr not in self._saved:
            self._saved[ptr] = (nbytes, self._running[0] if self._running else None)
            if not self._started:
                self._before.add(ptr)
        return t


def storage_of(t: torch.Tensor) -> tuple[int, int]:
    """A key for ``t``'s storage and its bytes (a tensor without a plain
    storage, sparse or nested, counts as itself)."""
    try:
        storage = t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return id(t), t.numel() * t.element_size()
    return storage.data_ptr(), storage.nbytes()
