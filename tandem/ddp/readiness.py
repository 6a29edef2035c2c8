"""Readiness: a parameter's gradient is final for this backward, so it is
copied into its bucket (or left for the bucket to copy in one batch, Note [copy
granularity] in bucket.py) and marked; a parameter that gets no gradient is
marked with what its ``.grad`` holds; a complete bucket goes to launch.py."""

from __future__ import annotations

from typing import cast

import torch

from tandem.ddp.bucket import Bucket, BucketState
from tandem.ddp.errors import gradient_twice
from tandem.ddp.launch import Launching

__all__ = ["Readiness"]


class Readiness(Launching):
    """The reducer's third layer: gradients marked ready in their buckets."""

    def _ready(self, i: int) -> bool:
        """Parameter i's gradient is final for this backward: copy it in (or leave
        that to its bucket, Note [copy granularity] in bucket.py), mark it, launch what can go.
        Returns whether it was newly marked."""
        b, pos = self._where[i]
        bucket = self.buckets[b]
        if bucket.ready[pos] or bucket.state is not BucketState.FILLING:
            self._ready_again(i, bucket, pos)
            return False
        if bucket.copies_per_param and not (bucket.single and self._in_place):
            bucket.copy_in(pos, self._div, self._as_view)  # (in place: at launch)
        bucket.mark_ready(pos)
        if bucket.complete:
            self._launch_complete()
        return True

    def _ready_again(self, i: int, bucket: Bucket, pos: int) -> None:
        """A second gradient for a parameter in one backward. Harmless while its
        bucket still fills and the gradient is a separate tensor (copy the sum
        again); otherwise the first one was already taken."""
        if bucket.state is BucketState.FILLING and bucket.ready[pos]:
            if bucket.copies_per_param and bucket.grad_is_view(pos):
                if pos in bucket.deferred:
                    return  # autograd added to the view again; scaled at launch
            else:
                if bucket.copies_per_param and not (bucket.single and self._in_place):
                    bucket.copy_in(pos, self._div, self._as_view)
                return
        raise RuntimeError(gradient_twice(self.comm.rank, self.names[i], bucket.index))

    def _mark_unused(self, i: int) -> None:
        """Parameter i gets no gradient in this backward: it contributes its current
        .grad (zeros when None, as torch), and is not counted as used."""
        b, pos = self._where[i]
        bucket = self.buckets[b]
        if not bucket.ready[pos]:
            if self._rebind and bucket.grad_is_view(pos):
                # Its .grad must stay as it was (Note [gradients born in their
                # bucket] in write_back.py): the bucket takes a copy, scaled, and .grad its own tensor.
                p = self.params[i]
                p.grad = cast(torch.Tensor, p.grad).clone()
            self._ready(i)
