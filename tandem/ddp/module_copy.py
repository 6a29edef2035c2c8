"""Copies of the DDP wrapper: ``copy.deepcopy`` and ``torch.save``/``torch.load``
(Note [copying a DDP model]); the fourth of the wrapper's layers (module.py
lists them)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from tandem.comm.group import GroupComm
from tandem.ddp.module_fuse import FusedStep

__all__ = ["Copyable"]


class Copyable(FusedStep):
    """The wrapper's fourth layer: ``__getstate__`` and ``__setstate__``."""

    # Note [copying a DDP model]
    # copy.deepcopy and torch.save/torch.load go through __getstate__ and
    # __setstate__, as in torch's DDP: the copy holds copies of the module (its
    # own parameters and buffers) and of the options, and rebuilds what is bound
    # to this process and its group (the reducer with its hooks on the
    # parameters, the GroupComm with the ledger and monitors) over the default
    # process group. So, as torch does, a model over any other group is refused,
    # and neither copying nor loading issues a collective: one rank alone may
    # copy (an EMA or evaluation copy on rank 0) or load.
    # What a copy does not carry: the reducer's learned state (it re-plans
    # buckets and re-learns a static graph in its first step, like a new DDP:
    # the arithmetic is the same; torch's copy carries its "first static
    # iteration done" flag to its new reducer, skips that step's all-reduce
    # and its replicas part), the gradients (torch does not copy
    # param.grad either: copy between steps, after optimizer.step()), and a
    # fused optimizer (the copied optimizer steps as usual; fuse it again if
    # wanted). A communication hook is carried, with a copy of its state (torch's
    # copy silently drops it and all-reduces). Under ZeRO with
    # overlap_param_gather, the all-gathers still in flight are waited for first,
    # so that the copy holds the stepped parameters; a ZeroOptimizer copied
    # together with the model binds to the copy (Note [copying a ZeroOptimizer]).
    def __getstate__(self) -> dict[str, Any]:
        if self.process_group is not None and self.process_group is not dist.group.WORLD:
            raise RuntimeError(
                f"rank {self._comm.rank}: a DistributedDataParallel over a process group other than the "
                "default one cannot be deep-copied or pickled (the copy rebuilds its reducer over the "
                "default group, and torch's DDP refuses it likewise); copy the wrapped module instead, "
                "copy.deepcopy(ddp.module) or torch.save(ddp.module.state_dict()), and wrap the copy "
                "in DistributedDataParallel with the same process_group")
        zero = self._zero_optimizer() if self._zero_optimizer is not None else None
        if zero is not None:
            zero.finish_param_gather()  # waits only: no collective
        state: dict[str, Any] = super().__getstate__()  # nn.Module's: __dict__ less compiled calls
        # The failure handler belongs to this process's elastic loop, not to a copy.
        for name in ("_comm", "_reducer", "_fused", "_zero_optimizer", "process_group", "_failure_handler"):
            del state[name]
        if self._comm_hook is not None and self._comm_hook[0] is self._comm:
            state["_comm_hook"] = (_OwnComm(), self._comm_hook[1])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        hook = state.pop("_comm_hook", None)
        super().__setstate__(state)
        self.process_group = None
        self._reducer = None
        self._fused = None
        self._comm_hook = None
        self._zero_optimizer = None
        self._failure_handler = None
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "loading a pickled tandem.DistributedDataParallel rebuilds it over the default process "
                "group, which is not initialised: call tandem.init() (or "
                "torch.distributed.init_process_group) before torch.load, or save and load "
                "ddp.module (or its state_dict()) instead of the wrapper")
        self._comm = GroupComm(None)
        if self._needs_reducer():
            self._make_reducer()
        if hook is not None:
            hook_state, fn = hook
            self.register_comm_hook(self._comm if isinstance(hook_state, _OwnComm) else hook_state, fn)


class _OwnComm:
    """Stands for the copied DDP's own GroupComm as a communication hook's state."""
