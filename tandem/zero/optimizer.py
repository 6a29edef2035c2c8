"""``tandem.ZeroOptimizer``: any torch.optim optimizer, stepping only this rank's
shard of every DDP bucket (ZeRO stages 1 and 2).

Life of one step::

    backward       reducer reduce-scatters each bucket: grad_shards[b] holds the
                   averaged gradients of this rank's shard (Note [zero reduction])
    step()         each run's .grad is a view of its slice of grad_shards[b];
                   the wrapped optimizer steps the runs (its state exists only
                   for them); the updated shard of each bucket is all-gathered
                   into the parameters of every rank

# Note [shard runs]
A rank's shard of a bucket cuts across parameters (layout.py's pieces), and the
parameters may belong to different param groups. The wrapped optimizer gets one
flat tensor per *run*: a maximal stretch of the shard whose pieces are adjacent
and belong to the same param group (usually one or two per bucket). A run's
``.grad`` is a view of the reduced gradient shard, so no gradient is copied, and
its optimizer state is flat too. Runs hold the master values (fp32, or the
parameter's dtype when wider); pieces are what map them back to parameter
elements, for the all-gather and for checkpoints in torch's per-parameter format,
which is also what makes a checkpoint loadable at another world size.

# Note [copying a ZeroOptimizer]
torch's ZeroRedundancyOptimizer survives copy.deepcopy and torch.save only in
appearance: torch.optim.Optimizer's __getstate__ keeps defaults, state and
param_groups, so the copy's first step() raises AttributeError. A ZeroOptimizer
is bound to its DDP model's reducer (it steps the reducer's gradient shards), so
its copy carries the model instead and rebuilds itself over the model's copy
(which has rebuilt its reducer, Note [copying a DDP model] in
tandem/ddp/module.py), then restores its shard of the state: the wrapped
optimizer's state and the master values (wider than the parameters under
low-precision training). Copied together, ``copy.deepcopy((model, optimizer))``
or one ``torch.save`` of both, the two copies belong together and train as the
originals do; the optimizer copied alone brings a copy of the model with it, as
a torch optimizer brings copies of its parameters. The state is this rank's
shard: a copy loads at the same rank and world size only (for another world
size, use state_dict() or save_sharded()). The forward pre-hooks of
overlap_param_gather, which the module's copy would otherwise carry and call
on the original optimizer, copy as no-ops and are removed when the optimizer's
copy registers its own.

ZeroOptimizer is built in layers, one concept a file, each class on the one
before: ``ZeroBase`` (optimizer_base.py: what it holds, master values, param
groups) <- ``ParamGather`` (param_gather.py: the parameter all-gathers and
their forward pre-hooks) <- ``ZeroCheckpoints`` (optimizer_checkpoint.py:
state dicts and sharded saves) <- ``ZeroOptimizer`` (here: construction,
copies, step, gradients).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from tandem.zero.fused import ZeroFusedStep
from tandem.zero.layout import ShardRun, plan_runs, shard_bucket
from tandem.zero.optimizer_base import group_of_params, normalise_groups
from tandem.zero.optimizer_checkpoint import ZeroCheckpoints
from tandem.zero.param_gather import register_gather_hooks

__all__ = ["ZeroOptimizer"]

logger = logging.getLogger(__name__)


class ZeroOptimizer(ZeroCheckpoints):
    """A distributed optimizer that shards optimizer state (ZeRO stage 1) and works
    with sharded gradients (stage 2) of a :class:`tandem.DistributedDataParallel`
    built with ``zero_stage=1`` or ``2``.

    Each rank owns a contiguous shard of every gradient bucket, keeps the wrapped
    optimizer's state only for that shard, steps only that shard, and then
    all-gathers the updated parameters, so that after :meth:`step` every rank
    holds the same full parameters, as with plain DDP.

    ``param_groups`` hold the model's parameters and the hyper-parameters, as in
    any torch optimizer: learning-rate schedulers work on this object.

    Args:
        ddp_model: a ``tandem.DistributedDataParallel`` with ``zero_stage`` 1 or 2.
        optimizer_class: a ``torch.optim.Optimizer`` subclass, e.g. ``torch.optim.AdamW``.
        params: ``ddp_model``'s parameters to optimize, or a list of param-group
            dicts, as for any torch optimizer (default: all trainable parameters).
        **optimizer_kwargs: the defaults for ``optimizer_class``.

    Raises:
        ValueError: ``ddp_model`` is not a ZeRO DDP, or ``params`` names a tensor
            that is not one of its trainable parameters.

    .. warning:: ``param.grad`` does not hold averaged gradients under ZeRO; clip
        with :meth:`clip_grad_norm_`, not ``torch.nn.utils.clip_grad_norm_``.
    """

    def __init__(self, ddp_model: torch.nn.Module, optimizer_class: type[torch.optim.Optimizer],
                 params: Iterable[Any] | None = None, **optimizer_kwargs: Any) -> None:
        reducer = getattr(ddp_model, "reducer", None)
        stage = int(getattr(ddp_model, "zero_stage", 0))
        if reducer is None or not stage:
            raise ValueError("ZeroOptimizer needs tandem.DistributedDataParallel(..., zero_stage=1 or 2), "
                             f"got {type(ddp_model).__name__} with zero_stage={stage}")
        self._ddp = ddp_model
        self._optimizer_class = optimizer_class
        self._optimizer_kwargs = dict(optimizer_kwargs)
        self._reducer = reducer
        self._comm = reducer.comm
        self.zero_stage = stage
        groups = normalise_groups(reducer.params if params is None else params)
        group_of = group_of_params(groups, reducer)
        self._runs = plan_runs(reducer.plan.buckets, self._comm.size, self._comm.rank, group_of)
        self._masters = [self._new_master(run) for run in self._runs]
        self._by_bucket = [[] for _ in reducer.plan.buckets]
        for run, master in zip(self._runs, self._masters):
            self._by_bucket[run.bucket].append((run, master))
        # Per bucket, the pieces of this rank's shard that no run steps: they are
        # sent in the all-gather as they are.
        covered = {(r.bucket, p.shard_offset) for r in self._runs for p in r.pieces}
        self._unstepped = [[p for p in shard_bucket(spec, self._comm.size)[self._comm.rank].pieces
                            if (spec.index, p.shard_offset) not in covered]
                           for spec in reducer.plan.buckets]
        self._optim = optimizer_class(self._inner_groups(groups), **optimizer_kwargs)
        super().__init__(groups, self._optim.defaults)
        self._groups_fixed = True  # the shards are laid out for these groups
        self._sync_hyperparams()
        self._seen_steps = reducer.steps
        self._pending = {}  # bucket -> gather in flight
        ddp: Any = ddp_model  # a tandem DDP (checked above), whose attributes nn.Module's typing hides
        self._overlap_gather = bool(ddp.zero_config.overlap_param_gather)
        self._gather_hooks = (register_gather_hooks(ddp.module, reducer, self._finish_gather)
                              if self._overlap_gather else [])
        ddp._zero_optimizer = weakref.ref(self)  # a copy of the model first waits for our gathers
        owned = self.owned_numel
        total = sum(b.numel for b in reducer.plan.buckets)
        logger.info("ZeRO-%d: rank %d owns %d of %d elements in %d runs over %d buckets",
                    stage, self._comm.rank, owned, total, len(self._runs), len(reducer.plan.buckets))

    # ------------------------------------------------------------------ copies
    def __getstate__(self) -> dict[str, Any]:  # Note [copying a ZeroOptimizer]
        self.finish_param_gather()  # waits only: no collective
        return {"ddp": self._ddp, "optimizer_class": self._optimizer_class,
                "optimizer_kwargs": self._optimizer_kwargs, "param_groups": self.param_groups,
                "rank": self._comm.rank, "world_size": self._comm.size, "runs": self._runs,
                "masters": [m.detach() for m in self._masters], "inner": self._optim.state_dict(),
                "gather_hooks": self._gather_hooks}

    def __setstate__(self, state: dict[str, Any]) -> None:
        ddp = state["ddp"]
        for handle in state["gather_hooks"]:
            handle.remove()  # the copied module's no-op copies of our hooks
        self.__init__(ddp, state["optimizer_class"], state["param_groups"],  # type: ignore[misc]
                      **state["optimizer_kwargs"])
        fix = ("carry the state with optimizer.state_dict() (or save_sharded()) into a ZeroOptimizer "
               "built on the loaded model")
        if (self._comm.rank, self._comm.size) != (state["rank"], state["world_size"]):
            raise RuntimeError(
                f"rank {self._comm.rank} of {self._comm.size}: this ZeroOptimizer was copied or pickled at "
                f"rank {state['rank']} of {state['world_size']} and holds that rank's shard of the optimizer "
                f"state; load it at the same rank and world size, or {fix}")
        if self._runs != state["runs"]:
            raise RuntimeError(
                f"rank {self._comm.rank}: the loaded model's buckets are not those this ZeroOptimizer's "
                f"shards were laid out over (another tandem version?); {fix}")
        with torch.no_grad():
            for master, saved in zip(self._masters, state["masters"]):
                master.copy_(saved)
        self._optim.load_state_dict(state["inner"])

    def reset_process_group(self) -> None:
        """Lay the shards out again after the model moved to another process group
        (``DistributedDataParallel.reset_process_group``, an elastic job's new
        world): this rank's runs are planned for the new world size, and the
        parameter groups (with their current hyper-parameters) are kept. The
        optimizer state is dropped: load it afterwards, from every old rank's
        :meth:`sharded_state_dict` (:meth:`load_sharded_state_dicts`) or from a
        checkpoint. No communication."""
        for handle in self._gather_hooks:
            handle.remove()
        self._pending.clear()  # gathers of the old group are abandoned, not waited for
        self._groups_fixed = False  # the same groups, laid out again
        self.__init__(self._ddp, self._optimizer_class, self.param_groups,  # type: ignore[misc]
                      **self._optimizer_kwargs)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step this rank's shards, then all-gather the updated parameters.

        With ``overlap_param_gather``, the all-gathers are still in flight when
        this returns; the next forward waits for each bucket before a module
        that uses it runs (call :meth:`finish_param_gather` to read parameters
        before that).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.finish_param_gather()
        pairs = list(zip(self._runs, self._masters))
        if self._reducer.steps != self._seen_steps:
            # A synchronised backward ran since the last step (otherwise .grad
            # stays as zero_grad left it).
            self._seen_steps = self._reducer.steps
            self.bind_grads(pairs)
        self.refresh_masters(pairs)
        self._sync_hyperparams()
        self._optim.step()
        for spec in self._reducer.plan.buckets:
            self.launch_gather(spec.index)
        if not self._overlap_gather:
            self.finish_param_gather()
        return loss

    # The parts of a step, for the fused step too (tandem/zero/fused.py).
    def fused_stepper(self, reducer: Any) -> ZeroFusedStep:
        """The bucket stepper of ``ddp.fuse_optimizer(self)`` (Note [fused step]
        in tandem/ddp/fused.py); ``reducer`` is the model's, which this optimizer
        was built on."""
        assert reducer is self._reducer, "fuse_optimizer checks that this optimizer is the model's"
        return ZeroFusedStep(self, reducer)

    def runs_of(self, bucket: int) -> list[tuple[ShardRun, torch.Tensor]]:
        """This rank's runs in ``bucket`` and their master tensors."""
        return self._by_bucket[bucket]

    def bind_grads(self, pairs: list[tuple[ShardRun, torch.Tensor]]) -> None:
        """Point each run's .grad at its reduced gradients."""
        shards = self._reducer.grad_shards
        for run, master in pairs:
            grad = shards[run.bucket].narrow(0, run.start, run.length)
            master.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)

    def refresh_masters(self, pairs: list[tuple[ShardRun, torch.Tensor]]) -> None:
        for run, master in pairs:
            if master.dtype == self._reducer.plan.buckets[run.bucket].dtype:
                # Lossless, and parameters may have been loaded since the last step.
                self._copy_params_into(run, master)
    # ------------------------------------------------------------------ gradients
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the model's parameters and of this rank's shards."""
        for p in self._reducer.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_().zero_()
        for master in self._masters:
            if set_to_none:
                master.grad = None
            elif master.grad is not None:
                master.grad.zero_()
        if not set_to_none:
            for shard in self._reducer.grad_shards:
                shard.zero_()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the averaged gradients by their global norm, computed across every
        rank's shard (one all-reduce of a scalar), like
        ``torch.nn.utils.clip_grad_norm_`` over all parameters under plain DDP.
        Call after backward, before :meth:`step`.

        Returns:
            The total norm of the gradients before clipping.
        """
        shards = self._reducer.grad_shards
        device = shards[0].device if shards else torch.device("cpu")
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            local = torch.stack([s.abs().max().float() for s in shards if s.numel()]).max()
            self._comm.all_reduce(local, op=dist.ReduceOp.MAX, tag="grad norm")
            total = local
        else:
            local = torch.stack([torch.linalg.vector_norm(s.float(), norm_type) for s in shards])
            local = local.pow(norm_type).sum().to(device)
            self._comm.all_reduce(local, tag="grad norm")
            total = local.pow(1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"rank {self._comm.rank}: the total norm of order {norm_type} of "
                               "the gradients is non-finite, so it cannot be clipped")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for s in shards:
            s.mul_(coef.to(s.dtype))
        return total
