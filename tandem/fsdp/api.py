"""``tandem.fully_shard``: torch's FSDP2 API over tandem's units and schedule
(the methods it adds to a module: module.py).

# Note [tiny units]
Every unit costs hooks and two or three collectives per step whatever its size;
on a model with many small modules (norms, biases, small projections) that
fixed cost dominates (torch's FSDP2 can spend half the step there). A unit
smaller than ``min_unit_bytes`` is therefore created as usual, but when
``fully_shard`` is later called on a module that contains it, its parameters
join that module's unit: its hooks are removed and each sharded parameter's
local tensor is moved into the new unit's shard buffer with ``set_``, so the
parameter objects an optimizer may already hold stay the same. Parameters are
sharded per parameter on dim 0 (layout.py), so a merge moves no data between
ranks. A tiny unit that nothing encloses stays a unit of its own.

# Note [meta init]
A model too large for one device is built on the meta device, sharded, then
given memory and values: ``model.to_empty(device=...)`` and an initialisation
or a checkpoint (``load_full_state_dict``). ``fully_shard`` keeps a unit of
meta parameters on the meta device, buffers included, as torch's FSDP2 does
(a forward before ``to_empty`` is an error naming them); ``to_empty`` gives
it its buffers. ``to_empty``, ``to`` and ``cuda`` go through
``nn.Module._apply``, which swaps each DTensor's contents for new tensors;
``FSDPModule._apply`` then copies them back into the shard buffer and points
them at it again, so the buffer stays the all-gather's input. A conversion to
another dtype (``model.to(torch.bfloat16)``) changes the unit's dtypes with it
(Note [dtype after sharding] in convert.py). The values come last: the model's
own ``init_weights()``, as torchtitan does, whose random ops draw what the
unsharded model would under ``init_like_unsharded()`` (Note [random init of
shards] in init.py), or a checkpoint. Nothing on the way allocates more than
one unit at full size: the shards, then one unit's gather buffer at a time.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, TypeVar

from torch import nn

from tandem.comm.group import GroupComm
from tandem.fsdp.comm_policy import QuantizedCommPolicy
from tandem.fsdp.arguments import check_reshard, collect_params, data_parallel_meshes, default_mesh, modules_of, \
    move_to_device, shard_dims, tensor_parallel_layouts, unit_config
from tandem.fsdp.layout import DEFAULT_MIN_UNIT_BYTES
from tandem.fsdp.module import FSDPModule
from tandem.fsdp.precision import unit_findings, warn_precision
from tandem.fsdp.schedule import post_forward, pre_forward
from tandem.fsdp.state_dict import register_state_dict_hooks
from tandem.fsdp.unit import UNIT_ATTR, ShardedUnit, unit_of

__all__ = ["DEFAULT_MIN_UNIT_BYTES", "fully_shard"]

logger = logging.getLogger(__name__)

ModuleOrList = TypeVar("ModuleOrList", nn.Module, list[nn.Module])


def fully_shard(module: ModuleOrList, *, mesh: Any = None, reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Any = None, mp_policy: Any = None, offload_policy: Any = None,
                ignored_params: set[nn.Parameter] | None = None, dp_mesh_dims: Any = None,
                min_unit_bytes: int = DEFAULT_MIN_UNIT_BYTES,
                comm_policy: QuantizedCommPolicy | None = None) -> ModuleOrList:
    """Shard ``module``'s parameters across the ranks of ``mesh`` (ZeRO-3), as
    ``torch.distributed.fsdp.fully_shard`` does, with the same arguments.

    Call it bottom-up: ``for block in model.layers: fully_shard(block)``, then
    ``fully_shard(model)``. Each call makes one *unit* of the parameters under
    ``module`` that no earlier call took; a unit is gathered with one
    all-gather before its forward, freed after it (``reshard_after_forward``),
    gathered again for its backward, and its gradients are reduce-scattered
    into shards. Parameters become ``DTensor`` s sharded on dim 0 (or the dim
    ``shard_placement_fn`` names), so a torch
    optimizer built afterwards over ``model.parameters()`` steps only this
    rank's shards, ``torch.nn.utils.clip_grad_norm_`` clips by the global norm,
    ``model.state_dict()`` is sharded, and ``torch.distributed.checkpoint``
    saves and loads it (at any world size).

    Beyond torch's FSDP2: gathers are prefetched and reduce-scatters run async
    on every backend, CPU/gloo included, so communication overlaps compute
    without CUDA streams; ranks may use different parameters in a step (a
    parameter no rank used keeps its ``.grad``; one that some ranks used gets
    the average over all ranks, with zeros for the others); units under
    ``min_unit_bytes`` merge into the unit of an enclosing module, keeping the
    same parameter objects; a full, unsharded state dict loads straight into
    the sharded model (:func:`tandem.fsdp.load_full_state_dict`).

    Args:
        module: the module to shard; it becomes an instance of
            ``FSDP<its class>``, which adds :class:`FSDPModule`'s methods. A
            list of modules makes one unit of all of them, gathered at the
            first one's forward and resharded after the last one's; it cannot
            be the root.
        mesh: a 1-D ``DeviceMesh`` of the data-parallel ranks (default: all
            ranks, on ``cuda`` for nccl and ``cpu`` otherwise), over which
            every parameter is sharded; or a 2-D one with named dimensions
            ``(replicate, shard)``: HSDP, sharded within the shard dimension
            and replicated across the other, the gradients reduce-scattered
            over the shard dimension and all-reduced over the replicate one.
            Parameters that torch's tensor parallelism made DTensors take the
            1-D data-parallel slice, ``mesh["dp"]``: each rank's local shards
            are sharded over it, and the optimizer sees DTensors over the 2-D
            mesh.
        reshard_after_forward: True frees the parameters after forward and
            gathers them again in backward; False keeps them until after
            backward (no second gather: 1.0x DDP's traffic instead of 1.5x);
            None is True except for the root, whose backward starts at once;
            an int k keeps a 1/k slice after forward and gathers over the
            group of k neighbouring ranks in backward.
        shard_placement_fn: a callable ``param -> Shard(d) or None``: shard
            that parameter on dim ``d`` (negative counts from the end; None:
            dim 0), as torch's; a dim other than 0 must divide evenly among
            the shard group's ranks. A ``ShardPlacementResult`` (a mesh of its
            own) is refused.
        mp_policy: torch's ``MixedPrecisionPolicy``: gather and compute in
            ``param_dtype``, reduce in ``reduce_dtype``, cast the output to
            ``output_dtype``, cast floating inputs if ``cast_forward_inputs``.
            Shards, gradients and optimizer state stay in the original dtype.
        offload_policy: torch's ``CPUOffloadPolicy`` keeps shards, their
            gradients and the optimizer step on the CPU (copied to the device
            for each gather); ``OffloadPolicy()`` or None keeps them on the device.
        ignored_params: parameters left as they are: not sharded, not moved,
            their gradients not reduced.
        dp_mesh_dims: torch 2.13's SPMD mesh (a whole mesh and the names of
            its data-parallel dimensions): not supported, must be None.
        min_unit_bytes: tandem only: a unit with fewer bytes of parameters
            joins the unit of a later ``fully_shard`` call on an enclosing
            module (0 keeps every call a unit of its own, as torch does).
        comm_policy: tandem only: a :class:`~tandem.fsdp.QuantizedCommPolicy`
            sends this unit's parameter all-gather in int8 blocks and its
            gradient reduce-scatter in int8 or int4 blocks (ZeRO++'s qwZ and
            qgZ); None sends them in ``param_dtype`` and ``reduce_dtype``. A
            tiny unit merged into this one (``min_unit_bytes``) takes this
            call's policy, as it takes its ``mp_policy``.

    Returns:
        ``module`` (the module, or the list), sharded in place.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or a list of them,
            ``shard_placement_fn`` returns something other than a ``Shard``,
            or ``comm_policy`` is not a ``QuantizedCommPolicy``.
        ValueError: a bad ``reshard_after_forward`` or mesh (3-D, or 2-D
            without dimension names), a placement dim out of range or uneven,
            mixed dtypes in a unit, a parameter tied to one in another unit,
            a 0-dimensional parameter (torch's fully_shard refuses it too), or
            a ``comm_policy`` that quantizes a unit of integer parameters.
        NotImplementedError: HSDP of tensor-parallel parameters, a
            ``ShardPlacementResult``, a placement dim other than 0 for a
            tensor-parallel parameter, or ``dp_mesh_dims``.
    """
    # For developers: the prefetch is Note [prefetch] and a list of modules Note [grouped modules]
    # (schedule.py); ranks' different parameters Note [gradient flags] and HSDP Note [hybrid sharding]
    # (unit.py); min_unit_bytes Note [tiny units] above; tensor-parallel parameters Note
    # [2-D parameters] (tensor_parallel.py); comm_policy Note [quantized units] (comm_policy.py).
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            f"fully_shard: dp_mesh_dims={dp_mesh_dims!r} (an SPMD mesh) is not supported; pass the data-parallel "
            "mesh itself: mesh=mesh['dp'] (1-D: FSDP, or DP x TP for tensor-parallel parameters), or "
            "mesh=mesh['replicate', 'shard'] (2-D: HSDP)")
    modules = modules_of(module)
    for m in modules:
        if unit_of(m) is not None and m in unit_of(m).modules:  # type: ignore[union-attr]
            raise ValueError(f"fully_shard was already applied to this {type(m).__name__}")
    mesh = mesh if mesh is not None else default_mesh()
    shard_mesh, replicate_mesh = data_parallel_meshes(mesh)
    comm = GroupComm(shard_mesh.get_group())
    replicate_comm = GroupComm(replicate_mesh.get_group()) if replicate_mesh is not None else None
    reshard = check_reshard(reshard_after_forward, comm.size)
    config = unit_config(mesh, mp_policy, offload_policy, comm_policy)
    ignored = {id(p) for p in (ignored_params or ())}
    params, absorbed = collect_params(modules, ignored, mesh)
    tp = tensor_parallel_layouts(params, absorbed, mesh)
    dims = shard_dims(params, absorbed, tp, shard_placement_fn, comm.size)
    for m in modules:
        move_to_device(m, params, config.device)
    name = "+".join(type(m).__name__ for m in modules)
    unit = ShardedUnit(name, params, mesh, comm, config, tp, replicate_comm, dims)
    unit.modules = modules
    unit.reshard_after_forward = True if reshard is None else reshard
    unit.auto_reshard_after_forward = reshard is None
    unit.mergeable = unit.params.layout.numel * unit.params.orig_dtype.itemsize < min_unit_bytes
    for old in absorbed:
        for handle in old.hooks:
            handle.remove()
        for sub in (sub for top in old.modules for sub in top.modules()):
            if unit_of(sub) is old:
                setattr(sub, UNIT_ATTR, unit)
    for member in modules:
        _attach(member, unit)
    logger.debug("fully_shard: unit %s with %d parameters (%d elements), %d tiny units merged%s",
                 name, len(unit.params.managed), unit.params.layout.numel, len(absorbed),
                 f", {comm_policy}" if comm_policy is not None else "")
    warn_precision(unit_findings(unit))  # Note [precision of a unit] in precision.py
    return module


def _attach(module: nn.Module, unit: ShardedUnit) -> None:
    """Make ``module`` one of ``unit``'s: its hooks, and the ``FSDP<class>``."""
    setattr(module, UNIT_ATTR, unit)
    unit.hooks += [
        module.register_forward_pre_hook(functools.partial(pre_forward, unit), prepend=True, with_kwargs=True),
        module.register_forward_hook(functools.partial(post_forward, unit)),
        *register_state_dict_hooks(module, unit),
    ]
    cls: type = type(module)  # as a plain type: mypy sees type[Module] as unhashable
    module.__class__ = _fsdp_class(cls)


@functools.cache
def _fsdp_class(cls: type) -> type:
    """``FSDP<cls>``: FSDPModule's methods first, then the module's own class."""
    if issubclass(cls, FSDPModule):
        return cls
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
