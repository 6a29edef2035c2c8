"""Uneven inputs for the DDP wrapper: torch's ``Joinable`` interface and the steps of
one iteration that a joined rank mirrors (Note [join mirror] in join.py); the
second of the wrapper's layers (module.py lists them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from tandem._compat import preserve_version_counters
from tandem.ddp.checks import broadcast_module_state
from tandem.ddp.join import DDPJoinHook, join
from tandem.ddp.module_state import DDPState

__all__ = ["JoinSupport"]


class JoinSupport(DDPState, Joinable):
    """The wrapper's second layer: what :class:`~tandem.ddp.join.DDPJoinHook` calls
    (the ``MirroredDDP`` protocol), and ``join``."""

    def _will_sync_buffers(self) -> bool:
        return (self._comm.size > 1 and self.require_forward_param_sync
                and self.forward_sync_buffers and bool(self._named_buffers))

    def _sync_buffers(self, src: int) -> None:
        # Buffers may have been reassigned (module.running_mean = ...): look them up again.
        buffers = [b for n, b in self.module.named_buffers() if n not in self._ignored]
        with torch.no_grad(), preserve_version_counters(buffers):
            self._comm.broadcast_coalesced(buffers, src, tag="buffers")

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """A context manager for uneven inputs over this model alone; see :func:`tandem.join`."""
        return join([self], enable=enable, throw_on_early_termination=throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        if self.zero_stage:
            # A joined rank would also have to mirror ZeroOptimizer's all-gathers.
            raise NotImplementedError(
                f"tandem.join is not supported with zero_stage={int(self.zero_stage)} yet")
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._comm.device

    @property
    def join_process_group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _common_rank(self, *, candidate: bool) -> int:
        """The highest group rank among the candidates (Note [join mirror])."""
        t = torch.tensor([self._comm.rank if candidate else -1], device=self._comm.device)
        self._comm.all_reduce(t, op=dist.ReduceOp.MAX, tag="join: common rank")
        rank = int(t.item())
        assert rank >= 0, "at least one rank is a candidate"
        return rank

    def _agree_on_grad_sync(self, *, joined: bool) -> bool:
        """Tell joined ranks whether this iteration's backward synchronises."""
        t = torch.tensor([0.0 if joined or not self.require_backward_grad_sync else 1.0],
                         device=self._comm.device)
        work = self._comm.all_reduce(t, tag="join: grad sync", async_op=True)
        if not joined:
            return self.require_backward_grad_sync
        work.wait()
        return bool(t.item() != 0)

    def _sync_final_model(self, src: int) -> None:
        tensors: list[torch.Tensor] = [p for n, p in self.module.named_parameters() if n not in self._ignored]
        if self.forward_sync_buffers:
            tensors += [b for n, b in self.module.named_buffers() if n not in self._ignored]
        broadcast_module_state(tensors, self._comm, src=src)
