"""A flag that lives on a CUDA device, read by the host one step late, so that
reading it never stops the host (Note [late flag]).

# Note [late flag]
The missing-gradient flag (Note [missing-gradient flag] in reducer.py) is summed
by the last bucket's reduction. On CPU it is read at the end of backward. On a
CUDA device that read (``float(flag)``) would make the host wait until the GPU
has run the whole backward and the reduction: every step would lose the host's
lead over the GPU (the GPU then idles while the host queues the optimizer's
step and the next forward), and ``torch.cuda.set_sync_debug_mode("error")``
rejects it. So on CUDA the flag is copied into pinned host memory without
waiting (``non_blocking``), an event is recorded after the copy, and the host
reads it at the end of the next synchronised backward, after waiting for that
event. By then the GPU has long finished the copy (it was queued before the
optimizer's step and the whole next forward), so the wait returns at once
while the GPU still has the next step's work queued. Read at the next forward
instead, the wait would come just after the optimizer's step was queued, while
the GPU may still be running the backward, and the GPU would idle while the host
queues the forward.

The check is kept: every rank sees the same sum at the same point, after every
bucket of the next backward was reduced, so every rank raises the same error
there, one step later than on CPU (torch reports a missing gradient at the
next forward). The step whose gradient was missing was taken with zeros for
it, as the other ranks reduced them.
"""

from __future__ import annotations

import torch

__all__ = ["LateFlag"]


class LateFlag:
    """One device flag in flight to the host, with what to report if it is set."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None   # pinned, reused every step
        self._event: torch.cuda.Event | None = None
        self._names: list[str] = []

    def post(self, flag: torch.Tensor, names: list[str]) -> None:
        """Queue the copy of ``flag`` (one element on a CUDA device) to the host;
        ``names``: this rank's parameters without a gradient, for the error."""
        if self._host is None or self._host.dtype != flag.dtype:
            self._host = torch.empty(1, dtype=flag.dtype, pin_memory=True)
        self._host.copy_(flag.reshape(1), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._event, self._names = event, names

    def take(self) -> list[str] | None:
        """The names posted with a flag that was set (waiting for its copy, done
        long before in practice), or None when it was not set or nothing is
        posted; clears the post."""
        if self._event is None:
            return None
        assert self._host is not None
        self._event.synchronize()
        self._event = None
        return self._names if float(self._host[0]) > 0 else None
