"""A unit's parameters gathered and released: the all-gather that unshards
them (:meth:`UnitGather.launch` / :meth:`UnitGather.wait`), and
:meth:`UnitGather.reshard`, which frees the full parameters and registers the
shards again (or keeps a 1/k slice for ``reshard_after_forward=k``). It owns the
unit's :class:`ShardState` and the gather in flight.

# Note [gather input in place]
An all-gather sends this rank's shard buffer as it is when it has the
gather's dtype and device (no copy). Otherwise (a ``param_dtype``, a shard
offloaded to the host) the shard is cast or copied straight into this rank's
chunk of the all-gather's output, which is the collective's input (an
in-place all-gather, as torch's FSDP2 issues them): a separate cast copy
would stay alive beside the output until the gather is waited on, a unit's
shard in ``param_dtype`` more at the peak than FSDP2 for every prefetched
unit.
"""

from __future__ import annotations

import torch

from tandem._compat import foreach_copy_, preserve_version_counters
from tandem.comm.group import GroupComm, Work
from tandem.comm.quantized_collectives import all_gather_quantized
from tandem.fsdp.unit_params import UnitParams
from tandem.fsdp.unit_state import CommOverrides, PendingGather, ShardState

__all__ = ["UnitGather"]


class UnitGather:
    """The gather and release of one unit's parameters."""

    def __init__(self, params: UnitParams) -> None:
        self.params = params
        self.state = ShardState.SHARDED
        self.pending: PendingGather | None = None
        self.group_shard: torch.Tensor | None = None   # reshard_after_forward=k: this rank's 1/k slice
        policy = params.config.comm_policy
        self._bits = None if policy is None else policy.weight_bits  # int8 gathers (comm_policy.py)
        self._block = 0 if policy is None else policy.block

    def launch(self, comm: GroupComm, group_comm: GroupComm | None, overrides: CommOverrides) -> None:
        """Start the all-gather of the full parameters (async): over ``comm``, or
        over ``group_comm`` from the slice kept by :meth:`reshard`."""
        self._expect(ShardState.SHARDED, ShardState.GROUP_SHARDED)
        p = self.params
        tag = f"unit {p.name}"
        if not p.layout.shard_numel:  # a unit without parameters (a root over sharded blocks)
            self.pending = PendingGather(Work(None), p.unsharded_flat, p.shard_flat, direct=True)
            self.state = ShardState.GATHERING
            return
        elif self.state is ShardState.GROUP_SHARDED:
            assert self.group_shard is not None and group_comm is not None
            custom = overrides.all_gather
            out = overrides.allocate(custom, p.layout.unsharded_numel, p.param_dtype, p.config.device)
            work = group_comm.all_gather_into(out, self.group_shard, tag=tag, async_op=True, via=custom)
            self.pending = PendingGather(work, out, self.group_shard, direct=True)
        elif self._bits is not None and comm.size > 1:  # Note [quantized units] in comm_policy.py
            assert overrides.all_gather is None  # refused by set_custom_all_gather
            out = torch.empty(p.layout.unsharded_numel, dtype=p.param_dtype, device=p.config.device)
            shard = p.shard_flat.to(out.device, p.param_dtype, non_blocking=True)  # what would be sent
            handle = all_gather_quantized(comm, out, shard, self._bits, self._block, tag=tag, async_op=True)
            self.pending = PendingGather(handle, out, handle.sent, direct=False)
        else:
            custom = overrides.all_gather
            out = overrides.allocate(custom, p.layout.unsharded_numel, p.param_dtype, p.config.device)
            inp = p.shard_flat
            if inp.dtype != p.param_dtype or inp.device != out.device:
                # Note [gather input in place]
                inp = out.view(comm.size, -1)[comm.rank]
                inp.copy_(p.shard_flat, non_blocking=True)
            work = comm.all_gather_into(out, inp, tag=tag, async_op=True, via=custom)
            self.pending = PendingGather(work, out, inp, direct=False)
        self.state = ShardState.GATHERING

    def wait(self) -> None:
        """Finish the all-gather and register the full parameters on the modules."""
        self._expect(ShardState.GATHERING)
        gather, p = self.pending, self.params
        assert gather is not None
        gather.work.wait()
        # Note [saved parameters]: the tensors autograd saved in forward are views of
        # the unsharded buffer; refilling it with the same values is not a
        # modification autograd should reject. A collective never writes into it:
        # it bumps its output's version counter at some moment between launch and
        # wait, in a communication thread; a copy bumps it here, where it is undone.
        p.alloc_unsharded()
        with preserve_version_counters((p.unsharded_flat,)), torch.no_grad():
            if gather.direct:  # already parameter-major (a 1/k slice of this buffer per rank)
                p.unsharded_flat.copy_(gather.output)
            else:
                world = p.layout.world_size
                src = gather.output.view(world, -1).split(p.layout.chunk_numels, dim=1)
                foreach_copy_(p.copy_out_dst, [s.view(world, *spec.local_shape) if spec.shard_dim else s
                                               for s, spec in zip(src, p.layout.params)])
        self.pending = None
        self.group_shard = None
        self.state = ShardState.UNSHARDED
        p.register(unsharded=True)

    def unshard(self, comm: GroupComm, group_comm: GroupComm | None, overrides: CommOverrides) -> None:
        """Make the full parameters available and registered now (launching the
        gather if needed)."""
        if self.state in (ShardState.SHARDED, ShardState.GROUP_SHARDED):
            self.launch(comm, group_comm, overrides)
        if self.state is ShardState.GATHERING:
            self.wait()
        else:
            self.params.register(unsharded=True)  # state_dict() may have registered the shards

    def reshard(self, group_comm: GroupComm | None, keep_group_shard: bool = False) -> None:
        """Free the full parameters and register the sharded ones again. With
        ``keep_group_shard``, keep this rank's 1/k slice of them for a gather over
        the smaller group (``reshard_after_forward=k``)."""
        p = self.params
        if self.state is ShardState.GATHERING:
            self.wait()
        if self.state is ShardState.UNSHARDED:
            if keep_group_shard and group_comm is not None:
                slices = p.unsharded_flat.view(group_comm.size, -1)
                self.group_shard = slices[group_comm.rank].clone()
            p.register(unsharded=False)
            p.free_unsharded()
            self.state = ShardState.GROUP_SHARDED if self.group_shard is not None else ShardState.SHARDED
        elif self.state is ShardState.GROUP_SHARDED and not keep_group_shard:
            self.group_shard = None
            self.state = ShardState.SHARDED

    def _expect(self, *allowed: ShardState) -> None:
        if self.state not in allowed:
            raise RuntimeError(f"fully_shard unit '{self.params.name}' is {self.state.name}, expected "
                               f"{'/'.join(s.name for s in allowed)}")
