"""Stages 0 to 2 of the memory planner: DDP, and ZeRO-1 and ZeRO-2 over DDP's
buckets (Note [stages 0 to 2 memory]), from the buckets DDP would plan
(:func:`ddp_bucket_plan`).

# Note [stages 0 to 2 memory]
The buckets are the ones DDP plans at construction (:func:`ddp_bucket_plan`);
every bucket is padded to a multiple of the world size ``w`` and the last one
carries one flag element (Note [flat buffer layout] in tandem/ddp/plan.py).
``params`` is every parameter of the model, frozen ones included, at every
stage. With ``F`` the flat bucket buffer (the non-solo buckets), ``G`` the
trainable parameters' bytes and ``M`` rank 0's owned elements (its shard of
each bucket without the padding; rank 0 owns the most):

- stage 0 ``grads``: ``F``, which DDP holds for the whole run and whose views
  are ``param.grad`` after a step (Note [gradients born in their bucket] in
  tandem/ddp/reduction.py), plus the ``param.grad`` of solo parameters (Note
  [solo buckets]: reduced in place, no bucket memory). Tensor-parallel
  parameters keep a ``param.grad`` of their own: ``G`` plus ``F``. With
  ``gradient_as_bucket_view`` nothing is solo: ``F`` only. A world of one
  builds no reducer: ``G`` only. ``reducing`` at stage 0: after
  ``zero_grad(set_to_none=True)`` backward makes fresh gradients that live
  beside ``F`` until it ends (``F`` again).
- stages 1 and 2 ``params``: the trainable parameters live in one flat buffer
  laid out as the gradient buckets (Note [parameters in their bucket] in
  tandem/zero/flat_params.py): ``F`` in place of ``G``, the frozen ones as they are.
- stages 1 and 2 ``grads``: the gradient shards ``F / w`` (``param.grad`` is
  freed at stage 2 as its bucket is launched, at stage 1 at the end of backward).
- stages 1 and 2 ``optimizer``: ``optimizer_bytes_per_param`` per owned
  element, plus fp32 master copies of the owned elements where the parameters
  are narrower than fp32 (fp32 ones are stepped where they live); stage 0:
  ``optimizer_bytes_per_param`` per trainable element.
- ``reducing``, during backward: the buckets' memory, taken as backward nears
  each and given back when it ends (Note [zero buckets] in
  tandem/ddp/reduction.py): ``F`` at most, the gradients accumulated into it,
  plus autograd's new gradient of one parameter before it is added in (the
  largest is counted).
- ``gathered``, during the ZeRO step: nothing of tandem's own: the all-gather of
  the updated parameters is in place.

Per-tensor scalars (Adam's step count, 4 bytes per tensor), the optimizer's
temporaries and the collectives' own scratch space are not counted. The
backward buffers and the step's gathers are never alive together: ``total``
adds the larger (and :meth:`MemoryEstimate.peak` adds activations to the
backward's).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.ddp.plan import BucketPlan, ParamInfo, cap_bytes_from_mb, plan_ddp_buckets
from tandem.planner.memory.estimate import MemoryEstimate

__all__ = ["ddp_bucket_plan", "stage0_estimate", "zero_stage_estimate"]


def ddp_bucket_plan(params: Sequence[ParamInfo], world_size: int, *, zero_stage: int = 0,
                    bucket_cap_mb: float | None = None, bucket_cap_mb_list: Sequence[float] | None = None,
                    gradient_as_bucket_view: bool = False, check_finite: bool = False) -> BucketPlan:
    """The buckets ``tandem.DistributedDataParallel`` plans at construction for
    the trainable ``params`` (in registration order), with the arguments its
    reducer passes (BucketGroup.build in tandem/ddp/bucket.py).

    DDP re-plans once after its first step (not at ZeRO stages, nor with
    ``find_unused_parameters`` without ``static_graph``), in the order the
    gradients arrived: the same parameters, grouped by the same caps.
    """
    return plan_ddp_buckets(params, list(reversed(range(len(params)))),
                            cap_bytes_from_mb(bucket_cap_mb, bucket_cap_mb_list), world_size,
                            zero=bool(zero_stage), gradient_as_bucket_view=gradient_as_bucket_view,
                            check_finite=check_finite)


def stage0_estimate(plan: BucketPlan, infos: list[ParamInfo], params: int, world_size: int,
            optimizer_bytes_per_param: int, as_view: bool, tensor_parallel: bool = False) -> MemoryEstimate:
    trainable = sum(p.nbytes for p in infos)
    flat = _flat_bytes(plan)
    reducing = 0
    if world_size == 1:
        grads = trainable   # a world of one builds no reducer (tandem/ddp/module.py: _needs_reducer)
    elif tensor_parallel:
        grads = trainable + flat  # their .grad stays a tensor of its own
    else:  # Note [gradients born in their bucket] in tandem/ddp/reduction.py: .grad is a view of F,
        # solo ones apart
        grads = flat + sum(b.numel * _itemsize(b.dtype) for b in plan.buckets if b.solo)
        # after zero_grad(set_to_none=True) backward makes fresh gradients, copied into F
        reducing = flat
    return MemoryEstimate(0, params=params, grads=grads, reducing=reducing,
                          optimizer=sum(p.numel for p in infos) * optimizer_bytes_per_param, buckets=plan)


def zero_stage_estimate(stage: int, plan: BucketPlan, infos: list[ParamInfo], params: int, world_size: int,
                optimizer_bytes_per_param: int) -> MemoryEstimate:
    flat = _flat_bytes(plan)
    shards = sum(n // world_size * _itemsize(dtype) for (_, dtype), n in plan.buffer_numel.items())
    owned = [(min(b.padded_numel // world_size, b.numel), b.dtype) for b in plan.buckets]  # rank 0's
    masters = sum(n * 4 for n, dtype in owned if torch.promote_types(dtype, torch.float32) != dtype)
    state = sum(n for n, _ in owned) * optimizer_bytes_per_param
    optimizer = masters + state
    trainable = sum(p.nbytes for p in infos)
    reducing = flat + max((p.nbytes for p in infos), default=0)
    rows = sum(n * _itemsize(dtype) for n, dtype in owned)
    return MemoryEstimate(stage, params=params - trainable + flat, grads=shards, optimizer=optimizer,
                          state=state, rows=rows, gathered=0, reducing=reducing, buckets=plan)


def _flat_bytes(plan: BucketPlan) -> int:
    """Bytes of the flat bucket buffers (solo buckets are in none)."""
    return sum(n * _itemsize(dtype) for (_, dtype), n in plan.buffer_numel.items())


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
