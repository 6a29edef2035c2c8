"""A parameter's gradient, as a test reads it after a backward: present, and,
under fully_shard or tensor parallelism, a DTensor (torch types both a
parameter and its ``.grad`` as a plain optional Tensor)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["as_dtensor", "grad_of"]


def grad_of(param: torch.Tensor) -> torch.Tensor:
    """``param.grad``, which a backward has written.

    Raises:
        AssertionError: ``param`` has no gradient.
    """
    grad = param.grad
    assert grad is not None, f"a parameter of shape {tuple(param.shape)} has no gradient"
    return grad


def as_dtensor(tensor: torch.Tensor | None) -> DTensor:
    """``tensor`` as the DTensor it is: a sharded parameter, or its gradient.

    Raises:
        AssertionError: ``tensor`` is None or a plain tensor.
    """
    assert isinstance(tensor, DTensor), f"expected a DTensor, got {type(tensor).__name__}"
    return tensor
