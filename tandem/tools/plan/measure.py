"""Measuring: :func:`measure` runs one forward and backward with a sample batch
and returns a :class:`Measurement`: the activations saved for backward, the
parameters the forward does not reach, and each block's share.

# Note [measured activations]
Activations are what autograd saves for backward: every tensor passed to a
saved-tensors pack hook during one forward with the sample batch, counted by
distinct storage (a view and its base are one allocation; an op that saves its
output shares the storage of the next op's saved input), leaving out the
parameters' and buffers' storages, which are counted as parameters. The
input batch is counted when an op saves it. The gradients are then taken with
``torch.autograd.grad``, so the model's ``.grad`` stays as it was; buffers
changed by the forward (BatchNorm's running statistics) are restored.
Measured on the device the model is on, in its dtype, without autocast: a
model trained under autocast saves some half-precision tensors instead.
Activations grow with the batch: measure with the per-rank batch you will train.
With ``activation_checkpointing`` each block's share is measured too, and the
activations are what checkpointing every block holds at most (Note
[checkpointed activations] in tandem/tools/activations.py).

# Note [measured step]
fully_shard's peak follows the phases of a step (Note [stage 3 peak] in
tandem/planner/memory/phases.py), which hold different parts of what the
forward saved. Given the units fully_shard is called on, the same forward
and backward also measure (:class:`tandem.planner.memory.StepActivity`): each
unit's share of the activations and its inputs, what was saved outside the
units before the first one ran (the embeddings, alive to the end of
backward) and after it (the head and the loss, freed before the units'
backward), the outputs not saved by the loss, the gradients of the
parameters outside the units that backward computes before it reaches the
first unit (the head's, kept until the root's backward ends), and what the
loss holds beyond the tensors it saves: its forward and backward are run
again on a detached copy of the outputs under :class:`PeakMemory` (on CPU,
from the profiler's allocation events), which for a cross-entropy of fp32
logits is two fp32 copies of them, often a step's largest transient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem._tree import iter_tensors, map_tensors
from tandem.ddp.graph import reachable_params
from tandem.planner.memory import StepActivity
from tandem.tools.activations import ActivationRecorder, BlockActivations, checkpointed_bytes, storage_of
from tandem.tools.memory import PeakMemory

__all__ = ["Measurement", "measure"]


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What one forward and backward with the sample batch found (:func:`measure`)."""

    activation_bytes: int  # Note [measured activations] at the top of this file
    """Bytes of the distinct storages autograd saved for backward in one forward with the sample
    batch (a view and its base counted once; the parameters and buffers left out)."""
    batch_size: int | None
    """Dim 0 of the first input tensor: the per-rank batch."""
    unused: tuple[str, ...] = ()
    """Trainable parameters the outputs do not reach in the autograd graph."""
    opaque: bool = False
    """The graph hides what it reaches (reentrant checkpointing): ``unused`` is unknown."""
    blocks: tuple[BlockActivations, ...] = ()  # Note [checkpointed activations] in tandem/tools/activations.py
    """Each measured block's share of the activations, for activation checkpointing; empty unless
    asked for."""
    step: StepActivity | None = None  # Note [measured step] at the top of this file
    """What a step holds beside the model's state, phase by phase, for fully_shard's peak; None
    unless units were given."""

    @property
    def checkpointed_bytes(self) -> int:
        """The activations held at most with every block in :attr:`blocks`
        checkpointed (``activation_bytes`` when there are none)."""
        return checkpointed_bytes(self.activation_bytes, self.blocks)


