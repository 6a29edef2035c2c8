"""A parameter's gradient, as a test reads it after a backward: torch types
``.grad`` as optional, and a backward has written it."""

from __future__ import annotations

import torch

__all__ = ["grad_of"]


def grad_of(param: torch.Tensor) -> torch.Tensor:
    """``param.grad``, which a backward has written.

    Raises:
        AssertionError: ``param`` has no gradient.
    """
    grad = param.grad
    assert grad is not None, f"a parameter of shape {tuple(param.shape)} has no gradient"
    return grad
