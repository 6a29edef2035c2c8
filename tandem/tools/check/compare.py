"""Comparing two runs' snapshots (pure): the tolerance (:class:`Tolerance`,
:data:`DEFAULT_TOLERANCES`), each tensor's difference at each step, and the
first divergence (:func:`compare_snapshots` -> :class:`Comparison`).

# Note [what is compared]
After step 0 (the initial model) and after each of the K optimizer steps: every
parameter (a fully-sharded one gathered in full) and every floating buffer
(BatchNorm's running statistics; rank 0's, as DDP broadcasts rank 0's), from
rank 0, against the one-process run. The verdict judges the parameters, which
are what training produces; the buffers are shown but not judged, as they
follow the parameters (a running mean tracks the bias before it, Note
[rounding-noise gradients] in diagnose.py) and a wrong one shows in the parameters of the next
step anyway. A tensor is within tolerance when every
element satisfies ``|distributed - single| <= atol + rtol * |single|``
(:func:`torch.isclose`'s rule). The default tolerance comes from the lowest
floating precision among the parameters (:data:`DEFAULT_TOLERANCES`): the two
runs differ only in the order of summation, which costs a few ulps per step.

# Note [first divergence]
The first divergence is at the earliest step where some tensor is out of
tolerance. Within that step a parameter is named before a buffer, and among
them the one furthest out of tolerance (the largest
``|diff| / (atol + rtol * |single|)``), ties broken by model order
(``named_parameters()`` then ``named_buffers()``). After one wrong step every
parameter usually differs, so the step and the worst tensor are what the
numbers can say; the cause is named by the first module whose output in the
first step's forward differs (diagnose.py), which is compared with the same rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["DEFAULT_TOLERANCES", "Comparison", "Divergence", "Tolerance", "compare_snapshots", "default_tolerance",
           "difference"]


@dataclass(frozen=True)
class Tolerance:
    """``|distributed - single| <= atol + rtol * |single|``, elementwise."""

    rtol: float
    atol: float
    source: str = "given"
    """Where it came from: ``"given"`` or ``"float32 default"`` and so on."""

    def __post_init__(self) -> None:
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"tolerance {name}={value!r} must be a number >= 0")

    def describe(self) -> str:
        return f"|distributed - single| <= {self.atol:g} + {self.rtol:g} * |single| ({self.source})"


DEFAULT_TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
"""(rtol, atol) by the lowest floating precision among the parameters: the two
runs differ by the order of summation, a few ulps per step over a few steps."""


def default_tolerance(dtypes: Sequence[torch.dtype]) -> Tolerance:
    """The tolerance for parameters of ``dtypes``: the loosest of :data:`DEFAULT_TOLERANCES`."""
    known = [d for d in dtypes if d in DEFAULT_TOLERANCES] or [torch.float32]
    dtype = max(known, key=lambda d: DEFAULT_TOLERANCES[d][0])
    rtol, atol = DEFAULT_TOLERANCES[dtype]
    return Tolerance(rtol, atol, f"{str(dtype).removeprefix('torch.')} default")


@dataclass(frozen=True)
class Divergence:
    """Where the distributed run first left the tolerance: the earliest step with
    a tensor out of tolerance, and in it a parameter before a buffer, the one
    furthest out of tolerance."""

    # Note [first divergence] at the top of this file.

    step: int
    """Optimizer steps taken (0: the initial model)."""
    name: str
    """The parameter or buffer, as ``named_parameters()`` / ``named_buffers()`` name it."""
    max_abs_diff: float
    """Its largest elementwise ``|distributed - single|`` at that step."""
    is_buffer: bool = False


@dataclass(frozen=True)
class Comparison:
    """Per-step, per-tensor differences of two runs' snapshots."""

    names: tuple[str, ...]
    """The compared tensors, parameters then buffers, in model order."""
    buffers: frozenset[str]
    """Which of ``names`` are buffers."""
    max_abs_diff: tuple[tuple[float, ...], ...]
    """``[step][tensor]``: the largest ``|distributed - single|`` (inf: missing or another shape)."""
    excess: tuple[tuple[float, ...], ...]
    """``[step][tensor]``: the largest ``|diff| / (atol + rtol*|single|)``; above 1 is out of tolerance."""
    first_divergence: Divergence | None
    ignored: frozenset[str] = frozenset()
    """Names compared and shown but not judged. :func:`build_report` passes the
    buffers (they follow the parameters, and a wrong one shows in the next
    step's parameters) and, with an optimizer other than SGD, the parameters
    whose gradient is only rounding noise (a bias right before a normalisation
    layer), which such optimizers move by about ``lr`` in the noise's
    direction."""
    # Note [rounding-noise gradients] in diagnose.py.

    def judged_out(self, step: int) -> list[str]:
        """The judged tensors out of tolerance at ``step``."""
        return [n for n, e in zip(self.names, self.excess[step]) if e > 1 and n not in self.ignored]


