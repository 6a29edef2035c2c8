"""Which parameters make each fragment, and when each fragment syncs:
:func:`plan_fragments`, :func:`fragments_due`. Pure: sizes and step numbers in,
indices out.

# Note [fragments and their schedule]
Streaming DiLoCo cuts the model into fragments of about equal size, in the
model's order (consecutive parameters: consecutive layers), and syncs fragment
``f`` of ``F`` at the steps ``t`` (counted from 1) where ``t % H`` is
``((f + 1) * H // F) % H``: with one fragment, every ``H``-th step, as DiLoCo;
with ``F``, one fragment every ``H / F`` steps, the last at the ``H``-th. Each
fragment is still synced once every ``H`` steps, but the link carries one
fragment at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["fragments_due", "plan_fragments"]


def plan_fragments(numels: Sequence[int], count: int) -> list[list[int]]:
    """The parameters' indices in ``count`` runs of consecutive parameters of
    about equal total size (none empty while there are parameters enough)."""
    if count < 1:
        raise ValueError(f"fragments must be >= 1, got {count}")
    if count > len(numels):
        raise ValueError(f"fragments={count} is more than the model's {len(numels)} parameters: "
                         "each fragment holds whole parameters")
    total = sum(numels)
    out: list[list[int]] = [[] for _ in range(count)]
    seen, previous = 0.0, 0
    for i, n in enumerate(numels):
        middle = (seen + n / 2) / total if total else (i + 0.5) / len(numels)
        f = min(count - 1, int(middle * count))  # the fragment whose share the parameter's middle is in
        f = min(f, previous + 1) if i else 0  # none skipped
        f = max(f, previous, count - (len(numels) - i))  # enough parameters left for the others
        out[f].append(i)
        seen, previous = seen + n, f
    return out


def fragments_due(step: int, sync_every: int, count: int) -> list[int]:
    """The fragments that sync at ``step`` (counted from 1) (Note [fragments and their schedule])."""
    return [f for f in range(count) if step % sync_every == ((f + 1) * sync_every // count) % sync_every]
