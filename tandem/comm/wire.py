"""What a rank sends for a collective: :func:`sent_bytes`.

The ledger records each collective's payload, the bytes this rank handed to
it. What crosses the network depends on the algorithm; with the
bandwidth-optimal ones (a ring or pairwise exchange, which gloo and NCCL use
for large tensors) a rank of a group of ``W`` sends:

    all_reduce       2 (W-1)/W x payload     (reduce-scatter, then all-gather)
    reduce_scatter     (W-1)/W x payload     (the input: W chunks)
    all_to_all         (W-1)/W x payload     (every chunk but its own)
    all_gather_into    (W-1)   x payload     (the input: this rank's chunk)
    all_gather         (W-1)   x payload
    broadcast          payload               (on average, along a ring or tree)

It is an estimate for comparing strategies (a quantized average against an
fp32 all-reduce), not a measurement: small tensors go by other algorithms, and
the benchmarks over namespaced nodes count the link's own bytes.
"""

from __future__ import annotations

__all__ = ["sent_bytes"]

_FACTORS = {"all_reduce": lambda w: 2 * (w - 1) / w, "reduce_scatter": lambda w: (w - 1) / w,
            "all_to_all": lambda w: (w - 1) / w, "all_gather_into": lambda w: w - 1.0,
            "all_gather": lambda w: w - 1.0, "broadcast": lambda w: 1.0}


def sent_bytes(op: str, payload: int, size: int) -> float:
    """Bytes a rank sends for collective ``op`` of ``payload`` bytes in a group of ``size``
    (0 in a group of one; the payload itself for an op not listed)."""
    if size <= 1:
        return 0.0
    factor = _FACTORS.get(op)
    return payload * (factor(size) if factor is not None else 1.0)
