"""The averaged gradients handed to ``param.grad``: copied back into the
gradients autograd made, or ``param.grad`` left as its view of the reduced
bucket (Note [gradients born in their bucket]), with the checks that keep a
gradient the user kept from being overwritten.

# Note [gradients born in their bucket]
Averaged gradients are not copied back to ``param.grad``: after a synchronised
step, ``param.grad`` is the parameter's view of its reduced bucket (as under
torch's ``gradient_as_bucket_view=True``), so the copy back is gone; and where
the user keeps gradients between steps (``zero_grad(set_to_none=False)``,
accumulation under no_sync) autograd accumulates straight into the bucket and
the copy in is gone too: the bucket is scaled in place at launch
(``Bucket.deferred`` for a view that may still receive a second gradient).
After ``zero_grad(set_to_none=True)`` autograd makes a fresh gradient, which is
copied in (scaled) as before. What torch's default lets a user observe stays true:

* a tensor the user assigned to ``param.grad`` before the forward stays
  ``param.grad`` and receives the average by copy (``_foreign``);
* a parameter unused in a backward keeps its ``.grad`` untouched (it gets a
  tensor of its own before its bucket, which it shared, is scaled: ``_mark_unused``);
* an old gradient the user kept (``g = p.grad``, or a view of it) is never
  overwritten: at the start of each synchronised backward, before any bucket is
  written, the reducer checks that nothing outside it holds the buckets' memory
  (the buffer's storage use count, and the Python references of each view that
  its parameter no longer holds: ``_escaped``) and otherwise moves the buckets to
  new memory (``_rebase``), which the kept tensors no longer share.

The fresh gradients that the views replace are freed at the start of the next
forward (``_retired``), not at the end of backward: that is when torch frees
them (``zero_grad(set_to_none=True)``), and the forward's activations then reuse
their memory. Freed at the end of backward, 40 MB at once, glibc trims the top
of its heap and the next backward faults every page of its fresh gradients back
in: on the benchmark transformer 5,000-10,000 minor page faults and about 20 ms
per step, depending on the process's allocation history (BENCHMARKS.md, "page
faults"). Peak memory is the same either way (backward holds both); between a
step and the next forward the process holds what torch's DDP holds.

What differs: ``param.grad`` is a view of a larger buffer (``torch.save`` of a
lone ``.grad`` saves the buffer; ``.grad.data_ptr()`` points into the bucket).
Not under ZeRO, gradient_as_bucket_view (which binds views its own way),
check_finite (a step may be dropped after the buckets are written), a fused
optimizer, distributed autograd, solo buckets (Note [in-place reduction] in reduction.py: they
have no bucket memory) or tensor-parallel parameters: there the copy back stays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from tandem._compat import foreach_copy_
from tandem.ddp.bucket import Bucket, GradBuffer
from tandem.ddp.fused import BucketStepper
from tandem.dtensor import local_grad, set_local_grad

__all__ = ["GradDelivery", "bind_views", "foreign_grads", "views_escaped", "write_back"]


class GradDelivery:
    """How a reduced bucket's averages reach ``param.grad``: copied back, bound as
    the bucket's views (``gradient_as_bucket_view``, a fused optimizer's own), or
    left bound where they were born (Note [gradients born in their bucket]).
    Which is chosen when the reducer is built; whether views may stay bound, at
    each forward (not inside a distributed autograd context)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], *, as_view: bool, born: bool) -> None:
        self.params = params
        self.as_view = as_view
        self.born = born        # views may stay bound at all (else the copy back stays)
        self.rebind = False     # this step: views stay bound
        self.foreign: set[int] = set()         # params whose .grad is the user's tensor: copied into
        self.retired: list[torch.Tensor] = []  # backward's fresh gradients, until the next forward

    def arm(self, buckets: Sequence[Bucket], *, rebind: bool) -> None:
        self.rebind = self.born and rebind
        if self.rebind:
            self.foreign = foreign_grads(buckets)

    def deliver(self, bucket: Bucket, globally_used: list[int] | None, stepper: BucketStepper | None) -> None:
        if bucket.reduced_on_grad:
            return  # param.grad holds the average already (Note [in-place reduction] in reduction.py)
        if self.rebind and bucket.bindable:
            bind_views(bucket, self.params, globally_used, self.foreign, self.retired)
            return
        write_back(bucket, self.params, globally_used, as_view=self.as_view, stepper=stepper)


def _bindable(buckets: Sequence[Bucket]) -> list[Bucket]:
    """Buckets whose views param.grad may be left bound to (Note [gradients born
    in their bucket])."""
    return [b for b in buckets if b.bindable]


def foreign_grads(buckets: Sequence[Bucket]) -> set[int]:
    """The parameters whose ``.grad`` is a tensor of the user's, not their view:
    the average is copied into it (``_foreign`` in Note [gradients born in their bucket])."""
    return {i for b in _bindable(buckets) for i, p, v in zip(b.spec.params, b.params, b.views)
            if (g := p.grad) is not None and g is not v}


def views_escaped(buffer: GradBuffer, buckets: Sequence[Bucket]) -> bool:
    """Whether something outside the reducer holds memory of the buckets that
    the coming step will write: a view derived from an old .grad (the buffer's
    use count), or an old .grad itself that the parameter no longer holds."""
    return buffer.escaped() or any(b.views_held_elsewhere() for b in _bindable(buckets))


def write_back(bucket: Bucket, params: Sequence[torch.Tensor], globally_used: list[int] | None, *,
               as_view: bool, stepper: BucketStepper | None) -> None:
    """Copy a reduced bucket's averages into ``param.grad`` (or bind ``param.grad``
    to its view, under ``gradient_as_bucket_view`` or for a fused optimizer's own)."""
    if not as_view and stepper is None and globally_used is None:
        grads = bucket.local_grads()
        if all(g is not None for g in grads):  # the common case, in one call
            foreach_copy_(cast("list[torch.Tensor]", grads), bucket.views)
            return
    copy_dst, copy_src = [], []
    for pos, i in enumerate(bucket.spec.params):
        if globally_used is not None and not globally_used[i]:
            continue  # unused on every rank: .grad stays as it was, like torch
        p, view = params[i], bucket.views[pos]
        grad = local_grad(p)
        if as_view or (stepper is not None and stepper.owns(i)):
            if grad is None or grad.data_ptr() != view.data_ptr():
                set_local_grad(p, view)
        elif grad is None:
            set_local_grad(p, view.clone())
        else:
            copy_dst.append(grad)
            copy_src.append(view)
    if copy_dst:
        foreach_copy_(copy_dst, copy_src)


def bind_views(bucket: Bucket, params: Sequence[torch.Tensor], globally_used: list[int] | None,
               foreign: set[int], retired: list[torch.Tensor]) -> None:
    """Note [gradients born in their bucket]: param.grad becomes (or stays) its
    view of the reduced bucket; a tensor the user gave as .grad gets a copy."""
    copy_dst, copy_src = [], []
    for i, view in zip(bucket.spec.params, bucket.views):
        if globally_used is not None and not globally_used[i]:
            continue  # unused on every rank: .grad stays as it was, like torch
        p = params[i]
        grad = p.grad
        if grad is view:
            continue
        if grad is not None and i in foreign:
            copy_dst.append(grad)
            copy_src.append(view)
        else:
            if grad is not None:
                retired.append(grad)
            p.grad = view
    if copy_dst:
        foreach_copy_(copy_dst, copy_src)
