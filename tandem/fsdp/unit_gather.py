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

# Note [tensor-subclass gathers]
A parameter whose tensor subclass defines torch's FSDP2 all-gather extension,
``fsdp_pre_all_gather`` and ``fsdp_post_all_gather`` (torchao's float8
training weights, its NF4 weights under QLoRA), decides what it sends and how
it is rebuilt, and fully_shard calls the pair exactly as FSDP2 does
(``FSDPParam`` in torch's ``_fsdp_param.py``):

- its shard is this rank's ``torch.chunk`` of the subclass, padded to the full
  chunk by the subclass itself (``UnitParams._manage_subclass``), held as a
  ``Shard(0)`` DTensor outside the unit's buffers; it still has a slot in the
  layout, after the plain parameters, which only its gradient uses: gradients
  are plain tensors and reduce-scatter with the unit's others, unchanged;
- before each gather, ``fsdp_pre_all_gather(mesh)`` (the legacy form, one
  parameter) or ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module,
  mp_policy)`` (five) on the local shard, moved to the device first under
  ``CPUOffloadPolicy``, returns the tensors to send and a metadata object; on a
  rank holding fewer rows than the chunk, every tensor must have the padded
  chunk's size. Nothing is cast for it: ``mp_policy`` is the subclass's to read;
- the tensors of all such parameters of a unit travel in one all-gather of
  their bytes (``uint8``, as FSDP2 packs inputs of several dtypes) beside the
  unit's plain one, and are copied out into per-tensor outputs made once
  (``world * numel`` each) whose storage is freed when the unit reshards and
  allocated again for the next gather;
- after it, ``fsdp_post_all_gather(outputs, metadata, param_dtype)`` with the
  outputs viewed as ``(-1, *size[1:])`` and ``param_dtype`` the policy's (the
  parameter's own when the policy has none or it is not floating), returns
  the unsharded tensor and the tensors to free at reshard; fully_shard makes
  the unsharded parameter of it once (``as_strided`` to the full size), and
  every later gather passes it as ``out=`` after allocating those tensors'
  storage again, so that autograd's saved tensors and hooks stay valid; the
  metadata lives from one pre to its post.

