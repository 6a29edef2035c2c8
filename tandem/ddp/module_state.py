"""What a :class:`~tandem.ddp.module.DistributedDataParallel` holds: its module, its
group, its reducer (built when needed) and what it tells about them; the first of
the wrapper's layers (module.py lists them)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.comm.group import GroupComm
from tandem.ddp.checks import NonFinite, NonFiniteReport
from tandem.ddp.fused import ShardedStepSource
from tandem.ddp.reducer import CommStats, GradReducer, ReducerOptions
from tandem.ddp.zero_config import ZeroStage

__all__ = ["DDPState"]


class DDPState(nn.Module):
    """The wrapper's first layer: its state (set by ``DistributedDataParallel.__init__``),
    its reducer, and the properties and communication hook over them."""

    module: nn.Module
    zero_stage: ZeroStage
    check_finite: NonFinite | None
    process_group: dist.ProcessGroup | None
    _comm: GroupComm
    _ignored: frozenset[str]
    _named_buffers: list[tuple[str, torch.Tensor]]
    forward_sync_buffers: bool
    require_backward_grad_sync: bool
    require_forward_param_sync: bool
    _divide_by_initial_world_size: bool
    _trainable: list[tuple[str, nn.Parameter]]
    _reducer_options: ReducerOptions
    _reducer: GradReducer | None
    _fused: torch.optim.Optimizer | None
    _comm_hook: tuple[object, Any] | None  # (state, hook), for copies
    # The ZeroOptimizer built on this model, whose parameter all-gathers a copy
    # must wait for (Note [copying a DDP model] in module_copy.py); set by ZeroOptimizer.
    _zero_optimizer: weakref.ref[ShardedStepSource] | None
    # Note [recovered reduction failures] in reducer.py; given to every reducer it builds.
    _failure_handler: Callable[[BaseException], bool] | None

    def _needs_reducer(self) -> bool:
        # A world of one needs no reducer, unless ZeRO's optimizer reads its
        # shards, the gradients are checked, or an optimizer is fused.
        return self._comm.size > 1 or bool(self.zero_stage) or self.check_finite is not None

    def _make_reducer(self) -> GradReducer:
        if self._reducer is None:
            self._reducer = GradReducer(self._trainable, self._comm, self._reducer_options)
            self._reducer.failure_handler = self._failure_handler
        return self._reducer

    def set_failure_handler(self, handler: Callable[[BaseException], bool] | None) -> None:
        """Let ``handler(error)`` recover from a collective of this model's that fails
        (a peer died): when it returns True, the forward or backward in progress
        returns without that collective's result, and the caller is to drop the
        step (Note [recovered reduction failures] in reducer.py); False, or no
        handler, raises the error as before. For an elastic loop: ``tandem.prepare(elastic=...)``
        sets it. Kept across ``reset_process_group``."""
        self._failure_handler = handler
        if self._reducer is not None:
            self._reducer.failure_handler = handler

    def _recovers(self, error: BaseException) -> bool:
        return self._failure_handler is not None and self._failure_handler(error)

    # ------------------------------------------------------------------ properties
    @property
    def broadcast_buffers(self) -> bool:
        return self.forward_sync_buffers

    @property
    def comm(self) -> GroupComm:
        """The collectives layer this DDP issues through (observers see every collective)."""
        return self._comm

    @property
    def reducer(self) -> GradReducer | None:
        """The gradient reducer (None in a world of one)."""
        return self._reducer

    @property
    def comm_stats(self) -> CommStats | None:
        """This rank's gradient communication in the last synchronised backward:
        ``bytes`` sent (payload of the bucket all-reduces, or of the collectives a
        communication hook issued through ``bucket.comm``) and ``wait_s``, the
        seconds the end of backward waited for them. None before the first
        synchronised backward, and in a world of one."""
        return None if self._reducer is None else self._reducer.last_stats

    @property
    def found_nonfinite(self) -> bool:
        """Whether the last synchronised backward found NaN or Inf in the gradients
        (with ``check_finite="skip"``: its gradients were dropped, skip
        ``optimizer.step()``). The same on every rank; False without the check."""
        return self._reducer is not None and self._reducer.nonfinite is not None

    @property
    def nonfinite_report(self) -> NonFiniteReport | None:
        """Where the last synchronised backward's non-finite gradients were (the
        ranks and parameters), or None when they were finite or not checked."""
        return None if self._reducer is None else self._reducer.nonfinite

    # ------------------------------------------------------------------ hooks
    def register_comm_hook(self, state: object, hook: Any) -> None:
        """Reduce gradient buckets with ``hook(state, bucket) -> Future[Tensor]``.

        Torch's contract: the hook is called once per bucket when it is ready, with
        a :class:`~tandem.ddp.grad_bucket.GradBucket` whose buffer holds the sum of
        this rank's gradients (not divided by the world size: the hook averages);
        the future's value becomes the bucket's reduced gradients. Hooks written
        for torch's DDP (``torch.distributed.algorithms.ddp_comm_hooks``) work
        unchanged. Register once, before the first backward.

        Raises:
            RuntimeError: a hook is already registered, or backward already ran.
        """
        if self.zero_stage:
            raise NotImplementedError(
                f"register_comm_hook is not supported with zero_stage={int(self.zero_stage)}: "
                "ZeRO reduce-scatters each bucket itself")
        if self._reducer is None:
            return  # a world of one: nothing to reduce
        self._reducer.register_comm_hook(state, hook)
        self._comm_hook = (state, hook)
