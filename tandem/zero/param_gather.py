"""ZeroOptimizer's parameter all-gathers: each rank's updated shard of a bucket
sent to every rank, into the parameters' own memory, at the end of ``step()``
or, with ``overlap_param_gather``, before the first module of the next forward
that uses the bucket."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tandem.comm.group import GroupComm, Work
from tandem.zero.shards import ZeroShards

__all__ = ["ParamGather", "register_gather_hooks"]


class ParamGather:
    """The all-gathers of one ZeroOptimizer's updated shards, and their waits.

    Args:
        reducer: the DDP model's reducer (its plan and parameters).
        comm: the model's group.
        shards: this rank's shards, whose updated values are sent.
        module: the wrapped module, given a forward pre-hook per module with
            ``overlap``: it waits for the gathers of its own parameters only.
        overlap: leave the gathers in flight after ``step()``.
    """

    def __init__(self, reducer: Any, comm: GroupComm, shards: ZeroShards, module: torch.nn.Module,
                 *, overlap: bool) -> None:
        self._reducer, self._comm, self._shards = reducer, comm, shards
        self.overlap = overlap
        self._pending: dict[int, Work] = {}  # bucket -> gather in flight
        self.hooks: list[Any] = register_gather_hooks(module, reducer, self.finish) if overlap else []

    @torch.no_grad()
    def launch(self, bucket: int) -> None:
        """Start the all-gather of this rank's updated shard of ``bucket`` (every
        rank launches them in bucket order)."""
        spec = self._reducer.plan.buckets[bucket]
        # In place (Note [parameters in their bucket] in flat_params.py): the
        # shard is a slice of the bucket's parameters, which the others' fill.
        work = self._comm.all_gather_into(self._shards.flat.bucket(spec), self._shards.updated(bucket),
                                          tag=f"params {spec.index}", async_op=True)
        self._pending[spec.index] = work

    def finish(self, bucket: int) -> None:
        """Wait for ``bucket``'s gather, if in flight: it wrote the parameters."""
        work = self._pending.pop(bucket, None)
        if work is not None:
            work.wait()

    def finish_all(self) -> None:
        for bucket in sorted(self._pending):
            self.finish(bucket)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Remove the hooks; gathers still in flight are abandoned, not waited for."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
        self._pending.clear()


def register_gather_hooks(module: torch.nn.Module, reducer: Any,
                           finish: Callable[[int], None]) -> list[Any]:
    """Forward pre-hooks: a module waits only for the buckets of its own parameters."""
    bucket_of = {id(reducer.params[i]): b.index for b in reducer.plan.buckets for i in b.params}
    handles = []
    for sub in module.modules():
        buckets = sorted({bucket_of[id(p)] for p in sub.parameters(recurse=False) if id(p) in bucket_of})
        if buckets:
            handles.append(sub.register_forward_pre_hook(_GatherHook(finish, buckets)))
    return handles


class _GatherHook:
    """Wait for the all-gathers of ``buckets`` before the module's forward. Copies
    as a no-op (Note [copying a ZeroOptimizer] in optimizer.py): the copy belongs to another model."""

    def __init__(self, finish: Callable[[int], None], buckets: list[int]) -> None:
        self.finish = finish
        self.buckets = buckets

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        for b in self.buckets:
            self.finish(b)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_CopiedGatherHook, ())


class _CopiedGatherHook:
    """What a module's copy holds in place of a :class:`_GatherHook`: nothing to wait for."""

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        return None
