"""What keeps the replicas equal outside their gradients: the same model checked
and broadcast at the start, buffers broadcast before a forward, and, under
uneven inputs, the agreements a joined rank mirrors and the final model (Note
[join mirror] in join.py)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from tandem._compat import preserve_version_counters
from tandem.comm.group import GroupComm
from tandem.ddp.checks import Entry, broadcast_module_state, check_same_model_on_all_ranks, model_signature

__all__ = ["ModelSync"]


class ModelSync:
    """The state collectives of one DDP model over one group.

    Args:
        module: the wrapped module.
        ignored: names of parameters and buffers DDP leaves alone.
        comm: the group.
    """

    def __init__(self, module: nn.Module, ignored: Collection[str], comm: GroupComm) -> None:
        self.module, self.ignored, self.comm = module, ignored, comm

    def _params(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if n not in self.ignored]

    def _buffers(self) -> list[tuple[str, torch.Tensor]]:
        # Buffers may have been reassigned (module.running_mean = ...): looked up each time.
        return [(n, b) for n, b in self.module.named_buffers() if n not in self.ignored]

    def signature(self, *, buffers: bool, options: Mapping[str, object]) -> list[Entry]:
        """What must agree across ranks: the parameters, the buffers (``buffers``)
        and ``options`` that change a step's collectives."""
        return model_signature(self._params(), self._buffers() if buffers else [], dict(options))

    def start(self, *, buffers: bool, options: Mapping[str, object], broadcast: bool = True,
              check: bool = True) -> None:
        """Check that every rank wraps the same model (and ``options`` that change a
        step's collectives; unless not ``check``: the caller checks, :meth:`check`),
        then (``broadcast``) give all of them rank 0's parameters (and buffers)."""
        if self.comm.size == 1:
            return
        if check:
            self.check(buffers=buffers, options=options)
        if broadcast:
            tensors = [p for _, p in self._params()] + ([b for _, b in self._buffers()] if buffers else [])
            broadcast_module_state(tensors, self.comm, src=0)

    def check(self, *, buffers: bool, options: Mapping[str, object],
              digests: Sequence[Sequence[int]] | None = None) -> None:
        """Raise the same ValueError on every rank unless all wrap the same model:
        ``digests`` (every rank's :func:`signature_digest`) gathered by the caller, else here."""
        check_same_model_on_all_ranks(self.signature(buffers=buffers, options=options), self.comm, digests)

    def buffers(self, src: int) -> None:
        """Broadcast the buffers from group rank ``src`` (before a forward)."""
        buffers = [b for _, b in self._buffers()]
        with torch.no_grad(), preserve_version_counters(buffers):
            self.comm.broadcast_coalesced(buffers, src, tag="buffers")

    def common_rank(self, *, candidate: bool) -> int:
        """The highest group rank among the candidates (Note [join mirror] in join.py)."""
        t = torch.tensor([self.comm.rank if candidate else -1], device=self.comm.device)
        self.comm.all_reduce(t, op=dist.ReduceOp.MAX, tag="join: common rank")
        rank = int(t.item())
        assert rank >= 0, "at least one rank is a candidate"
        return rank

    def agree_on_grad_sync(self, *, joined: bool, wanted: bool) -> bool:
        """Tell joined ranks whether this iteration's backward synchronises
        (``wanted``, on a rank still training); a joined rank learns it."""
        t = torch.tensor([0.0 if joined or not wanted else 1.0], device=self.comm.device)
        work = self.comm.all_reduce(t, tag="join: grad sync", async_op=True)
        if not joined:
            return wanted
        work.wait()
        return bool(t.item() != 0)

    def final_model(self, src: int, *, buffers: bool) -> None:
        """Everyone takes rank ``src``'s parameters (and buffers): the end of join."""
        tensors: list[torch.Tensor] = [p for _, p in self._params()]
        if buffers:
            tensors += [b for _, b in self._buffers()]
        broadcast_module_state(tensors, self.comm, src=src)
