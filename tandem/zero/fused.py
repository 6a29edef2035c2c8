"""The fused step under ZeRO: each bucket's shard is stepped when its
reduce-scatter lands, and its updated parameters' all-gather starts at once
(Note [fused step] in tandem/ddp/fused.py)."""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch

from tandem.ddp.bucket import Bucket
from tandem.ddp.fused import bucket_optimizer, run_step_hooks, step_bucket_optimizer
from tandem.zero.param_gather import ParamGather
from tandem.zero.shards import ZeroShards

__all__ = ["ShardedOptimizer", "ZeroFusedStep"]


class ShardedOptimizer(Protocol):
    """What the fused step drives: :class:`tandem.zero.ZeroOptimizer`, which
    makes its :class:`ZeroFusedStep` (and so imports this module)."""

    _seen_steps: int

    @property
    def optim(self) -> torch.optim.Optimizer: ...
    def _sync_hyperparams(self) -> None: ...


class ZeroFusedStep:
    """A :class:`~tandem.ddp.fused.BucketStepper` over a ZeroOptimizer's shard runs."""

    def __init__(self, zero: ShardedOptimizer, shards: ZeroShards, gather: ParamGather, reducer: Any) -> None:
        self.zero, self._shards, self._gather = zero, shards, gather
        self._reducer = reducer
        inner = zero.optim
        slot = {id(p): g for g, group in enumerate(inner.param_groups) for p in group["params"]}
        self._subs: list[torch.optim.Optimizer | None] = []
        for spec in reducer.plan.buckets:
            by_group: list[list[torch.Tensor]] = [[] for _ in inner.param_groups]
            for _, master in shards.runs_of(spec.index):
                by_group[slot[id(master)]].append(master)
            self._subs.append(bucket_optimizer(inner, by_group))

    def owns(self, param_index: int) -> bool:
        return False  # param.grad is not the optimizer's input under ZeRO (Note [zero reduction])

    def begin_step(self) -> None:
        zero = self.zero
        run_step_hooks(cast(torch.optim.Optimizer, zero), pre=True)
        self._gather.finish_all()
        self._shards.bind_params()
        zero._sync_hyperparams()

    @torch.no_grad()
    def step_bucket(self, bucket: Bucket) -> None:
        pairs = self._shards.runs_of(bucket.index)
        self._shards.bind_grads(pairs)
        sub = self._subs[bucket.index]
        if sub is not None:
            step_bucket_optimizer(sub, self.zero.optim)
        self._gather.launch(bucket.index)
        for p in bucket.params:  # stage 1's local gradients: reduced and stepped, not kept
            p.grad = None

    def end_step(self) -> None:
        zero = self.zero
        zero._seen_steps = self._reducer.steps + 1  # these gradients are stepped
        if not self._gather.overlap:
            self._gather.finish_all()
        run_step_hooks(cast(torch.optim.Optimizer, zero), pre=False)
