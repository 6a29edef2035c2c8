"""PowerSGD's pure parts: which gradients of a bucket to compress and where their
factors live (a function of shapes alone), and the orthogonalisation step.

# Note [low-rank layout]
A gradient of shape ``(n, ...)`` is viewed as an ``n x m`` matrix (``m`` the
product of the other dimensions) and approximated as ``P @ Q.T`` with ``P`` of
``n x r`` and ``Q`` of ``m x r``, ``r = min(n, m, matrix_rank)``. That sends
``(n + m) * r`` numbers instead of ``n * m``; it is worth it only when
``(n + m) * r * min_compression_rate < n * m``. Vectors (biases, norms), scalars
and small matrices fail that test and travel uncompressed, all of a bucket's
in one flat tensor. The bucket's first collective carries
``[uncompressed | P of every compressed matrix]``; its second, the ``Q``s. Both
layouts are fixed by the shapes, so every rank agrees on them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["LowRankPlan", "MatrixSlot", "orthogonalize_", "plan_low_rank"]


@dataclass(frozen=True)
class MatrixSlot:
    """One compressed gradient: its position in the bucket and its factors' places."""

    index: int       # position among the bucket's gradients
    rows: int        # n
    cols: int        # m
    rank: int        # r = min(n, m, matrix_rank)
    p_offset: int    # start of its n x r P in the bucket's P region
    q_offset: int    # start of its m x r Q in the bucket's Q tensor


@dataclass(frozen=True)
class LowRankPlan:
    """How one bucket's gradients travel (Note [low-rank layout])."""

    compressed: tuple[MatrixSlot, ...]
    uncompressed: tuple[int, ...]     # positions of the gradients sent as they are
    uncompressed_numel: int
    p_numel: int
    q_numel: int
    total_numel: int                  # the bucket's elements, uncompressed

    @property
    def numel_on_wire(self) -> int:
        """Elements this rank all-reduces per step for the bucket."""
        return self.uncompressed_numel + self.p_numel + self.q_numel


def plan_low_rank(shapes: Sequence[Sequence[int]], matrix_rank: int,
                  min_compression_rate: float) -> LowRankPlan:
    """Decide, for gradients of ``shapes`` (one bucket, in order), which to compress.

    Args:
        shapes: the gradients' shapes.
        matrix_rank: the approximation's rank ``r`` (at most ``min(n, m)`` is used).
        min_compression_rate: compress only if ``n * m > (n + m) * r * rate``.

    Returns:
        The layout of Note [low-rank layout].
    """
    compressed: list[MatrixSlot] = []
    uncompressed: list[int] = []
    unc = p = q = total = 0
    for i, shape in enumerate(shapes):
        numel = math.prod(shape)
        total += numel
        if len(shape) >= 2 and numel > 0:
            n = shape[0]
            m = numel // n
            r = min(n, m, matrix_rank)
            if (n + m) * r * min_compression_rate < n * m:
                compressed.append(MatrixSlot(i, n, m, r, p, q))
                p += n * r
                q += m * r
                continue
        uncompressed.append(i)
        unc += numel
    return LowRankPlan(tuple(compressed), tuple(uncompressed), unc, p, q, total)


def orthogonalize_(matrix: torch.Tensor, epsilon: float = 0.0) -> None:
    """Make the columns of ``matrix`` (``n x r``, ``r <= n``) orthonormal, in place.

    Gram-Schmidt for ``r <= 2`` and half types (QR has no half kernels), QR
    otherwise. In Gram-Schmidt, a column that is zero (or becomes zero: it
    depended on the earlier ones) stays zero rather than turning into NaN: a
    gradient that is all zeros on every rank, as an unused parameter's, then
    decompresses to zeros.

    Args:
        matrix: the ``n x r`` matrix to orthogonalise.
        epsilon: added to each column's norm before dividing by it.
    """
    rank = matrix.shape[1]
    if rank > 2 and matrix.dtype not in (torch.float16, torch.bfloat16):
        # For a rank-deficient matrix QR completes the basis with some orthonormal
        # columns: the projection P P^T M then keeps more of M, never less.
        matrix.copy_(torch.linalg.qr(matrix).Q)
        return
    for i in range(rank):
        col = matrix[:, i:i + 1]
        norm = torch.linalg.vector_norm(col)
        if epsilon:
            col.div_(norm + epsilon)
        else:
            col.mul_(torch.where(norm > 0, norm.reciprocal(), torch.zeros_like(norm)))
        if i + 1 < rank:
            rest = matrix[:, i + 1:]
            rest.sub_(col @ (col.T @ rest))
