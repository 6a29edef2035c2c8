"""A rank's weight in DDP's mean of the gradients (Note [batch weight])."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from tandem._tree import iter_tensors

__all__ = ["check_batch_weight", "weigh_gradients"]

# Note [batch weight]
# ~~~~~~~~~~~~~~~~~~~
# DDP's mean of the ranks' gradients is the gradient of the mean loss over the
# global batch only when the ranks' batches are equally large. Where they are not
# (the last batch of an epoch split exactly after an elastic world change, Note
# [exact split] in tandem/data/split.py), rank r's gradient must count w_r =
# n_r * R / N times, N being the global batch's size. ``batch_weight`` on the DDP
# model says so for the forwards that follow: the gradient reaching each output
# tensor of such a forward is multiplied by w_r. Backward is linear in that
# gradient, so every parameter's gradient from the forward is w_r times its own,
# under no_sync as well (each micro-batch with its own weight), before the
# reducer divides by R. A prepared elastic loader sets it for each batch
# (``DistributedLoader.on_weight``); the Trainer, which computes the loss itself,
# multiplies the loss instead, which also covers ZeRO and fully_shard.
#
# At 1.0 (the default, and every batch of equal sizes) nothing is hooked: the
# gradients are bit for bit torch's. Gradients that do not flow through the
# model's outputs (a penalty on the parameters added to the loss outside the
# model) are not weighed; their mean over the ranks is right as it is.


def check_batch_weight(weight: Any, rank: int) -> float:
    """``weight`` as a float, or ValueError naming it."""
    value = float(weight)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"rank {rank}: batch_weight={weight!r}; it must be a finite number of at least 0 "
                         "(n_rank * world_size / global_batch_size, Note [batch weight])")
    return value


def weigh_gradients(output: Any, weight: float) -> None:
    """Multiply the gradient that reaches each tensor of ``output`` by ``weight``."""
    seen: set[int] = set()
    for t in iter_tensors(output):
        if t.requires_grad and id(t) not in seen:
            seen.add(id(t))
            t.register_hook(functools.partial(_scaled, weight))


def _scaled(weight: float, grad: torch.Tensor) -> torch.Tensor:
    return grad * weight
