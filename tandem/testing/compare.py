"""Comparing results: the largest difference between two named sets of tensors,
what each of several calls raised, and a message that says which comparison failed."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["first_difference", "max_abs_diff", "prefixed", "raised_by"]


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


def first_difference(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> str:
    """The first name whose tensors are not equal bit for bit, with their
    largest difference; "" when every one is (for bit-for-bit comparisons).

    Raises:
        AssertionError: the two mappings have different names.
    """
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    for k in a:
        if not torch.equal(a[k], b[k]):
            return f"{k}: max |diff| {(a[k].double() - b[k].double()).abs().max().item():.3g}"
    return ""


def raised_by(calls: Mapping[str, Callable[[], Any]]) -> dict[str, tuple[str, str] | None]:
    """Call each; what it raised as ``(type name, message)``, or None where it
    returned: for tests of refusals, which compare types and messages (the
    result pickles across ranks, the exceptions may not)."""
    out: dict[str, tuple[str, str] | None] = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the caller inspects the type and message
            out[name] = (type(e).__name__, str(e))
    return out


def prefixed(prefix: str) -> Callable[[str], str]:
    """A ``msg`` for ``torch.testing.assert_close``: ``prefix`` (which rank, which
    parameter), then torch's own message."""
    return lambda message: f"{prefix}: {message}"
