"""A fully_shard unit's parameters in both forms: the shard buffer and the
unsharded buffer (Note [unit buffers] in layout.py), each parameter's sharded
DTensor and unsharded view (:class:`ManagedParam`), which form is registered on
the modules, the dtypes, and a new layout for a new world."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem._compat import dtensor_api, dtensor_local, set_dtensor_spec
from tandem.comm.group import GroupComm
from tandem.fsdp.comm_policy import check_quantizable
from tandem.fsdp.layout import ParamShard, UnitLayout, plan_unit
from tandem.fsdp.tensor_parallel import TensorParallelParam
from tandem.fsdp.unit_state import ManagedParam, UnitConfig
from tandem.fsdp.unit_walk import ParamEntry

__all__ = ["UnitParams"]


class UnitParams:
    """The buffers and parameters of the unit ``name``, sharded over ``comm``.

    Args:
        mesh: the unit's mesh: 1-D, or 2-D (replicate, shard) under HSDP (Note
            [hybrid sharding] in unit_reduce.py), whose placements the DTensors get.
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
        shapes = [t.local_shape if t is not None else tuple(p.shape) for (_, _, p), t in zip(params, tp)]
        self.layout: UnitLayout = plan_unit(shapes, comm.size, comm.rank, shard_dims)
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
        buf = torch.zeros(self.layout.shard_numel, dtype=self.orig_dtype, device=device)
        if self.config.pin_memory and torch.cuda.is_available() and not meta:
            buf = buf.pin_memory()
        return buf

    def _new_unsharded_buffer(self, meta: bool = False) -> torch.Tensor:
        device = torch.device("meta") if meta else self.config.device
        return torch.empty(self.layout.unsharded_numel, dtype=self.param_dtype, device=device)

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
                for p in self.layout.params]

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
        for m in self.managed:
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

    def to_dtensor(self, local: torch.Tensor, spec: ParamShard,
                   tp: TensorParallelParam | None = None) -> torch.Tensor:
        """``local`` (this rank's rows of the parameter ``spec``) as a Shard(0)
        DTensor (over the 2-D mesh for a tensor-parallel parameter)."""
        if tp is not None:
            return tp.sharded(local)
        DTensor, Shard, Replicate = dtensor_api()
        shape = torch.Size(spec.shape)
        placements: tuple[Any, ...] = (Shard(spec.shard_dim),)
        if self._hybrid:  # Note [hybrid sharding] in unit_reduce.py
            placements = (Replicate(), Shard(spec.shard_dim))
        with torch.no_grad():
            return DTensor.from_local(local, self.mesh, placements, run_check=False, shape=shape,
                                      stride=_contiguous_strides(shape))

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
        self.mesh = mesh
        self.layout = plan_unit([m.spec.shape for m in self.managed], comm.size, comm.rank,
                                [m.spec.shard_dim for m in self.managed])
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


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(1, s)
    return tuple(reversed(strides))
