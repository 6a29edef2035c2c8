"""Comparing training results: the largest difference between two named sets of tensors."""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["max_abs_diff"]


def max_abs_diff(a: Mapping[str, torch.Tensor | None], b: Mapping[str, torch.Tensor | None]) -> float:
    """The largest absolute elementwise difference between same-named tensors,
    compared in float64; ``inf`` where one side is None and the other is not
    (a gradient that exists in one run only).

    Raises:
        AssertionError: the two mappings have different names.
    """
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    worst = 0.0
    for k in a:
        x, y = a[k], b[k]
        if (x is None) != (y is None):
            return float("inf")
        if x is not None and y is not None:
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst
