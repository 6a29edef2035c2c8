"""ZeroOptimizer's parameter all-gathers: each rank's updated shard of a bucket
sent to every rank and written into the parameters, at the end of ``step()``
or, with ``overlap_param_gather``, before the first module of the next forward
that uses the bucket; the second of ZeroOptimizer's layers (optimizer.py lists
them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tandem._compat import foreach_copy_
from tandem.zero.optimizer_base import ZeroBase

__all__ = ["ParamGather", "register_gather_hooks"]


class ParamGather(ZeroBase):
    """ZeroOptimizer's second layer: ``launch_gather`` and ``finish_param_gather``."""

    @torch.no_grad()
    def launch_gather(self, bucket: int) -> None:
        """Start the all-gather of this rank's updated shard of ``bucket`` (every
        rank launches them in bucket order)."""
        reducer, comm = self._reducer, self._comm
        spec = reducer.plan.buckets[bucket]
        size = spec.padded_numel // comm.size
        shard = torch.zeros(size, dtype=spec.dtype, device=spec.device)
        for piece in self._unstepped[spec.index]:
            src = reducer.params[piece.param].detach().reshape(-1)
            shard.narrow(0, piece.shard_offset, piece.length).copy_(
                src.narrow(0, piece.param_start, piece.length))
        for run, master in self._by_bucket[bucket]:
            shard.narrow(0, run.start, run.length).copy_(master)
        full = torch.empty(spec.padded_numel, dtype=spec.dtype, device=spec.device)
        work = comm.all_gather_into(full, shard, tag=f"params {spec.index}", async_op=True)
        self._pending[spec.index] = (work, full)

    @property
    def overlap_gather(self) -> bool:
        return self._overlap_gather

    def _finish_gather(self, bucket: int) -> None:
        pending = self._pending.pop(bucket, None)
        if pending is None:
            return
        work, full = pending
        work.wait()
        spec = self._reducer.plan.buckets[bucket]
        params = [self._reducer.params[i] for i in spec.params]
        views = [full.narrow(0, off, p.numel()).view_as(p) for off, p in zip(spec.offsets, params)]
        with torch.no_grad():
            foreach_copy_(params, views)

    @property
    def gathers_in_flight(self) -> int:
        """Buckets whose updated parameters are not written yet (overlap_param_gather)."""
        return len(self._pending)

    def finish_param_gather(self) -> None:
        """Wait for every parameter all-gather still in flight and write the
        parameters (a no-op unless ``overlap_param_gather`` left some)."""
        for bucket in sorted(self._pending):
            self._finish_gather(bucket)


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
