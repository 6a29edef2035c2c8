"""The fused step under ZeRO: each bucket's shard is stepped when its
reduce-scatter lands, and its updated parameters' all-gather starts at once
(Note [fused step] in tandem/ddp/fused.py)."""

from __future__ import annotations

from typing import Any

import torch

from tandem.ddp.bucket import Bucket
from tandem.ddp.fused import bucket_optimizer, run_step_hooks, step_bucket_optimizer
from tandem.zero.optimizer import ZeroOptimizer

__all__ = ["ZeroFusedStep", "zero_stepper"]


def zero_stepper(optimizer: torch.optim.Optimizer, reducer: Any) -> ZeroFusedStep:
    if not isinstance(optimizer, ZeroOptimizer) or optimizer._reducer is not reducer:
        raise ValueError(
            f"fuse_optimizer under zero_stage={reducer.options.zero_stage} needs the tandem.ZeroOptimizer "
            f"built on this DistributedDataParallel, got {type(optimizer).__name__}: "
            "ddp.fuse_optimizer(tandem.ZeroOptimizer(ddp, torch.optim.AdamW, lr=...))")
    return ZeroFusedStep(optimizer, reducer)


class ZeroFusedStep:
    """A :class:`~tandem.ddp.fused.BucketStepper` over a ZeroOptimizer's shard runs."""

    def __init__(self, zero: ZeroOptimizer, reducer: Any) -> None:
        self.zero = zero
        self._reducer = reducer
        inner = zero.optim
        slot = {id(p): g for g, group in enumerate(inner.param_groups) for p in group["params"]}
        self._subs: list[torch.optim.Optimizer | None] = []
        for spec in reducer.plan.buckets:
            by_group: list[list[torch.Tensor]] = [[] for _ in inner.param_groups]
            for _, master in zero.runs_of(spec.index):
                by_group[slot[id(master)]].append(master)
            self._subs.append(bucket_optimizer(inner, by_group))

    def owns(self, param_index: int) -> bool:
        return False  # param.grad is not the optimizer's input under ZeRO (Note [zero reduction])

    def begin_step(self) -> None:
        zero = self.zero
        run_step_hooks(zero, pre=True)
        zero.finish_param_gather()
        zero._sync_hyperparams()

    @torch.no_grad()
    def step_bucket(self, bucket: Bucket) -> None:
        zero, pairs = self.zero, self.zero.runs_of(bucket.index)
        zero.bind_grads(pairs)
        zero.refresh_masters(pairs)
        sub = self._subs[bucket.index]
        if sub is not None:
            step_bucket_optimizer(sub, zero.optim)
        zero.launch_gather(bucket.index)
        for p in bucket.params:  # stage 1's local gradients: reduced and stepped, not kept
            p.grad = None

    def end_step(self) -> None:
        zero = self.zero
        zero._seen_steps = self._reducer.steps + 1  # these gradients are stepped
        if not zero.overlap_gather:
            zero.finish_param_gather()
        run_step_hooks(zero, pre=False)
