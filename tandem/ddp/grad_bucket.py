"""What a communication hook sees of a bucket: torch's ``dist.GradBucket`` interface.

A hook written for torch's DDP that only uses this interface and
``torch.distributed`` calls works unchanged with tandem's.

# Note [hook order]
A communication hook may issue more than one collective per bucket, the later
ones from future callbacks (torch's PowerSGD does). Those callbacks run when the
earlier collective completes, on the backend's thread, so with several buckets
in flight their collectives interleave differently on different ranks, and gloo
aborts ("Received data size doesn't match expected size"). Unless a hook is
known to issue exactly one collective from the caller's thread (torch's
allreduce/fp16/bf16 hooks and tandem's hooks marked ``tandem_single_collective``),
bucket k's hook is called only after bucket k-1's future has completed: the
order is then the same on every rank, whatever the timing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tandem.comm.group import GroupComm
from tandem.ddp.bucket import Bucket

__all__ = ["CommHook", "GradBucket", "HookWork", "issues_one_collective"]

CommHook = Callable[[Any, "GradBucket"], "torch.futures.Future[torch.Tensor]"]


class GradBucket:
    """One bucket's flattened, not yet averaged gradients (torch's GradBucket API)."""

    def __init__(self, bucket: Bucket, is_last: bool, comm: GroupComm | None = None) -> None:
        self._bucket = bucket
        self._buffer = bucket.grads
        self._is_last = is_last
        self._comm = comm

    @property
    def comm(self) -> GroupComm | None:
        """tandem only: the collectives layer the DDP reduces over. Hooks that issue
        through it (tags starting with "hook") are counted in ``ddp.comm_stats``;
        tandem's built-in hooks use it when their state names no other group."""
        return self._comm

    def index(self) -> int:
        """The bucket's index; bucket 0 holds the last parameters to be registered."""
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D tensor of this bucket's gradients (not divided by the world size)."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient, as views of :meth:`buffer` shaped like the parameter."""
        return [self._buffer.narrow(0, off, view.numel()).view_as(view)
                for off, view in zip(self._bucket.spec.offsets, self._bucket.views)]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        """Whether this is the last bucket to be reduced in this backward."""
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the buffer that :meth:`buffer` and :meth:`gradients` return."""
        if buffer.numel() != self._bucket.grads.numel():
            raise ValueError(f"set_buffer: bucket {self.index()} holds {self._bucket.grads.numel()} "
                             f"elements, got a tensor of {buffer.numel()}")
        self._buffer = buffer


class HookWork:
    """A hook's future as a bucket's pending reduction; :meth:`wait` puts the
    future's value (the reduced gradients) into the bucket."""

    def __init__(self, future: torch.futures.Future, bucket: Bucket, hook_name: str) -> None:
        if not callable(getattr(future, "wait", None)):  # torch.futures.Future or torch._C.Future
            raise TypeError(f"communication hook {hook_name} must return a torch.futures.Future "
                            f"holding the bucket's reduced gradients, got {type(future).__name__}")
        self._future = future
        self._bucket = bucket
        self._hook_name = hook_name

    def await_hook(self) -> None:
        """Block until the hook's work (with all its chained callbacks) is done; a
        failure is raised by :meth:`wait`, where the reducer collects the buckets."""
        try:
            self._future.wait()
        except Exception:  # noqa: BLE001 - raised again by wait()
            pass

    def wait(self) -> None:
        value = self._future.wait()
        if isinstance(value, (list, tuple)):
            value = value[0]
        grads = self._bucket.grads
        if not isinstance(value, torch.Tensor) or value.numel() != grads.numel():
            raise RuntimeError(
                f"communication hook {self._hook_name} returned "
                f"{type(value).__name__ if not isinstance(value, torch.Tensor) else tuple(value.shape)}"
                f" for bucket {self._bucket.index}; it must be a tensor of {grads.numel()} elements")
        if value.data_ptr() != grads.data_ptr():
            grads.copy_(value.reshape(-1))


def issues_one_collective(hook: object) -> bool:
    """Whether ``hook`` issues exactly one collective per bucket, from the caller's
    thread, so that buckets may be in flight together (Note [hook order])."""
    if getattr(hook, "tandem_single_collective", False):
        return True
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    return hook in (default_hooks.allreduce_hook, default_hooks.fp16_compress_hook,
                    default_hooks.bf16_compress_hook)