def measure(model: nn.Module, sample: Any, *, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
            blocks: Sequence[str] = (), input_dtype: torch.dtype | None = None,
            units: Sequence[str] = ()) -> Measurement:
    """One forward with ``sample`` and the gradients of its loss, measuring the
    activations and the parameters the outputs do not reach. The model's
    ``.grad`` and buffers are left as they were. Measured on the model's
    device, in its dtype, without autocast (a model trained under autocast
    saves some tensors in half precision instead), and with the batch given:
    measure with the per-rank batch you will train.

    Args:
        model: the model, measured in the mode it is in (a new module trains:
            dropout saves its masks; ``eval()`` would not).
        sample: one rank's batch, as a Trainer sees it: ``(inputs, targets)``,
            or the inputs alone; the model is called as ``model(inputs)``.
        loss_fn: ``loss_fn(outputs, targets)``; None (or no targets): the sum
            of the outputs' floating tensors stands in for the loss.
        blocks: module paths whose share of the activations to measure, for
            activation checkpointing.
        input_dtype: cast the inputs' floating tensors to it first, as
            ``MixedPrecisionPolicy(cast_forward_inputs=True)`` casts them to
            ``param_dtype`` (None: as they are).
        units: the modules fully_shard is called on (the root aside), for
            :attr:`Measurement.step`.

    Raises:
        ValueError: the forward produces no tensor that requires grad, or a
            block that is not a module of ``model``.
    """
    # Note [measured activations] and Note [measured step] at the top of this file.
    inputs, targets = _split(sample)
    if input_dtype is not None:
        inputs = map_tensors(lambda t: t.to(input_dtype) if t.is_floating_point() else t, inputs)
    ignored = frozenset(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and n not in ignored]
    params = [p for _, p in named]
    names = {id(p): n for n, p in named}
    recorder = ActivationRecorder(model, list(dict.fromkeys([*blocks, *units])))
    head = _HeadGradients(model, units)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.enable_grad(), recorder, head:
            outputs = model(inputs)
            loss = _loss(outputs, targets, loss_fn)
            reach = reachable_params([t for t in iter_tensors(outputs) if t.requires_grad],
                                     {id(p): i for i, p in enumerate(params)})
            wanted = [p for i, p in enumerate(params) if i in reach.params]
            if wanted:
                torch.autograd.grad(loss, wanted, allow_unused=True)
    finally:
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
    del loss
    unused = () if reach.opaque else tuple(names[id(p)] for i, p in enumerate(params) if i not in reach.params)
    first = next(iter_tensors(inputs), None)
    measured = recorder.blocks()
    step = None
    if units:
        shares = {b.name: b for b in measured}
        saved = recorder.saved_storages
        step = StepActivity(
            before=recorder.outside_before,
            after=recorder.total - recorder.outside_before - sum(shares[n].saved for n in units),
            blocks=tuple((n, shares[n].saved, shares[n].inputs) for n in units),
            outputs=sum(nbytes for ptr, nbytes in _storages(outputs).items() if ptr not in saved),
            loss=_loss_transient(outputs, targets, loss_fn),
            head_grads=head.nbytes)
    return Measurement(activation_bytes=recorder.total,
                       batch_size=int(first.shape[0]) if first is not None and first.dim() else None,
                       unused=unused, opaque=reach.opaque, blocks=tuple(b for b in measured if b.name in blocks),
                       step=step)


def _split(sample: Any) -> tuple[Any, Any]:
    if isinstance(sample, (tuple, list)) and len(sample) == 2:
        return sample[0], sample[1]
    return sample, None


def _loss(outputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> torch.Tensor:
    if loss_fn is not None and targets is not None:
        return loss_fn(outputs, targets)
    parts = [t.float().sum() for t in iter_tensors(outputs) if t.requires_grad and t.is_floating_point()]
    if not parts:
        raise ValueError(f"the model's output ({type(outputs).__name__}) holds no floating tensor that "
                         "requires grad: nothing to take gradients of; does the model have trainable "
                         "parameters, and does the sample reach them?")
    return torch.stack(parts).sum()


class _HeadGradients:
    """``with _HeadGradients(model, units): ...forward and backward...``, then
    ``nbytes``: the gradients of the parameters outside ``units`` that backward
    computes before it reaches the first of them (the head's, which fully_shard
    keeps until the root's backward ends). A unit is reached when the gradient
    of its output is computed, where fully_shard's pre-backward hook runs."""

    def __init__(self, model: nn.Module, units: Sequence[str]) -> None:
        modules = dict(model.named_modules())
        self._units = [modules[n] for n in units if n in modules]
        inside = {id(p) for m in self._units for p in m.parameters()}
        self._params = [p for p in model.parameters() if p.requires_grad and id(p) not in inside]
        self._reached = False
        self.nbytes = 0
        self._handles: list[Any] = []

    def __enter__(self) -> _HeadGradients:
        for m in self._units:
            self._handles.append(m.register_forward_hook(lambda m, args, out: self._watch(out)))
        for p in self._params:
            self._handles.append(p.register_hook(self._grad))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _watch(self, output: Any) -> None:
        for t in iter_tensors(output):
            if t.requires_grad:
                t.register_hook(self._reach)

    def _reach(self, grad: torch.Tensor) -> None:
        self._reached = True

    def _grad(self, grad: torch.Tensor) -> None:
        if not self._reached:
            self.nbytes += grad.numel() * grad.element_size()


def _storages(tree: Any) -> dict[int, int]:
    """The distinct storages of the tensors in ``tree``: pointer -> bytes."""
    return dict(storage_of(t) for t in iter_tensors(tree))


def _loss_transient(outputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> int:
    """What the loss's forward and backward hold at most beyond the tensors it
    saves (Note [measured step]): run again on a detached copy of ``outputs``."""
    first = next(iter_tensors(outputs), None)
    if first is None or first.device.type not in ("cpu", "cuda"):
        return 0
    detached = map_tensors(lambda t: t.detach().requires_grad_(t.requires_grad), outputs)
    leaves = [t for t in iter_tensors(detached) if t.requires_grad]
    if not leaves:
        return 0
    held = set(_storages(detached))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = storage_of(t)
        if ptr not in held:
            saved[ptr] = nbytes
        return t

    with PeakMemory(first.device) as mem:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = _loss(detached, targets, loss_fn)
        torch.autograd.grad(loss, leaves)
        del loss
    return max(0, mem.peak - sum(saved.values()))
