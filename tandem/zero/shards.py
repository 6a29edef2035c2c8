"""This rank's shard of a ZeRO model: its runs (Note [shard runs] in
optimizer.py), their master values, and the pieces no run steps; what binds a
run's gradient to the reduced shard and what puts a bucket's updated shard in
the parameters' flat buffer (Note [parameters in their bucket] in flat_params.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tandem.zero.flat_params import FlatParams
from tandem.zero.layout import ShardPiece, ShardRun, plan_runs, shard_bucket

__all__ = ["ZeroShards"]


class ZeroShards:
    """The runs of this rank's shard of every bucket of ``reducer`` and their masters.

    Args:
        reducer: the DDP model's reducer (its plan, parameters and gradient shards).
        rank: this rank in the model's group.
        world_size: the group's size.
        group_of: reducer parameter index -> its param group.
    """

    def __init__(self, reducer: Any, rank: int, world_size: int, group_of: Mapping[int, int]) -> None:
        self._reducer = reducer
        self._world = world_size
        buckets = reducer.plan.buckets
        self.flat = FlatParams(reducer, rank, world_size)
        self.runs: list[ShardRun] = plan_runs(buckets, world_size, rank, dict(group_of))
        self._param_memory: set[int] = set()  # masters that are the parameters' own memory
        self.masters: list[torch.Tensor] = [self._new_master(run) for run in self.runs]
        self._by_bucket: list[list[tuple[ShardRun, torch.Tensor]]] = [[] for _ in buckets]
        for run, master in zip(self.runs, self.masters):
            self._by_bucket[run.bucket].append((run, master))
        # Per bucket, the pieces of this rank's shard that no run steps: they are
        # sent in the all-gather as they are.
        covered = {(r.bucket, p.shard_offset) for r in self.runs for p in r.pieces}
        self._unstepped: list[list[ShardPiece]] = [
            [p for p in shard_bucket(spec, world_size)[rank].pieces if (spec.index, p.shard_offset) not in covered]
            for spec in buckets]

    @property
    def owned_numel(self) -> int:
        """How many parameter elements this rank steps."""
        return sum(run.length for run in self.runs)

    def pieces(self) -> list[ShardPiece]:
        """Every piece of this rank's shard, stepped or not: its rows of each parameter."""
        return [p for run in self.runs for p in run.pieces] + [p for found in self._unstepped for p in found]

    def pairs(self) -> list[tuple[ShardRun, torch.Tensor]]:
        return list(zip(self.runs, self.masters))

    def runs_of(self, bucket: int) -> list[tuple[ShardRun, torch.Tensor]]:
        """This rank's runs in ``bucket`` and their master tensors."""
        return self._by_bucket[bucket]

    def _new_master(self, run: ShardRun) -> torch.Tensor:
        spec = self._reducer.plan.buckets[run.bucket]
        dtype = torch.promote_types(spec.dtype, torch.float32)
        if dtype == spec.dtype:  # Note [parameters in their bucket]: stepped where they live
            master = self.flat.run(spec, run.start, run.length).requires_grad_(True)
            self._param_memory.add(id(master))
            return master
        master = torch.empty(run.length, dtype=dtype, device=spec.device)
        self.copy_params_into(run, master)
        return master.requires_grad_(True)

    def is_param_memory(self, master: torch.Tensor) -> bool:
        """Whether ``master`` is the parameters' own memory (no copy to keep in step)."""
        return id(master) in self._param_memory

    def copy_params_into(self, run: ShardRun, master: torch.Tensor) -> None:
        if self.is_param_memory(master):
            return  # it is the parameters' memory
        params = self._reducer.params
        with torch.no_grad():
            for piece in run.pieces:
                src = params[piece.param].detach().reshape(-1).narrow(0, piece.param_start, piece.length)
                master.narrow(0, piece.shard_offset - run.start, piece.length).copy_(src)

    def inner_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups: ``groups``' hyper-parameters over this rank's masters."""
        inner = []
        for g, group in enumerate(groups):
            masters = [m for run, m in zip(self.runs, self.masters) if run.group == g]
            if not masters:
                # This rank owns no element of the group: a placeholder keeps group
                # indices aligned (it never gets a gradient, so it is never stepped).
                device = self._reducer.params[0].device
                masters = [torch.zeros(0, device=device, requires_grad=True)]
            inner.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
        return inner

    def bind_grads(self, pairs: list[tuple[ShardRun, torch.Tensor]]) -> None:
        """Point each run's .grad at its reduced gradients."""
        shards = self._reducer.grad_shards
        for run, master in pairs:
            grad = shards[run.bucket].narrow(0, run.start, run.length)
            master.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)

    def bind_params(self) -> None:
        """Before a step: parameters whose ``param.data`` was set go back to their
        bucket, their values copied in (Note [parameters in their bucket])."""
        self.flat.bind()

    def updated(self, bucket: int) -> torch.Tensor:
        """This rank's shard of ``bucket`` as the all-gather sends it: the
        parameters' own memory, into which the masters wider than their
        parameters are copied first."""
        spec = self._reducer.plan.buckets[bucket]
        shard = self.flat.shard(spec)
        for run, master in self._by_bucket[bucket]:
            if not self.is_param_memory(master):
                shard.narrow(0, run.start, run.length).copy_(master)
        return shard
