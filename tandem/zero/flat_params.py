"""A ZeRO model's parameters as views of flat buffers laid out as its gradient
buckets, so that each rank steps its shard where the parameters live and the
all-gather writes the others' shards there too (Note [parameters in their bucket]).

# Note [parameters in their bucket]
Under ZeRO stages 1 and 2 each rank steps a contiguous shard of every bucket
(Note [shard runs] in optimizer.py) and then every rank needs every shard. With
the parameters as separate tensors, that took a master copy of the shard (even
when the parameters are fp32 already: 1/N of the model per rank, held for the
whole run), an input for the all-gather (the shard again), an output of the
bucket's size and a copy from it into the parameters: about one model's worth
of memory in the step, and two passes over it.

:class:`FlatParams` makes one flat buffer per (device, dtype), laid out exactly
as the gradient buffer (Note [flat buffer layout] in tandem/ddp/plan.py), and
points every trainable parameter of a bucket at its slice (``param.data`` is
set; the Parameter, its hooks and its gradient accumulator stay the same
objects). Then:

* a run of the shard is a stretch of that memory, so where the parameters are
  fp32 (or wider) the optimizer steps it in place: the run's master *is* the
  parameters' memory, with no copy (Note [shard runs]); narrower parameters
  keep an fp32 master, copied into the shard before the gather;
* the all-gather is in place: its input is this rank's shard of the bucket's
  slice and its output the slice itself (NCCL and gloo allow it), and nothing
  is copied back afterwards.

What stays true of the parameters: their values, shapes, dtypes and devices;
``load_state_dict`` and in-place writes go into the flat buffer as before. What
differs: a parameter's memory is part of a larger buffer (``torch.save`` of one
parameter alone saves its whole buffer), a non-contiguous parameter (a
channels-last weight) becomes contiguous, and ``param.data = other`` unbinds a
parameter: the next step sees it (:meth:`FlatParams.bind`, one pointer compared
per parameter) and copies its new values in, rather than stepping stale memory.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.ddp.plan import BucketSpec

__all__ = ["FlatParams"]


class FlatParams:
    """The trainable parameters of ``reducer``'s buckets as views of flat buffers.

    Args:
        reducer: the ZeRO model's reducer (its plan and parameters).
        rank: this rank in the model's group.
        world_size: the group's size.
    """

    def __init__(self, reducer: Any, rank: int, world_size: int) -> None:
        self._params: list[torch.nn.Parameter] = reducer.params
        self._plan = reducer.plan
        self._rank, self._world = rank, world_size
        self.flat: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {
            key: torch.zeros(n, dtype=key[1], device=key[0]) for key, n in self._plan.buffer_numel.items()}
        # parameter index -> (its bucket, its offset there); -> where its memory starts
        self._slot: dict[int, tuple[BucketSpec, int]] = {
            i: (spec, offset) for spec in self._plan.buckets for i, offset in zip(spec.params, spec.offsets)}
        self._where: dict[int, int] = {}
        for i in self._slot:
            self._bind(i)

    def bucket(self, spec: BucketSpec) -> torch.Tensor:
        """The padded slice of bucket ``spec``: every rank's shard of its parameters."""
        return self.flat[(spec.device, spec.dtype)].narrow(0, spec.buffer_offset, spec.padded_numel)

    def shard(self, spec: BucketSpec) -> torch.Tensor:
        """This rank's shard of bucket ``spec``."""
        size = spec.padded_numel // self._world
        return self.bucket(spec).narrow(0, self._rank * size, size)

    def run(self, spec: BucketSpec, start: int, length: int) -> torch.Tensor:
        """A leaf tensor on elements ``[start, start + length)`` of this rank's
        shard of ``spec``: what an optimizer steps in place (a view would not
        be a leaf once it requires grad)."""
        shard = self.shard(spec)
        leaf = torch.empty(0, dtype=shard.dtype, device=shard.device)
        return leaf.set_(shard.untyped_storage(), shard.storage_offset() + start, (length,), (1,))

    def bind(self) -> None:
        """Point every parameter that no longer lives in its bucket (``param.data``
        was set) back at it, its current values copied in. Call before a step."""
        params = self._params
        for i, ptr in self._where.items():
            if params[i].data_ptr() != ptr:
                self._bind(i)

    @torch.no_grad()
    def _bind(self, i: int) -> None:
        spec, offset = self._slot[i]
        p = self._params[i]
        view = self.bucket(spec).narrow(0, offset, p.numel())
        view.copy_(p.detach().reshape(-1))
        p.data = view.view(p.shape)
        self._where[i] = p.data_ptr()
