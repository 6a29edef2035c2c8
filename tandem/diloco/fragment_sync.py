"""One fragment's outer step: :class:`FragmentSync`.

A fragment owns the synced copy of its parameters (the "global" parameters
every rank agrees on after a sync), the outer optimizer that steps that copy,
and, with quantization, the residual of its error feedback. A sync is a pair,
:meth:`start` and :meth:`finish` (Note [local steps and the outer step] in
diloco.py): start computes the pseudo-gradient (global minus local) and
launches its average; finish waits for it, takes the outer step on the global
copy and writes the result into the model's parameters.

A sharded parameter (a DTensor of ``fully_shard`` over the ranks of a node)
syncs its local shard: the ranks that average hold the same shard on each
node (Note [DiLoCo across nodes, fully_shard inside] in diloco.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tandem.comm.group import GroupComm, Work
from tandem.comm.node_groups import NodeGroups
from tandem.quantized.average import QuantizedAverage
from tandem.diloco.config import DiLoCoConfig
from tandem.dtensor import local_tensor

__all__ = ["FragmentSync"]


class FragmentSync:
    """The outer step of the parameters ``params`` (one fragment), over ``comm``.

    Args:
        index: the fragment's number (for the ledger's tags).
        params: the model's parameters in this fragment.
        comm: the ranks that average.
        config: the outer optimizer's settings.
        node_groups: ``comm``'s ranks by node, for a quantized average reduced inside each node first.
    """

    def __init__(self, index: int, params: Sequence[nn.Parameter], comm: GroupComm, config: DiLoCoConfig,
                 node_groups: NodeGroups | None = None) -> None:
        self.index, self.params, self.comm, self.config = index, list(params), comm, config
        with torch.no_grad():
            self.synced = [nn.Parameter(p.detach().clone().float()) for p in self._locals()]
        self.outer = torch.optim.SGD(self.synced, lr=config.outer_lr, momentum=config.outer_momentum,
                                     nesterov=config.nesterov)
        numel = sum(p.numel() for p in self.params)
        self.residual = torch.zeros(numel, device=self._device()) if config.quantize else None
        self._quantized = QuantizedAverage(comm, config.quantize, node_groups=node_groups) if config.quantize else None
        self._delta: torch.Tensor | None = None
        self._work: Work | None = None

    def _device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def _locals(self) -> list[torch.Tensor]:
        """The parameters' tensors on this rank (a DTensor's local shard), read at
        each use: the tensors a parameter holds may change, the parameter does not."""
        return [local_tensor(p) for p in self.params]

    def start(self) -> None:
        """Launch the average of this fragment's pseudo-gradient (synced minus local)."""
        if self._delta is not None:
            raise RuntimeError(f"fragment {self.index}: a sync started before the last one finished")
        with torch.no_grad():
            delta = torch.cat([(s - p.float()).reshape(-1) for s, p in zip(self.synced, self._locals())])
        tag = f"diloco fragment {self.index}"
        if self._quantized is not None:
            self._quantized.average_(delta, self.residual, tag=tag)  # already the average
        else:
            self._work = self.comm.all_reduce(delta, tag=tag, async_op=True)
        self._delta = delta

    def _averaged(self) -> torch.Tensor:
        """The averaged pseudo-gradient of the sync in flight, waited for."""
        delta = self._delta
        if delta is None:
            raise RuntimeError(f"fragment {self.index}: finish() without a start()")
        if self._work is not None:
            self._work.wait()
            self._work = None
            delta.div_(self.comm.size)
        return delta

    def finish(self) -> None:
        """Wait for the average, take the outer step, and write the fragment's new
        parameters into the model (``mix`` of the local ones kept)."""
        delta = self._averaged()
        self._delta = None
        offset = 0
        for s in self.synced:
            s.grad = delta[offset: offset + s.numel()].view_as(s)
            offset += s.numel()
        self.outer.step()
        mix = self.config.mix
        with torch.no_grad():
            for s, p in zip(self.synced, self._locals()):
                s.grad = None
                if mix:
                    p.mul_(mix).add_(s.to(p.dtype), alpha=1.0 - mix)
                else:
                    p.copy_(s)

    def take_synced(self) -> None:
        """Set the fragment's parameters to their synced values."""
        with torch.no_grad():
            for s, p in zip(self.synced, self._locals()):
                p.copy_(s)

    def reset_process_group(self, comm: GroupComm, node_groups: NodeGroups | None) -> None:
        """Average over ``comm`` from now on; a sync in flight is dropped."""
        self.comm = comm
        self._quantized = (QuantizedAverage(comm, self.config.quantize, node_groups=node_groups)
                           if self.config.quantize else None)
        self._delta = self._work = None

    def state_dict(self) -> dict[str, Any]:
        """The synced parameters, the outer optimizer's state, the residual, and the
        averaged pseudo-gradient of a sync in flight (waited for, not applied)."""
        return {"synced": [s.detach().clone() for s in self.synced], "outer": self.outer.state_dict(),
                "residual": None if self.residual is None else self.residual.clone(),
                "in_flight": None if self._delta is None else self._averaged().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for s, saved in zip(self.synced, state["synced"]):
                s.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        if self.residual is not None and state.get("residual") is not None:
            self.residual.copy_(state["residual"])
        self._work = None
        self._delta = None if state.get("in_flight") is None else state["in_flight"].clone()
