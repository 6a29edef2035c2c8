"""The optimizer step fused into backward: each bucket's parameters are stepped as
soon as its reduction has landed, while later buckets are still on the wire.

# Note [fused step]
``DistributedDataParallel.fuse_optimizer(optimizer)`` hands the user's optimizer
to the reducer as a :class:`BucketStepper`. At the end of a synchronised
backward the reducer waits for bucket 0, binds ``param.grad`` of its parameters
to their reduced views, steps them, releases the gradients (``param.grad`` is
None afterwards), then goes on to bucket 1, and so on: the optimizer's work on
bucket k overlaps the reductions of buckets k+1..n-1, and no averaged gradient
is kept between steps. The user's ``optimizer.step()`` becomes a no-op, so a
training loop stays as it was.

A bucket is stepped by a *bucket optimizer*: an instance of the user's optimizer
class that shares its ``state`` and ``defaults`` and whose param groups hold the
bucket's parameters of each of the user's groups (their hyper-parameters are
copied from the user's groups before each bucket steps, so schedulers work).
Per element, the update is the one the whole optimizer would compute: torch's
optimizers are element-wise given their state, so stepping parameters in bucket
order instead of group order changes nothing.

What needs every gradient before the first update cannot be fused: clipping by
the global norm, fp16 loss scaling (GradScaler unscales and checks every
gradient before it steps), and closures (LBFGS, refused). Some checks need
every bucket first: with ``check_finite`` the step must be dropped on every
rank together, and with ``find_unused_parameters`` the map of used parameters
arrives after the last bucket; then every bucket is waited for before the
first is stepped (still inside backward). A missing gradient
(Note [missing-gradient flag] in reducer.py) is known only with the last bucket:
the error is raised after the earlier buckets have stepped; it ends training.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from tandem.ddp.bucket import Bucket

__all__ = ["BucketStepper", "FusedOptimizer", "ShardedStepSource", "bucket_optimizer", "check_fusable",
           "run_step_hooks"]


class ShardedStepSource(Protocol):
    """The ZeRO optimizer built on a DDP model (:class:`tandem.zero.ZeroOptimizer`,
    a layer above, which registers itself with the model): it makes its own
    stepper, and a copy of the model waits for its gathers."""

    def fused_stepper(self, reducer: Any) -> BucketStepper: ...
    def finish_param_gather(self) -> None: ...


class BucketStepper(Protocol):
    """What the reducer calls at the end of a synchronised backward (Note [fused step])."""

    def owns(self, param_index: int) -> bool:
        """Whether the stepper binds and releases this parameter's gradient itself."""
        ...

    def begin_step(self) -> None: ...

    def step_bucket(self, bucket: Bucket) -> None:
        """Step the parameters of ``bucket``, whose reduction has landed."""
        ...

    def end_step(self) -> None: ...


def check_fusable(optimizer: object) -> torch.optim.Optimizer:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fuse_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("fuse_optimizer cannot fuse LBFGS: its step re-evaluates the loss with a "
                         "closure over every gradient; call optimizer.step(closure) unfused")
    if getattr(optimizer, "_tandem_fused", False):
        raise RuntimeError(f"this {type(optimizer).__name__} is already fused into a DistributedDataParallel")
    return optimizer


def bucket_optimizer(optimizer: torch.optim.Optimizer,
                     params_by_group: Sequence[Sequence[torch.Tensor]]) -> torch.optim.Optimizer | None:
    """An optimizer of ``optimizer``'s class over ``params_by_group[g]`` in each of its
    groups g, sharing its state (Note [fused step]); None when there is nothing to step."""
    groups = [(g, list(ps)) for g, ps in enumerate(params_by_group) if ps]
    if not groups:
        return None
    sub = object.__new__(type(optimizer))
    skip = {"param_groups", "step", "zero_grad", "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"}
    sub.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in skip})
    sub._optimizer_step_pre_hooks = {}  # the user's hooks run once per step, not per bucket
    sub._optimizer_step_post_hooks = {}
    sub.param_groups = [{**optimizer.param_groups[g], "params": ps} for g, ps in groups]
    sub._tandem_parents = [g for g, _ in groups]  # type: ignore[attr-defined]
    return sub


