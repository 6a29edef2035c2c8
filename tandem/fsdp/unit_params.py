"""A fully_shard unit's parameters in both forms: the shard buffer and the
unsharded buffer (Note [unit buffers] in layout.py), each parameter's sharded
DTensor and unsharded view (:class:`ManagedParam`), which form is registered on
the modules, the dtypes, and a new layout for a new world. A parameter whose
tensor subclass gathers itself is sharded as a chunk of that subclass, outside
the buffers, and :class:`SubclassGather` makes its unsharded form through the
subclass's own calls (Note [tensor-subclass gathers]).
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
``fully_shard`` is called, so a unit of plain parameters issues only its plain
gather.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tandem._compat import dtensor_api, dtensor_local, fsdp_policies, preserve_version_counters, set_dtensor_spec
from tandem.comm.group import GroupComm
from tandem.fsdp.comm_policy import check_quantizable
from tandem.fsdp.layout import ParamShard, UnitLayout, plan_unit
from tandem.fsdp.tensor_parallel import TensorParallelParam
from tandem.fsdp.unit_state import ManagedParam, PendingGather, UnitConfig
from tandem.fsdp.unit_walk import ParamEntry

__all__ = ["SubclassGather", "UnitParams", "contiguous_strides", "gathers_itself"]


def gathers_itself(param: torch.Tensor) -> bool:
    """``param`` (the local shard of a DTensor) defines torch's FSDP2 all-gather
    extension, or half of it (Note [tensor-subclass gathers])."""
    t = _own_tensor(param)
    return hasattr(t, "fsdp_pre_all_gather") or hasattr(t, "fsdp_post_all_gather")


def _own_tensor(param: torch.Tensor) -> torch.Tensor:
    DTensor, _, _ = dtensor_api()
    return dtensor_local(param) if isinstance(param, DTensor) else param


class UnitParams:
    """The buffers and parameters of the unit ``name``, sharded over ``comm``.

    Args:
        mesh: the unit's mesh: 1-D, or 2-D (replicate, shard) under HSDP (Note
            [hybrid sharding] in unit.py), whose placements the DTensors get.
        hybrid: the mesh is 2-D.
        tp: per parameter, its tensor-parallel layout (Note [2-D parameters] in tensor_parallel.py).
        shard_dims: per parameter, the dim it is sharded on (0 by default).
    """

    def __init__(self, name: str, params: list[ParamEntry], mesh: Any, comm: GroupComm, config: UnitConfig,
                 tp: list[TensorParallelParam | None] | None = None, *, hybrid: bool = False,
                 shard_dims: list[int] | None = None) -> None:
        self.name, self.mesh, self.config, self._hybrid = name, mesh, config, hybrid
        self.orig_dtype = _uniform_dtype(name, params)
        check_quantizable(name, self.orig_dtype, config.comm_policy)
        self.param_dtype = config.param_dtype or self.orig_dtype
        self.reduce_dtype = config.reduce_dtype or self.param_dtype
        tp = tp if tp is not None else [None] * len(params)
        # Note [tensor-subclass gathers]: those parameters come last.
        params, tp, shard_dims, self.num_flat = _subclass_params_last(name, params, tp, shard_dims, config)
        shapes = [t.local_shape if t is not None else tuple(p.shape) for (_, _, p), t in zip(params, tp)]
        self.layout: UnitLayout = plan_unit(shapes, comm.size, comm.rank, shard_dims)
        self.flat_specs = self.layout.params[:self.num_flat]
        # Elements of the shard buffer: the padded chunks of the parameters gathered
        # through it (all but those of Note [tensor-subclass gathers]).
        self.flat_numel = sum(p.chunk_numel for p in self.flat_specs)
        self.grad_hook: Callable[[torch.Tensor], None] | None = None  # set by watch_grads
        # Note [meta init] in api.py: a unit of meta parameters gets its memory in to_empty.
        meta = bool(params) and all(p.is_meta for _, _, p in params) and all(t is None for t in tp)
        self.shard_flat = self.new_shard_buffer(meta)
        self.unsharded_flat = self._new_unsharded_buffer(meta)
        self.managed = [self._manage(fqn, owners, param, spec, t)
                        for (fqn, owners, param), spec, t in zip(params, self.layout.params, tp)]
        comm.ledger.describe_params(f"unit {name}", [fqn for fqn, _, _ in params])
        self.copy_out_dst = self._copy_out_views()
        self.free_unsharded()  # views are made first: a view of a freed storage fails its bounds check
        self.num_trainable = sum(m.requires_grad for m in self.managed)
        self.register(unsharded=False)

    # ------------------------------------------------------------------ buffers
    def new_shard_buffer(self, meta: bool = False) -> torch.Tensor:
        device = torch.device("meta") if meta else self.config.shard_device
        buf = torch.zeros(self.flat_numel, dtype=self.orig_dtype, device=device)
        if self.config.pin_memory and torch.cuda.is_available() and not meta:
            buf = buf.pin_memory()
        return buf

    def _new_unsharded_buffer(self, meta: bool = False) -> torch.Tensor:
        device = torch.device("meta") if meta else self.config.device
        return torch.empty(self.layout.world_size * self.flat_numel, dtype=self.param_dtype, device=device)

    @property
    def flat(self) -> list[ManagedParam]:
        """The parameters that are views of the unit's buffers."""
        return self.managed[:self.num_flat]

    @property
    def subclass_params(self) -> list[ManagedParam]:
        """The parameters whose tensor subclass gathers itself (Note
        [tensor-subclass gathers])."""
        return self.managed[self.num_flat:]

    @property
    def on_meta(self) -> bool:
        """Built from meta parameters and not given memory yet (``to_empty``)."""
        return self.shard_flat.is_meta

    def _copy_out_views(self) -> list[torch.Tensor]:
        """Each parameter's padded chunks in the unsharded buffer, one row per rank
        (rank-major blocks for a parameter sharded on another dim than 0)."""
        world = self.layout.world_size
        return [self.blocks(self.unsharded_flat.narrow(0, p.unsharded_offset, p.numel), p) if p.shard_dim
                else self.unsharded_flat.narrow(0, p.unsharded_offset, world * p.chunk_numel).view(world, -1)
                for p in self.flat_specs]

    def alloc_unsharded(self) -> None:
        storage = self.unsharded_flat.untyped_storage()
        nbytes = self.unsharded_flat.numel() * self.unsharded_flat.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def free_unsharded(self) -> None:
        self.unsharded_flat.untyped_storage().resize_(0)

    def rebuild_unsharded(self) -> None:
        """A new unsharded buffer (on the device, in ``param_dtype``), with the
        same unsharded parameter objects pointing into it; new ones for a unit
        leaving the meta device, which has never run (no hooks hold them)."""
        leaving_meta = self.unsharded_flat.is_meta
        self.unsharded_flat = self._new_unsharded_buffer()
        for m in self.flat:
            view = self.unsharded_flat.narrow(0, m.spec.unsharded_offset, m.spec.numel).view(m.spec.shape)
            if leaving_meta:
                m.unsharded = nn.Parameter(view, requires_grad=m.requires_grad)
            else:
                m.unsharded.data = view
        self.copy_out_dst = self._copy_out_views()
        self.free_unsharded()

    # ------------------------------------------------------------------ parameters
    def _manage(self, fqn: str, owners: list[tuple[nn.Module, str]], param: nn.Parameter,
                spec: ParamShard, tp: TensorParallelParam | None) -> ManagedParam:
        if gathers_itself(param):
            return self._manage_subclass(fqn, owners, param, spec)
        local = self.shard_flat.narrow(0, spec.shard_offset, spec.local_numel).view(spec.local_shape)
        DTensor, _, _ = dtensor_api()
        # An absorbed tiny unit's shard is a DTensor over this mesh, or over the
        # 2-D one of its tensor-parallel layout; a tensor-parallel parameter not yet
        # sharded is a DTensor over mesh["tp"] (Note [2-D parameters] in tensor_parallel.py).
        if isinstance(param, DTensor) and (tp is None or param.device_mesh is tp.sharded_mesh):
            # A parameter of an absorbed tiny unit (Note [tiny units] in api.py): its
            # local rows move into this buffer, and the parameter object stays.
            with torch.no_grad():
                old = dtensor_local(param)
                local.copy_(old)
                old.set_(local.untyped_storage(), local.storage_offset(), local.shape, local.stride())
            sharded: nn.Parameter = param
        else:
            # A plain parameter, or a tensor-parallel one: its local tensor is what this unit shards.
            full = param.detach() if tp is None else dtensor_local(param)
            if not full.is_meta:  # meta: values come later (Note [meta init] in api.py)
                with torch.no_grad():
                    local.copy_(full.narrow(spec.shard_dim, spec.row_start, spec.local_rows))
            sharded = nn.Parameter(self.to_dtensor(local, spec, tp), requires_grad=param.requires_grad)
        view = self.unsharded_flat.narrow(0, spec.unsharded_offset, spec.numel).view(spec.shape)
        full = view if tp is None else tp.unsharded(view)
        unsharded = nn.Parameter(full, requires_grad=param.requires_grad)
        return ManagedParam(fqn, owners, spec, sharded, unsharded, param.requires_grad, tp)

    def _manage_subclass(self, fqn: str, owners: list[tuple[nn.Module, str]], param: nn.Parameter,
                         spec: ParamShard) -> ManagedParam:
        """A parameter whose subclass gathers itself (Note [tensor-subclass
        gathers]), sharded as torch's FSDP2 shards it: this rank's
        ``torch.chunk`` of the subclass, copied into a zero chunk of the padded
        size made by the subclass's ``new_zeros``, and narrowed back to its rows;
        so the subclass must support ``chunk``, ``new_zeros``, ``narrow`` and
        ``copy_``. Its unsharded form is made by its first gather."""
        DTensor, _, _ = dtensor_api()
        if isinstance(param, DTensor):  # an absorbed tiny unit's (Note [tiny units] in api.py): this rank's chunk
            return self._unmade(fqn, owners, spec, param)
        data = param.detach()
        try:
            with torch.no_grad():
                chunks = torch.chunk(data, self.layout.world_size, dim=0)
                padded = data.new_zeros((spec.chunk_rows, *spec.shape[1:]))
                if spec.local_rows:
                    padded.narrow(0, 0, spec.local_rows).copy_(chunks[self.layout.rank])
                if padded.device != self.config.shard_device:
                    padded = padded.to(self.config.shard_device)
                local = padded.narrow(0, 0, spec.local_rows)
        except Exception as e:
            raise TypeError(
                f"rank {self.layout.rank}: fully_shard unit '{self.name}': parameter '{fqn}' is a "
                f"{type(param).__name__} with fsdp_pre_all_gather, which fully_shard shards as torch's FSDP2 "
                f"does, with torch.chunk on dim 0, new_zeros, narrow and copy_; the subclass failed "
                f"there ({type(e).__name__}: {e}): implement those ops in its __torch_dispatch__") from e
        return self._unmade(fqn, owners, spec, nn.Parameter(self.to_dtensor(local, spec),
                                                            requires_grad=param.requires_grad))

    def _unmade(self, fqn: str, owners: list[tuple[nn.Module, str]], spec: ParamShard,
                sharded: nn.Parameter) -> ManagedParam:
        """A parameter gathering itself, whose unsharded form its first gather makes
        (an empty placeholder until then)."""
        placeholder = nn.Parameter(torch.empty(0, device=self.config.device), requires_grad=sharded.requires_grad)
        return ManagedParam(fqn, owners, spec, sharded, placeholder, sharded.requires_grad)

    def set_unsharded(self, m: ManagedParam, tensor: torch.Tensor) -> None:
        """Make ``tensor`` the unsharded form of ``m`` (its first gather: Note
        [tensor-subclass gathers]), watched as :meth:`watch_grads` asked."""
        m.unsharded = nn.Parameter(tensor, requires_grad=m.requires_grad)
        if m.requires_grad and self.grad_hook is not None:
            m.unsharded.register_post_accumulate_grad_hook(self.grad_hook)

    def watch_grads(self, hook: Callable[[torch.Tensor], None]) -> None:
        """Call ``hook`` when a gradient has accumulated into a trainable
        unsharded parameter, also into those a first gather makes later."""
        self.grad_hook = hook
        made = [m for m in self.subclass_params if m.unsharded.numel()]  # not the placeholder of _unmade
        for m in self.flat + made:
            if m.requires_grad:
                m.unsharded.register_post_accumulate_grad_hook(hook)

    def to_dtensor(self, local: torch.Tensor, spec: ParamShard,
                   tp: TensorParallelParam | None = None) -> torch.Tensor:
        """``local`` (this rank's rows of the parameter ``spec``) as a Shard(0)
        DTensor (over the 2-D mesh for a tensor-parallel parameter)."""
        if tp is not None:
            return tp.sharded(local)
        DTensor, Shard, Replicate = dtensor_api()
        shape = torch.Size(spec.shape)
        placements: tuple[Any, ...] = (Shard(spec.shard_dim),)
        if self._hybrid:  # Note [hybrid sharding] in unit.py
            placements = (Replicate(), Shard(spec.shard_dim))
        with torch.no_grad():
            return DTensor.from_local(local, self.mesh, placements, run_check=False, shape=shape,
                                      stride=contiguous_strides(shape))

    def blocks(self, full: torch.Tensor, spec: ParamShard) -> torch.Tensor:
        """The rank-major view ``(world, *local_shape)`` of a parameter (or its
        gradient) sharded on a dim other than 0 (Note [unit buffers] in layout.py)."""
        d, world = spec.shard_dim, self.layout.world_size
        shape = (*spec.shape[:d], world, spec.chunk_rows, *spec.shape[d + 1:])
        return full.reshape(shape).movedim(d, 0)

    def register(self, unsharded: bool) -> None:
        """Put one form of every parameter on the modules that hold it."""
        for m in self.managed:
            param = m.unsharded if unsharded else m.sharded
            for module, attr in m.owners:
                module._parameters[attr] = param

    def relayout(self, mesh: Any, comm: GroupComm) -> None:
        """Lay the shards out again for a new world (Note [regrouped units] in
        regroup.py): every rank's shard buffer is empty, to be filled from the
        old layout's owners; the parameter objects stay, over the new buffers."""
        if self.subclass_params:
            raise NotImplementedError(
                f"fully_shard unit '{self.name}': its parameters {[m.fqn for m in self.subclass_params]} gather "
                "themselves (fsdp_pre_all_gather), and a unit laid out again over a new group holds only "
                "plain parameters: restart the job from a checkpoint instead")
        self.mesh = mesh
        self.layout = plan_unit([m.spec.shape for m in self.managed], comm.size, comm.rank,
                                [m.spec.shard_dim for m in self.managed])
        self.flat_specs = self.layout.params
        self.flat_numel = self.layout.shard_numel
        self.shard_flat = self.new_shard_buffer()
        self.unsharded_flat = self._new_unsharded_buffer()
        for m, spec in zip(self.managed, self.layout.params):
            local = self.shard_flat.narrow(0, spec.shard_offset, spec.local_numel).view(spec.local_shape)
            with torch.no_grad():
                dtensor_local(m.sharded).set_(local.untyped_storage(), local.storage_offset(), local.shape,
                                              local.stride())
            set_dtensor_spec(m.sharded, self.to_dtensor(local, spec))
            m.spec = spec
            view = self.unsharded_flat.narrow(0, spec.unsharded_offset, spec.numel).view(spec.shape)
            m.unsharded = nn.Parameter(view, requires_grad=m.requires_grad)
        comm.ledger.describe_params(f"unit {self.name}", [m.fqn for m in self.managed])
        self.copy_out_dst = self._copy_out_views()
        self.free_unsharded()
        self.register(unsharded=False)



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
        inp = out.view(comm.size, -1)[comm.rank]  # Note [gather input in place] in unit.py
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
                "to follow torch's FSDP2 contract (Note [tensor-subclass gathers] in tandem/fsdp/unit_params.py): "
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

