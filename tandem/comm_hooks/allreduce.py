"""The default hook: average each bucket with one all-reduce."""

# Annotations stay evaluated (no ``from __future__ import annotations``): torch's
# DDP compares a hook's ``bucket`` and return annotations with dist.GradBucket and
# Future[Tensor] by value, so that these hooks also work on torch's DDP.
from typing import Any

import torch
import torch.distributed as dist

from tandem.comm_hooks._comm import hook_comm

__all__ = ["allreduce_hook"]


def allreduce_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across the group: what DDP does without a hook.

    The bucket is scaled by ``1 / world_size`` before the sum, exactly as tandem's
    DDP scales gradients without a hook, so the result is bit-identical to
    registering no hook at all (torch's ``allreduce_hook`` divides instead, which
    differs in the last bit for world sizes that are not powers of two).

    Args:
        state: ``None`` (the DDP's group), a ``ProcessGroup`` or a ``GroupComm``.
        bucket: the ``GradBucket`` to reduce.

    Returns:
        A future holding the averaged bucket (the bucket's own buffer).
    """
    comm = hook_comm(state, bucket)
    buffer = bucket.buffer()
    buffer.mul_(1.0 / comm.size)
    work = comm.all_reduce(buffer, tag=f"hook allreduce bucket {bucket.index()}", async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# One collective per bucket, issued from the caller's thread (Note [hook order]
# in tandem/ddp/grad_bucket.py): buckets may be in flight together.
allreduce_hook.tandem_single_collective = True  # type: ignore[attr-defined]
