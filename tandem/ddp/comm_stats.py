"""What the reducer measures of its communication: :class:`CommStats`, the
bytes of the gradient collectives and the time the end of backward waited."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.comm.group import CollectiveEvent

__all__ = ["CommStats", "gradient_bytes"]


@dataclass(frozen=True)
class CommStats:
    """Gradient communication of one synchronised backward, on this rank."""

    bytes: int
    """Payload bytes of the gradient collectives issued through tandem's comm layer
    (hooks that call torch.distributed directly are not seen)."""
    wait_s: float
    """Seconds the end of backward spent waiting for reductions to finish."""


def gradient_bytes(event: CollectiveEvent) -> int:
    """Payload bytes of a gradient collective (a bucket's, or one a communication
    hook issued through tandem's comm layer); 0 for any other collective."""
    tag = getattr(event, "tag", "")
    if tag.startswith("bucket") or tag.startswith("hook"):
        return event.numel * (event.dtype.itemsize if event.dtype is not None else 0)
    return 0