Both calls run under ``torch.no_grad()``: FSDP2 runs its pre so, and its
post in the caller's mode, where a post copying into ``out=`` (a leaf that
requires grad) fails in forward (pytorch#154836). ``reshard_after_forward=True``
frees the outputs and the returned tensors, ``False`` keeps them; an integer (a
smaller group's slice kept after forward) is refused, as FSDP2 refuses it for
these parameters. A custom all-gather (``set_custom_all_gather``) issues the
plain gather only. The extension is found on the parameter when
``fully_shard`` is called, so a unit of plain parameters gathers exactly as
before.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from tandem._compat import dtensor_local, foreach_copy_, fsdp_policies, preserve_version_counters
from tandem.comm.group import GroupComm, Work
from tandem.quantized.collectives import all_gather_quantized
from tandem.fsdp.unit_params import UnitParams, contiguous_strides
from tandem.fsdp.unit_state import CommOverrides, ManagedParam, PendingGather, ShardState

__all__ = ["SubclassGather", "UnitGather"]


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
        # Note [tensor-subclass gathers]: None for a unit of plain parameters
        self.subclasses = SubclassGather(params) if params.subclass_params else None
        self.pending_subclasses: PendingGather | None = None

    def launch(self, comm: GroupComm, group_comm: GroupComm | None, overrides: CommOverrides) -> None:
        """Start the all-gather of the full parameters (async): over ``comm``, or
        over ``group_comm`` from the slice kept by :meth:`reshard`."""
        self._expect(ShardState.SHARDED, ShardState.GROUP_SHARDED)
        p = self.params
        tag = f"unit {p.name}"
        if self.subclasses is not None:  # Note [tensor-subclass gathers]; never GROUP_SHARDED (reshard refuses it)
            self.pending_subclasses = self.subclasses.launch(comm, tag)
        if not p.flat_numel:  # a unit without plain parameters (a root over sharded blocks)
            self.pending = PendingGather(Work(None), p.unsharded_flat, p.shard_flat, direct=True)
            self.state = ShardState.GATHERING
            return
        elif self.state is ShardState.GROUP_SHARDED:
            assert self.group_shard is not None and group_comm is not None
            custom = overrides.all_gather
            out = overrides.allocate(custom, p.layout.world_size * p.flat_numel, p.param_dtype, p.config.device)
            work = group_comm.all_gather_into(out, self.group_shard, tag=tag, async_op=True, via=custom)
            self.pending = PendingGather(work, out, self.group_shard, direct=True)
        elif self._bits is not None and comm.size > 1:  # Note [quantized units] in comm_policy.py
            assert overrides.all_gather is None  # refused by set_custom_all_gather
            out = torch.empty(p.layout.world_size * p.flat_numel, dtype=p.param_dtype, device=p.config.device)
            shard = p.shard_flat.to(out.device, p.param_dtype, non_blocking=True)  # what would be sent
            handle = all_gather_quantized(comm, out, shard, self._bits, self._block, tag=tag, async_op=True)
            self.pending = PendingGather(handle, out, handle.sent, direct=False)
        else:
            custom = overrides.all_gather
            out = overrides.allocate(custom, p.layout.world_size * p.flat_numel, p.param_dtype, p.config.device)
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
                src = gather.output.view(world, -1).split([spec.chunk_numel for spec in p.flat_specs], dim=1)
                foreach_copy_(p.copy_out_dst, [s.view(world, *spec.local_shape) if spec.shard_dim else s
                                               for s, spec in zip(src, p.flat_specs)])
        if self.pending_subclasses is not None:
            assert self.subclasses is not None
            self.subclasses.wait(self.pending_subclasses)
            self.pending_subclasses = None
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
                if self.subclasses is not None:
                    self.subclasses.refuse_group_shard()
                slices = p.unsharded_flat.view(group_comm.size, -1)
                self.group_shard = slices[group_comm.rank].clone()
            p.register(unsharded=False)
            p.free_unsharded()
            if self.subclasses is not None:
                self.subclasses.free()
            self.state = ShardState.GROUP_SHARDED if self.group_shard is not None else ShardState.SHARDED
        elif self.state is ShardState.GROUP_SHARDED and not keep_group_shard:
            self.group_shard = None
            self.state = ShardState.SHARDED

    def _expect(self, *allowed: ShardState) -> None:
        if self.state not in allowed:
            raise RuntimeError(f"fully_shard unit '{self.params.name}' is {self.state.name}, expected "
                               f"{'/'.join(s.name for s in allowed)}")


class SubclassGather:
    """The all-gather of a unit's parameters whose tensor subclass gathers
    itself (Note [tensor-subclass gathers]): the extension's calls, its metadata
    from each pre to its post, and the gathered outputs kept for ``out=``."""

    def __init__(self, params: UnitParams) -> None:
        self.params = params
        self.members: list[ManagedParam] = params.subclass_params
        n = len(self.members)
        self._metadata: list[Any] = [None] * n             # from each pre_all_gather to its post
        self._sizes: list[list[torch.Size]] = [[] for _ in range(n)]  # the tensors sent, per parameter
        self._dtypes: list[list[torch.dtype]] = [[] for _ in range(n)]
        self._outputs: list[list[torch.Tensor]] = [[] for _ in range(n)]  # 1-D, world * numel, made once
        self._to_free: list[tuple[torch.Tensor, ...]] = [() for _ in range(n)]  # post_all_gather's second result
        self._made = [False] * n                           # the unsharded parameter exists
        config = params.config
        MixedPrecisionPolicy, _, _ = fsdp_policies()
        self.mp_policy = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype,
                                              output_dtype=config.output_dtype,
                                              cast_forward_inputs=config.cast_forward_inputs)
        orig = params.orig_dtype
        self.param_dtype = config.param_dtype if config.param_dtype is not None and orig.is_floating_point else orig

    def launch(self, comm: GroupComm, tag: str) -> PendingGather:
        """Call each parameter's ``fsdp_pre_all_gather`` and start one all-gather
        of the bytes of everything they return (async)."""
        sent = [self._pre_all_gather(i, m, comm) for i, m in enumerate(self.members)]
        flat = [t.view(-1).view(torch.uint8) for ts in sent for t in ts]
        width = sum(t.numel() for t in flat)
        out = torch.empty(comm.size * width, dtype=torch.uint8, device=self.params.config.device)
        inp = out.view(comm.size, -1)[comm.rank]  # Note [gather input in place]
        if flat:
            torch.cat(flat, out=inp)
        work = comm.all_gather_into(out, inp, tag=f"{tag} subclasses", async_op=True)
        return PendingGather(work, out, inp, direct=False)

    def wait(self, gather: PendingGather) -> None:
        """Copy the gathered bytes out and call each parameter's ``fsdp_post_all_gather``."""
        gather.work.wait()
        p = self.params
        world = p.layout.world_size
        rows = gather.output.view(world, -1)
        offset = 0
        for i, m in enumerate(self.members):
            outputs = self._outputs_of(i, world)
            with preserve_version_counters(outputs), torch.no_grad():
                for t in outputs:
                    dst = t.view(world, -1).view(torch.uint8)
                    dst.copy_(rows.narrow(1, offset, dst.shape[1]))
                    offset += dst.shape[1]
            self._post_all_gather(i, m, tuple(t.view(-1, *s[1:]) for t, s in zip(outputs, self._sizes[i])))

    def free(self) -> None:
        """Free the gathered outputs and the tensors ``fsdp_post_all_gather`` named
        (the unit reshards); their tensor objects stay for the next ``out=``."""
        for outputs, to_free in zip(self._outputs, self._to_free):
            for t in (*outputs, *to_free):
                t.untyped_storage().resize_(0)

    def refuse_group_shard(self) -> None:
        names = ", ".join(f"'{m.fqn}'" for m in self.members)
        raise NotImplementedError(
            f"rank {self.params.layout.rank}: fully_shard unit '{self.params.name}': parameters {names} gather "
            "themselves (fsdp_pre_all_gather), which cannot be kept as a smaller group's slice after forward, as in "
            "torch's FSDP2: use reshard_after_forward=True or False for this module")

    # ------------------------------------------------------------------ the extension's calls
    def _pre_all_gather(self, i: int, m: ManagedParam, comm: GroupComm) -> list[torch.Tensor]:
        try:
            inputs = self._call_pre(i, m, comm)
        except Exception as e:
            raise _named(e, self._hook_error("fsdp_pre_all_gather", m, e)) from e
        self._sizes[i] = [t.size() for t in inputs]
        self._dtypes[i] = [t.dtype for t in inputs]
        return inputs

    @torch.no_grad()
    def _call_pre(self, i: int, m: ManagedParam, comm: GroupComm) -> list[torch.Tensor]:
        local: Any = dtensor_local(m.sharded)  # a subclass with the extension's methods
        if local.device != self.params.config.device:  # CPUOffloadPolicy: the shard goes to the device first
            local = local.to(self.params.config.device, non_blocking=True)
        signature = inspect.signature(local.fsdp_pre_all_gather)
        if len(signature.parameters) == 1:
            inputs, self._metadata[i] = local.fsdp_pre_all_gather(self._mesh())
        elif len(signature.parameters) == 5:
            shape = torch.Size(m.spec.shape)
            inputs, self._metadata[i] = local.fsdp_pre_all_gather(
                self._mesh(), shape, contiguous_strides(shape), m.owners[0][0], self.mp_policy)
        else:
            raise TypeError(f"its signature is {signature}, expected fsdp_pre_all_gather(self, mesh, outer_size, "
                            "outer_stride, module, mp_policy) or the legacy fsdp_pre_all_gather(self, mesh)")
        inputs = list(inputs)
        padded = (m.spec.chunk_rows, *m.spec.shape[1:])
        if tuple(local.shape) != padded and any(tuple(t.shape) != padded for t in inputs):
            raise ValueError(f"this rank holds {m.spec.local_rows} of the chunk's {m.spec.chunk_rows} rows (shape "
                             f"{tuple(m.spec.shape)} over {comm.size} ranks), so every tensor it returns must "
                             f"have the padded chunk's size {padded}, got {[tuple(t.shape) for t in inputs]}")
        return inputs

    def _post_all_gather(self, i: int, m: ManagedParam, outputs: tuple[torch.Tensor, ...]) -> None:
        try:
            self._call_post(i, m, outputs)
        except Exception as e:
            raise _named(e, self._hook_error("fsdp_post_all_gather", m, e)) from e
        self._metadata[i] = None

    @torch.no_grad()
    def _call_post(self, i: int, m: ManagedParam, outputs: tuple[torch.Tensor, ...]) -> None:
        local: Any = dtensor_local(m.sharded)
        if self._made[i]:
            for t in self._to_free[i]:
                _alloc_storage(t)
            local.fsdp_post_all_gather(outputs, self._metadata[i], self.param_dtype, out=m.unsharded)
            return
        full, self._to_free[i] = local.fsdp_post_all_gather(outputs, self._metadata[i], self.param_dtype)
        shape = torch.Size(m.spec.shape)
        self.params.set_unsharded(m, torch.as_strided(full, shape, contiguous_strides(shape), storage_offset=0))
        self._made[i] = True

    def _outputs_of(self, i: int, world: int) -> list[torch.Tensor]:
        """Parameter ``i``'s all-gather outputs, made at its first gather and
        given their storage again at every later one."""
        if not self._outputs[i]:
            device = self.params.config.device
            self._outputs[i] = [torch.empty(world * s.numel(), dtype=d, device=device)
                                for s, d in zip(self._sizes[i], self._dtypes[i])]
        for t in self._outputs[i]:
            _alloc_storage(t)
        return self._outputs[i]

    def _mesh(self) -> Any:
        """The mesh the extension sees: the shard group's (the last dim of an HSDP mesh)."""
        mesh = self.params.mesh
        return mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[-1]]

    def _hook_error(self, hook: str, m: ManagedParam, e: Exception) -> str:
        return (f"rank {self.params.layout.rank}: fully_shard unit '{self.params.name}': {hook} of parameter "
                f"'{m.fqn}' ({type(dtensor_local(m.sharded)).__name__}) failed: {e}. Fix the subclass's {hook} "
                "to follow torch's FSDP2 contract (Note [tensor-subclass gathers] in tandem/fsdp/unit_gather.py): "
                "pre returns (tensors to all-gather, metadata); post returns (unsharded tensor, tensors to free), "
                "or fills out= and returns None")


def _alloc_storage(t: torch.Tensor) -> None:
    """Give ``t`` its storage back after :meth:`SubclassGather.free`."""
    storage, nbytes = t.untyped_storage(), t.numel() * t.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def _named(e: Exception, message: str) -> Exception:
    """``e``'s type with ``message``, or a RuntimeError where that type takes other arguments."""
    try:
        return type(e)(message)
    except Exception:  # noqa: BLE001 - any constructor signature
        return RuntimeError(message)
