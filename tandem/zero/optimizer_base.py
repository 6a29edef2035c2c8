"""What a :class:`~tandem.zero.optimizer.ZeroOptimizer` holds and how its shards
are set up: the runs of this rank's shard (Note [shard runs] in optimizer.py),
their master values, the wrapped optimizer's param groups over them; the first
of ZeroOptimizer's layers (optimizer.py lists them)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from tandem.comm.group import GroupComm, Work
from tandem.zero.layout import ShardPiece, ShardRun

__all__ = ["ZeroBase", "group_of_params", "normalise_groups"]


class ZeroBase(torch.optim.Optimizer):
    """ZeroOptimizer's first layer: its state (set by ``ZeroOptimizer.__init__``),
    master values and param groups."""

    _ddp: torch.nn.Module
    _optimizer_class: type[torch.optim.Optimizer]
    _optimizer_kwargs: dict[str, Any]
    _reducer: Any  # the DDP model's GradReducer
    _comm: GroupComm
    zero_stage: int
    _runs: list[ShardRun]
    _masters: list[torch.Tensor]  # one per run (Note [shard runs] in optimizer.py)
    _by_bucket: list[list[tuple[ShardRun, torch.Tensor]]]
    _unstepped: list[list[ShardPiece]]  # per bucket, the pieces of this rank's shard no run steps
    _optim: torch.optim.Optimizer
    _seen_steps: int
    _pending: dict[int, tuple[Work, torch.Tensor]]  # bucket -> gather in flight
    _overlap_gather: bool
    _gather_hooks: list[Any]

    @property
    def optim(self) -> torch.optim.Optimizer:
        """The wrapped optimizer, over this rank's shard runs only (as torch's
        ``ZeroRedundancyOptimizer.optim``)."""
        return self._optim

    @property
    def owned_numel(self) -> int:
        """How many parameter elements this rank steps."""
        return sum(run.length for run in self._runs)

    # ------------------------------------------------------------------ set-up
    def _new_master(self, run: ShardRun) -> torch.Tensor:
        spec = self._reducer.plan.buckets[run.bucket]
        dtype = torch.promote_types(spec.dtype, torch.float32)
        master = torch.empty(run.length, dtype=dtype, device=spec.device)
        self._copy_params_into(run, master)
        return master.requires_grad_(True)

    def _copy_params_into(self, run: ShardRun, master: torch.Tensor) -> None:
        params = self._reducer.params
        with torch.no_grad():
            for piece in run.pieces:
                src = params[piece.param].detach().reshape(-1).narrow(0, piece.param_start, piece.length)
                master.narrow(0, piece.shard_offset - run.start, piece.length).copy_(src)

    def _inner_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        inner = []
        for g, group in enumerate(groups):
            masters = [m for run, m in zip(self._runs, self._masters) if run.group == g]
            if not masters:
                # This rank owns no element of the group: a placeholder keeps group
                # indices aligned (it never gets a gradient, so it is never stepped).
                device = self._reducer.params[0].device
                masters = [torch.zeros(0, device=device, requires_grad=True)]
            inner.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
        return inner

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_groups_fixed", False):
            raise NotImplementedError(
                "ZeroOptimizer cannot add param groups after construction (each rank's shards "
                "are laid out over the groups given then); pass every group to the constructor")
        super().add_param_group(param_group)

    def _sync_hyperparams(self) -> None:
        """Copy hyper-parameters (a scheduler may have changed them) to the wrapped optimizer."""
        for outer, inner in zip(self.param_groups, self._optim.param_groups):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v


def normalise_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    params = list(params)
    if not params:
        raise ValueError("ZeroOptimizer got an empty parameter list")
    if not isinstance(params[0], dict):
        params = [{"params": params}]
    groups = []
    for g in params:
        members = g["params"]
        members = [members] if isinstance(members, torch.Tensor) else list(members)
        groups.append({**g, "params": members})
    return groups


def group_of_params(groups: list[dict[str, Any]], reducer: Any) -> dict[int, int]:
    position = {id(p): i for i, p in enumerate(reducer.params)}
    group_of: dict[int, int] = {}
    for g, group in enumerate(groups):
        for p in group["params"]:
            i = position.get(id(p))
            if i is None:
                raise ValueError(
                    f"param group {g} holds a tensor of shape {tuple(p.shape)} that is not a "
                    "trainable parameter of the DistributedDataParallel model; pass the "
                    "parameters of ddp_model (with requires_grad=True)")
            if i in group_of:
                raise ValueError(f"parameter '{reducer.names[i]}' appears in more than one param group")
            group_of[i] = g
    return group_of