def run_step_hooks(optimizer: torch.optim.Optimizer, *, pre: bool) -> None:
    """The optimizer's own step hooks, once per fused step (the bucket optimizers
    have none, so that they do not run once per bucket)."""
    hooks = optimizer._optimizer_step_pre_hooks if pre else optimizer._optimizer_step_post_hooks
    for hook in list(hooks.values()):
        hook(optimizer, (), {})


def step_bucket_optimizer(sub: torch.optim.Optimizer, parent: torch.optim.Optimizer) -> None:
    """Copy the parent's hyper-parameters (a scheduler may have changed them), then step."""
    for group, g in zip(sub.param_groups, sub._tandem_parents):  # type: ignore[attr-defined]
        params = group["params"]
        group.update(parent.param_groups[g])
        group["params"] = params
    type(parent).step(sub)  # the class's step: the instance's may be patched


class FusedOptimizer:
    """Steps a plain DDP's parameters bucket by bucket (a :class:`BucketStepper`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter]) -> None:
        self.optimizer = optimizer
        index = {id(p): i for i, p in enumerate(params)}
        self._group_of: dict[int, int] = {}
        for g, group in enumerate(optimizer.param_groups):
            for k, p in enumerate(group["params"]):
                if id(p) not in index:
                    raise ValueError(
                        f"fuse_optimizer: param group {g} of the {type(optimizer).__name__} holds at "
                        f"position {k} a tensor of shape {tuple(p.shape)} that is not a trainable parameter of this "
                        "DistributedDataParallel; a fused optimizer steps only the model's parameters")
                self._group_of[index[id(p)]] = g
        self._n_groups = len(optimizer.param_groups)
        # per bucket of the current plan (a re-planned reducer makes new buckets)
        self._subs: weakref.WeakKeyDictionary[Bucket, torch.optim.Optimizer | None] = weakref.WeakKeyDictionary()

    def owns(self, param_index: int) -> bool:
        return param_index in self._group_of

    def begin_step(self) -> None:
        if len(self.optimizer.param_groups) != self._n_groups:
            raise RuntimeError(
                "fuse_optimizer: a param group was added to the optimizer after it was fused; "
                "add every group before calling ddp.fuse_optimizer(optimizer)")
        run_step_hooks(self.optimizer, pre=True)

    def step_bucket(self, bucket: Bucket) -> None:
        if bucket not in self._subs:
            by_group: list[list[torch.Tensor]] = [[] for _ in range(self._n_groups)]
            for i, p in zip(bucket.spec.params, bucket.params):
                g = self._group_of.get(i)
                if g is not None:
                    by_group[g].append(p)
            self._subs[bucket] = bucket_optimizer(self.optimizer, by_group)
        sub = self._subs[bucket]
        if sub is not None:
            step_bucket_optimizer(sub, self.optimizer)
        for i, p in zip(bucket.spec.params, bucket.params):
            if i in self._group_of:
                p.grad = None  # stepped: the averaged gradient is not kept (Note [fused step])

    def end_step(self) -> None:
        run_step_hooks(self.optimizer, pre=False)


def patch_step(optimizer: torch.optim.Optimizer, what: str) -> None:
    """Make ``optimizer.step()`` a no-op: the step runs inside backward. Keeps torch's
    LR schedulers content whether they were created before or after (they check
    that step was called through their wrapper)."""
    previous = optimizer.__dict__.get("step")

    def step(self: torch.optim.Optimizer, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError(f"a fused optimizer takes no closure: {what} steps inside backward")
        self._opt_called = True  # type: ignore[attr-defined]  # what torch's LR schedulers check
        return None

    bound = types.MethodType(step, optimizer)
    if previous is not None and hasattr(previous, "_wrapped_by_lr_sched"):
        def wrapped(*args: Any, **kwargs: Any) -> None:
            return bound(*args, **kwargs)
        wrapped._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # a later scheduler leaves it
        optimizer.step = wrapped  # type: ignore[method-assign, assignment]
    else:
        optimizer.step = bound  # type: ignore[method-assign]
    optimizer._tandem_fused = True  # type: ignore[attr-defined]
    optimizer._tandem_previous_step = previous  # type: ignore[attr-defined]


def unpatch_step(optimizer: torch.optim.Optimizer) -> None:
    previous = optimizer.__dict__.pop("_tandem_previous_step", None)
    optimizer.__dict__.pop("step", None)
    if previous is not None:
        optimizer.step = previous  # type: ignore[method-assign]
    optimizer.__dict__.pop("_tandem_fused", None)
