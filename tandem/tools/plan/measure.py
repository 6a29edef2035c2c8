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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem._tree import iter_tensors, map_tensors
from tandem.ddp.graph import reachable_params
from tandem.tools.activations import ActivationRecorder, BlockActivations, checkpointed_bytes

__all__ = ["Measurement", "measure"]


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What one forward and backward with the sample batch found (:func:`measure`)."""

    activation_bytes: int
    """Bytes of the distinct storages saved for backward (Note [measured activations])."""
    batch_size: int | None
    """Dim 0 of the first input tensor: the per-rank batch."""
    unused: tuple[str, ...] = ()
    """Trainable parameters the outputs do not reach in the autograd graph."""
    opaque: bool = False
    """The graph hides what it reaches (reentrant checkpointing): ``unused`` is unknown."""
    blocks: tuple[BlockActivations, ...] = ()
    """Each measured block's share (Note [checkpointed activations]); empty unless asked for."""

    @property
    def checkpointed_bytes(self) -> int:
        """The activations held at most with every block in :attr:`blocks`
        checkpointed (``activation_bytes`` when there are none)."""
        return checkpointed_bytes(self.activation_bytes, self.blocks)


def measure(model: nn.Module, sample: Any, *, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
            blocks: Sequence[str] = (), input_dtype: torch.dtype | None = None) -> Measurement:
    """One forward with ``sample`` and the gradients of its loss, measuring the
    activations (Note [measured activations]) and the parameters the outputs
    do not reach. The model's ``.grad`` and buffers are left as they were.

    Args:
        model: the model, measured in the mode it is in (a new module trains:
            dropout saves its masks; ``eval()`` would not).
        sample: one rank's batch, as a Trainer sees it: ``(inputs, targets)``,
            or the inputs alone; the model is called as ``model(inputs)``.
        loss_fn: ``loss_fn(outputs, targets)``; None (or no targets): the sum
            of the outputs' floating tensors stands in for the loss.
        blocks: module paths whose share of the activations to measure, for
            activation checkpointing (Note [checkpointed activations]).
        input_dtype: cast the inputs' floating tensors to it first, as
            ``MixedPrecisionPolicy(cast_forward_inputs=True)`` casts them to
            ``param_dtype`` (None: as they are).

    Raises:
        ValueError: the forward produces no tensor that requires grad, or a
            block that is not a module of ``model``.
    """
    inputs, targets = _split(sample)
    if input_dtype is not None:
        inputs = map_tensors(lambda t: t.to(input_dtype) if t.is_floating_point() else t, inputs)
    ignored = frozenset(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and n not in ignored]
    params = [p for _, p in named]
    names = {id(p): n for n, p in named}
    recorder = ActivationRecorder(model, blocks)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.enable_grad(), recorder:
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
    unused = () if reach.opaque else tuple(names[id(p)] for i, p in enumerate(params) if i not in reach.params)
    first = next(iter_tensors(inputs), None)
    return Measurement(activation_bytes=recorder.total,
                       batch_size=int(first.shape[0]) if first is not None and first.dim() else None,
                       unused=unused, opaque=reach.opaque, blocks=recorder.blocks())


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