def _subclass_params_last(name: str, params: list[ParamEntry], tp: list[TensorParallelParam | None],
                          shard_dims: list[int] | None, config: UnitConfig
                          ) -> tuple[list[ParamEntry], list[TensorParallelParam | None], list[int] | None, int]:
    """The unit's parameters, those that gather themselves moved last (in their
    order), with their tensor-parallel layouts and shard dims; and how many do
    not. Each moved one must be a plain dim-0 sharded parameter of a unit
    without a quantized policy (Note [tensor-subclass gathers])."""
    dims = list(shard_dims) if shard_dims is not None else [0] * len(params)
    own = [gathers_itself(p) for _, _, p in params]
    if not any(own):
        return params, tp, shard_dims, len(params)
    for (fqn, _, p), mine, t, d in zip(params, own, tp, dims):
        if not mine:
            continue
        own_tensor = _own_tensor(p)
        if not (hasattr(own_tensor, "fsdp_pre_all_gather") and hasattr(own_tensor, "fsdp_post_all_gather")):
            raise TypeError(f"fully_shard unit '{name}': parameter '{fqn}' ({type(own_tensor).__name__}) defines "
                            "only one "
                            "of fsdp_pre_all_gather and fsdp_post_all_gather; define both (torch's FSDP2 "
                            "requires the pair)")
        what = ("is a DTensor (tensor parallel)" if t is not None else f"is sharded on dim {d}" if d else
                "is in a unit with a QuantizedCommPolicy" if config.comm_policy is not None else
                "is on the meta device" if p.is_meta else "")
        if what:
            raise NotImplementedError(f"fully_shard unit '{name}': parameter '{fqn}' gathers itself "
                                      f"(fsdp_pre_all_gather) and {what}; fully_shard gathers such a parameter "
                                      "only as a plain tensor subclass sharded on dim 0, on a real device")
    order = [i for i, mine in enumerate(own) if not mine] + [i for i, mine in enumerate(own) if mine]
    return ([params[i] for i in order], [tp[i] for i in order],
            None if shard_dims is None else [dims[i] for i in order], own.count(False))


def _uniform_dtype(name: str, params: list[ParamEntry]) -> torch.dtype:
    dtypes = {p.dtype for _, _, p in params}
    if not dtypes:
        return torch.get_default_dtype()
    if len(dtypes) > 1:
        listing = ", ".join(f"{fqn}: {p.dtype}" for fqn, _, p in params)
        raise ValueError(f"fully_shard unit '{name}' mixes parameter dtypes ({listing}); one collective "
                         "gathers a unit, so its parameters need one dtype: call fully_shard on the "
                         "submodules of each dtype separately, or cast the model first")
    return dtypes.pop()


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(1, s)
    return tuple(reversed(strides))