def difference(ref: torch.Tensor | None, got: torch.Tensor | None, tol: Tolerance) -> tuple[float, float]:
    """The largest ``|got - ref|`` and the largest ``|diff| / (atol + rtol * |ref|)`` (above 1: out of
    tolerance); both infinite for a missing tensor or another shape, NaN counts as out."""
    if ref is None or got is None or tuple(ref.shape) != tuple(got.shape):
        return float("inf"), float("inf")
    if ref.numel() == 0:
        return 0.0, 0.0
    r, g = ref.detach().double(), got.detach().double()
    diff = (g - r).abs()
    bound = tol.atol + tol.rtol * r.abs()
    ratio = torch.where(diff == 0, torch.zeros_like(diff), diff / bound)
    worst, over = diff.max().item(), ratio.max().item()
    nan = bool(torch.isnan(diff).any())  # NaN on one side only, or on both: out of tolerance either way
    return (float("nan") if nan else worst), (float("inf") if nan or over != over else over)


def compare_snapshots(reference: Sequence[Mapping[str, torch.Tensor]],
                      distributed: Sequence[Mapping[str, torch.Tensor]], tolerance: Tolerance,
                      *, buffers: Sequence[str] = (), ignored: Sequence[str] = ()) -> Comparison:
    """Compare two runs' tensors after each step (pure).

    Args:
        reference: the one-process run: for each step (0: initial), name -> tensor,
            in model order (parameters, then buffers).
        distributed: the same for the distributed run.
        tolerance: the elementwise rule, ``|distributed - single| <= atol +
            rtol * |single|``.
        buffers: which names are buffers (a buffer is named as the first
            divergence only when no parameter of that step is out of tolerance).
        ignored: names compared but never named as the first divergence.

    Returns:
        The :class:`Comparison`; a name on one side only, or with another shape,
        counts as an infinite difference.

    Raises:
        ValueError: the runs have different numbers of steps.
    """
    # Note [what is compared] and Note [first divergence] at the top of this file.
    if len(reference) != len(distributed):
        raise ValueError(f"the one-process run has {len(reference)} snapshots, the distributed run "
                         f"{len(distributed)}: compare the same steps")
    names: list[str] = []
    for snap in [*reference, *distributed]:
        names += [n for n in snap if n not in names]
    buffer_set, ignored_set = frozenset(buffers), frozenset(ignored)
    names.sort(key=lambda n: n in buffer_set)  # stable: model order within parameters and buffers
    diffs, excess = [], []
    first: Divergence | None = None
    for step, (ref, got) in enumerate(zip(reference, distributed)):
        row = [difference(ref.get(n), got.get(n), tolerance) for n in names]
        diffs.append(tuple(d for d, _ in row))
        excess.append(tuple(e for _, e in row))
        if first is None:
            out = [i for i, (_, e) in enumerate(row) if e > 1 and names[i] not in ignored_set]
            if out:
                # Parameters before buffers, then the furthest out; max() keeps the first of equals.
                worst = max(out, key=lambda i: (names[i] not in buffer_set, row[i][1]))
                first = Divergence(step, names[worst], row[worst][0], names[worst] in buffer_set)
    return Comparison(tuple(names), buffer_set, tuple(diffs), tuple(excess), first, ignored_set)
