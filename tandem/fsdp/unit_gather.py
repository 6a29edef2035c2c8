"""A unit's parameters gathered and released: the all-gather that unshards
them (:meth:`UnitGather.launch_gather` / :meth:`UnitGather.wait_gather`), and
:meth:`UnitGather.reshard`, which frees the full parameters and registers the
shards again (or keeps a 1/k slice for ``reshard_after_forward=k``)."""

from __future__ import annotations

import torch
from torch import nn

from tandem._compat import foreach_copy_, preserve_version_counters
from tandem.comm.group import Work
from tandem.fsdp.unit_state import PendingGather, ShardState, UnitState

__all__ = ["UnitGather"]


class UnitGather(UnitState):
    """The gather and release of a unit's parameters."""

    def launch_gather(self) -> None:
        """Start the all-gather of the full parameters (async)."""
        self._expect(ShardState.SHARDED, ShardState.GROUP_SHARDED)
        tag = f"unit {self.name}"
        if not self.layout.shard_numel:  # a unit without parameters (a root over sharded blocks)
            self._gather = PendingGather(Work(None), self.unsharded_flat, self.shard_flat, direct=True)
            self.state = ShardState.GATHERING
            return
        elif self.state is ShardState.GROUP_SHARDED:
            assert self._group_shard is not None and self.group_comm is not None
            custom = self.overrides.all_gather
            out = self.overrides.allocate(custom, self.layout.unsharded_numel, self.param_dtype, self.config.device)
            work = self.group_comm.all_gather_into(out, self._group_shard, tag=tag, async_op=True, via=custom)
            self._gather = PendingGather(work, out, self._group_shard, direct=True)
        else:
            inp = self.shard_flat.to(self.config.device, self.param_dtype, non_blocking=True)
            custom = self.overrides.all_gather
            out = self.overrides.allocate(custom, self.layout.unsharded_numel, self.param_dtype, self.config.device)
            work = self.comm.all_gather_into(out, inp, tag=tag, async_op=True, via=custom)
            self._gather = PendingGather(work, out, inp, direct=False)
        self.state = ShardState.GATHERING

    def wait_gather(self) -> None:
        """Finish the all-gather and register the full parameters on the modules."""
        self._expect(ShardState.GATHERING)
        gather = self._gather
        assert gather is not None
        gather.work.wait()
        # Note [saved parameters]: the tensors autograd saved in forward are views of
        # the unsharded buffer; refilling it with the same values is not a
        # modification autograd should reject. A collective never writes into it:
        # it bumps its output's version counter at some moment between launch and
        # wait, in a communication thread; a copy bumps it here, where it is undone.
        self._alloc_unsharded()
        with preserve_version_counters((self.unsharded_flat,)), torch.no_grad():
            if gather.direct:  # already parameter-major (a 1/k slice of this buffer per rank)
                self.unsharded_flat.copy_(gather.output)
            else:
                world = self.layout.world_size
                src = gather.output.view(world, -1).split(self.layout.chunk_numels, dim=1)
                foreach_copy_(self._copy_out_dst, [s.view(world, *p.local_shape) if p.shard_dim else s
                                                   for s, p in zip(src, self.layout.params)])
        self._gather = None
        self._group_shard = None
        self.state = ShardState.UNSHARDED
        self._register(unsharded=True)

    def unshard(self) -> None:
        """Make the full parameters available and registered now (launching the
        gather if needed)."""
        if self.state in (ShardState.SHARDED, ShardState.GROUP_SHARDED):
            self.launch_gather()
        if self.state is ShardState.GATHERING:
            self.wait_gather()
        else:
            self._register(unsharded=True)  # state_dict() may have registered the shards

    def reshard(self, keep_group_shard: bool = False) -> None:
        """Free the full parameters and register the sharded ones again. With
        ``keep_group_shard``, keep this rank's 1/k slice of them for a gather over
        the smaller group (``reshard_after_forward=k``)."""
        if self.state is ShardState.GATHERING:
            self.wait_gather()
        if self.state is ShardState.UNSHARDED:
            if keep_group_shard and self.group_comm is not None:
                slices = self.unsharded_flat.view(self.group_comm.size, -1)
                self._group_shard = slices[self.group_comm.rank].clone()
            self._register(unsharded=False)
            self._free_unsharded()
            self.state = ShardState.GROUP_SHARDED if self._group_shard is not None else ShardState.SHARDED
        elif self.state is ShardState.GROUP_SHARDED and not keep_group_shard:
            self._group_shard = None
            self.state = ShardState.SHARDED

    def rebuild_unsharded(self) -> None:
        """A new unsharded buffer (on the device, in ``param_dtype``), with the
        same unsharded parameter objects pointing into it; new ones for a unit
        leaving the meta device, which has never run (no hooks hold them)."""
        leaving_meta = self.unsharded_flat.is_meta
        self.unsharded_flat = self._new_unsharded_buffer()
        for m in self.managed:
            view = self.unsharded_flat.narrow(0, m.spec.unsharded_offset, m.spec.numel).view(m.spec.shape)
            if leaving_meta:
                m.unsharded = nn.Parameter(view, requires_grad=m.requires_grad)
            else:
                m.unsharded.data = view
        self._copy_out_dst = self._copy_out_views()
        self._free_unsharded()
