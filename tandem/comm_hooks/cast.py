"""Compression by casting: send each bucket as fp16 or bf16 (half the bytes).

Arithmetic, as torch's ``fp16_compress_hook``/``bf16_compress_hook``: cast the
bucket to the half type, divide by the world size (before the sum, so that the
sum of ``world_size`` gradients cannot overflow where one does not), all-reduce,
and copy the result back into the bucket, which casts it back to the bucket's
dtype. The results are bit-identical to torch's hooks.
"""

# Annotations stay evaluated (no ``from __future__ import annotations``): torch's
# DDP compares a hook's ``bucket`` and return annotations with dist.GradBucket and
# Future[Tensor] by value, so that these hooks also work on torch's DDP.
from typing import Any

import torch
import torch.distributed as dist

from tandem.comm_hooks._comm import hook_comm

__all__ = ["bf16_compress_hook", "fp16_compress_hook"]


def fp16_compress_hook(state: Any,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in ``torch.float16``: half the bytes of fp32.

    Warning:
        The fp16 format holds magnitudes up to 65504 and flushes values below about
        6e-8 to zero: gradients outside that range become inf or 0 in the cast.
        ``bf16_compress_hook`` keeps fp32's range, with fewer mantissa bits.

    Args:
        state: ``None`` (the DDP's group), a ``ProcessGroup`` or a ``GroupComm``.
        bucket: the ``GradBucket`` to reduce.

    Returns:
        A future holding the averaged bucket, decompressed into its own buffer.
    """
    return _cast_reduce(torch.float16, state, bucket)


def bf16_compress_hook(state: Any,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in ``torch.bfloat16``: half the bytes of fp32, fp32's range.

    Works on any backend that all-reduces bf16, gloo on CPU included (torch's own
    ``bf16_compress_hook`` is refused by torch's DDP unless it runs on NCCL 2.10+).

    Args:
        state: ``None`` (the DDP's group), a ``ProcessGroup`` or a ``GroupComm``.
        bucket: the ``GradBucket`` to reduce.

    Returns:
        A future holding the averaged bucket, decompressed into its own buffer.
    """
    return _cast_reduce(torch.bfloat16, state, bucket)


def _cast_reduce(dtype: torch.dtype, state: Any,
                 bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    comm = hook_comm(state, bucket)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(comm.size)
    name = "fp16" if dtype == torch.float16 else "bf16"
    work = comm.all_reduce(compressed, tag=f"hook {name} bucket {bucket.index()}", async_op=True)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        # In place, so the bucket's memory is reused (torch does the same).
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(decompress)


# One collective per bucket, from the caller's thread; the callback only copies
# (Note [hook order] in tandem/ddp/grad_bucket.py).
fp16_compress_hook.tandem_single_collective = True  # type: ignore[attr-defined]
bf16_compress_hook.tandem_single_collective = True  # type: ignore[attr-defined]
