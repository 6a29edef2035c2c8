"""fully_shard's arguments, checked and resolved before a unit is built: the
mesh (1-D: FSDP; 2-D: HSDP, Note [hybrid sharding] in unit.py), the module or
modules of one call (Note [grouped modules] in schedule.py), the parameters
it takes, their tensor-parallel layouts and the dim each is sharded on
(``shard_placement_fn``), the policies (``comm_policy``: comm_policy.py), and
``reshard_after_forward``.

Every check runs before any collective, so bad input raises the same error on
every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem._compat import dtensor_api, fsdp_policies
from tandem.fsdp.comm_policy import QuantizedCommPolicy
from tandem.fsdp.tensor_parallel import TensorParallelParam, tensor_parallel_param
from tandem.fsdp.unit import ShardedUnit, unit_of
from tandem.fsdp.unit_state import UnitConfig
from tandem.fsdp.unit_walk import ParamEntry, walk_unit

__all__ = ["check_reshard", "collect_params", "data_parallel_meshes", "default_mesh", "modules_of", "move_to_device",
           "shard_dims", "tensor_parallel_layouts", "unit_config"]


def default_mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed: call tandem.init() (or "
                           "torch.distributed.init_process_group) first, or pass a mesh")
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def data_parallel_meshes(mesh: Any) -> tuple[Any, Any]:
    """``(shard mesh, replicate mesh or None)`` of fully_shard's ``mesh``: a 1-D
    mesh shards over all of it; a 2-D one is HSDP, ``(replicate, shard)`` as
    torch's FSDP2 reads it (Note [hybrid sharding] in unit.py)."""
    if not hasattr(mesh, "ndim") or not hasattr(mesh, "get_group"):
        raise TypeError(f"fully_shard: mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return mesh, None
    names = mesh.mesh_dim_names
    if mesh.ndim != 2 or not names:
        what = f"a {mesh.ndim}-D mesh" + ("" if names else " without mesh_dim_names")
        raise ValueError(
            f"fully_shard takes a 1-D mesh of data-parallel ranks (FSDP) or a 2-D mesh with named dimensions "
            f"(replicate, shard) (HSDP), got {what}: {mesh}. For HSDP build it with init_device_mesh(device, "
            "(replicas, shards), mesh_dim_names=('replicate', 'shard')); with tensor parallelism pass the "
            "data-parallel slice, mesh['dp']")
    return mesh[names[1]], mesh[names[0]]


def check_reshard(value: Any, world_size: int) -> bool | int | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value < 1 or world_size % value:
            raise ValueError(f"reshard_after_forward={value} must divide the shard group of {world_size} ranks "
                             "(the mesh, or its shard dimension under HSDP): it is the size of the group to "
                             "gather from in backward")
        if value == 1:
            return True
        if value == world_size:
            return False
        return value
    raise ValueError(f"reshard_after_forward must be a bool, an int or None, got {value!r}")


def unit_config(mesh: Any, mp_policy: Any, offload_policy: Any, comm_policy: Any = None) -> UnitConfig:
    MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy = fsdp_policies()
    mp = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    if not isinstance(mp, MixedPrecisionPolicy):
        raise ValueError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got {mp!r}")
    offload = offload_policy if offload_policy is not None else OffloadPolicy()
    if not isinstance(offload, OffloadPolicy):
        raise ValueError(f"offload_policy must be a torch.distributed.fsdp.OffloadPolicy, got {offload!r}")
    if comm_policy is not None and not isinstance(comm_policy, QuantizedCommPolicy):
        raise TypeError(f"comm_policy must be a tandem.fsdp.QuantizedCommPolicy or None, got {comm_policy!r}; "
                        "for example comm_policy=QuantizedCommPolicy(weight_bits=8, grad_bits=4)")
    if mesh.device_type == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device(mesh.device_type, torch.cuda.current_device())
    cpu_offload = isinstance(offload, CPUOffloadPolicy)
    return UnitConfig(device=device, shard_device=torch.device("cpu") if cpu_offload else device,
                      param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                      pin_memory=cpu_offload and bool(getattr(offload, "pin_memory", True)),
                      cast_forward_inputs=bool(mp.cast_forward_inputs), output_dtype=mp.output_dtype,
                      comm_policy=comm_policy)


def collect_params(modules: tuple[nn.Module, ...], ignored: set[int], mesh: Any
             ) -> tuple[list[ParamEntry], list[ShardedUnit]]:
    """The parameters under ``modules`` that no other unit holds (unit_walk.py's walk
    of each, a parameter tied between them taken once), checked: an absorbed
    tiny unit must not have run, and a parameter another unit already shards
    (a tied weight) is an error."""
    DTensor, _, _ = dtensor_api()
    found: dict[int, ParamEntry] = {}
    absorbed: list[ShardedUnit] = []
    for module in modules:
        entries, taken = walk_unit(module, unit_of, lambda u: u.mergeable, ignored)
        for fqn, owners, p in entries:
            if id(p) in found:
                found[id(p)][1].extend(owners)
            else:
                found[id(p)] = (fqn, owners, p)
        absorbed += [u for u in taken if u not in absorbed]
    for unit in absorbed:
        if unit.schedule is not None:
            raise RuntimeError(f"fully_shard: '{unit.name}' already ran forward; apply fully_shard to every "
                               "module before the first forward")
    scalars = [fqn for fqn, _, p in found.values() if p.dim() == 0]
    if scalars:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise ValueError(
            f"rank {rank}: fully_shard: parameter '{scalars[0]}' is 0-dimensional (a scalar), and fully_shard "
            "shards a dim of every parameter; torch's fully_shard refuses it too (\"fully_shard doesn't support "
            "scalar parameters\"). Make it a 1-D tensor of one element (nn.Parameter(value.reshape(1))), or pass "
            "it in ignored_params (then it is neither sharded nor averaged: all-reduce its gradient yourself)")
    for fqn, _, p in found.values():
        if isinstance(p, DTensor) and not _held_by(p, absorbed) and _sharded_by_a_unit(p, mesh):
            raise ValueError(f"fully_shard: parameter '{fqn}' is already sharded by another unit (tied "
                             "weights?); call fully_shard on a module that contains every user of it")
    return list(found.values()), absorbed


def modules_of(module: Any) -> tuple[nn.Module, ...]:
    """The modules of one ``fully_shard`` call: ``module``, or the outermost of a
    list of modules (one unit for all of them, as torch's FSDP2 takes it)."""
    if isinstance(module, nn.Module):
        return (module,)
    if isinstance(module, (list, tuple)) and module and all(isinstance(m, nn.Module) for m in module):
        inner = {id(sub) for m in module for sub in m.modules() if sub is not m}
        unique = list({id(m): m for m in module}.values())
        return tuple(m for m in unique if id(m) not in inner)
    what = type(module).__name__ if not isinstance(module, (list, tuple)) else (
        "an empty list" if not module else
        f"a list holding a {next(type(m).__name__ for m in module if not isinstance(m, nn.Module))}")
    raise TypeError(f"fully_shard takes an nn.Module or a non-empty list of nn.Modules (one unit for all of "
                    f"them), got {what}")


def shard_dims(params: list[ParamEntry], absorbed: list[ShardedUnit], tp: list[TensorParallelParam | None],
                shard_placement_fn: Any, world_size: int) -> list[int]:
    """The dim each parameter is sharded on: ``shard_placement_fn(param)``'s
    ``Shard(d)``, or 0 for None (torch's FSDP2's rule); an absorbed unit's
    parameters keep theirs."""
    _, Shard, _ = dtensor_api()
    earlier = {id(m.sharded): m.spec.shard_dim for u in absorbed for m in u.params.managed}
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(f"fully_shard: shard_placement_fn must be a callable param -> Shard(dim) or None, "
                        f"got {shard_placement_fn!r}")
    dims = []
    for (fqn, _, p), t in zip(params, tp):
        if id(p) in earlier or shard_placement_fn is None:
            dims.append(earlier.get(id(p), 0))
            continue
        placement = shard_placement_fn(p)
        if placement is None:
            dims.append(0)
            continue
        if type(placement).__name__ == "ShardPlacementResult":
            raise NotImplementedError(
                f"fully_shard: shard_placement_fn returned a ShardPlacementResult (a mesh of its own) for "
                f"'{fqn}'; tandem shards a unit over one mesh: return Shard(dim) or None, and call fully_shard "
                "separately, with that mesh, on the module holding such parameters")
        if not isinstance(placement, Shard):
            raise TypeError(f"fully_shard: shard_placement_fn returned {placement!r} for '{fqn}'; it must "
                            "return Shard(dim) or None")
        d = placement.dim + p.dim() if placement.dim < 0 else placement.dim
        if not 0 <= d < p.dim():
            raise ValueError(f"fully_shard: shard_placement_fn returned {placement} for '{fqn}' of shape "
                             f"{tuple(p.shape)}: dim {placement.dim} is out of range; return Shard(d) with "
                             f"0 <= d < {p.dim()}")
        if d and t is not None:
            raise NotImplementedError(f"fully_shard: shard_placement_fn returned {placement} for the "
                                      f"tensor-parallel parameter '{fqn}'; its data-parallel shards are on "
                                      "dim 0 only (Note [2-D parameters] in tensor_parallel.py): return None for it")
        if d and p.shape[d] % world_size:
            raise ValueError(f"fully_shard: shard_placement_fn returned {placement} for '{fqn}' of shape "
                             f"{tuple(p.shape)}: its {p.shape[d]} rows on dim {d} do not divide among the "
                             f"{world_size} ranks of the shard group (as in torch's FSDP2, a dim other than 0 "
                             "must shard evenly); return Shard(0) or None for it")
        dims.append(d)
    return dims


def _held_by(param: nn.Parameter, units: list[ShardedUnit]) -> bool:
    return any(param is m.sharded for u in units for m in u.params.managed)


def _sharded_by_a_unit(param: Any, mesh: Any) -> bool:
    """Whether a DTensor parameter is a unit's shard: over this data-parallel
    mesh (1-D, or 2-D under HSDP), or over the 2-D mesh of a tensor-parallel
    layout (Note [2-D parameters] in tensor_parallel.py), rather than a
    tensor-parallel parameter over a sibling of ``mesh``."""
    return param.device_mesh.ndim == 2 or param.device_mesh == mesh


def tensor_parallel_layouts(params: list[ParamEntry], absorbed: list[ShardedUnit],
                     mesh: Any) -> list[TensorParallelParam | None]:
    """Each parameter's 2-D layout (None for a plain one); an absorbed unit's
    parameters keep the layout that unit gave them."""
    earlier = {id(m.sharded): m.tp for u in absorbed for m in u.params.managed}
    DTensor, _, _ = dtensor_api()
    if mesh.ndim == 2:
        tensor_parallel = [(fqn, p) for fqn, _, p in params if isinstance(p, DTensor) and id(p) not in earlier]
        if tensor_parallel:
            fqn, p = tensor_parallel[0]
            raise NotImplementedError(
                f"fully_shard: parameter '{fqn}' is a DTensor over {p.device_mesh}, "
                f"and mesh={mesh} is 2-D: HSDP of tensor-parallel parameters is not supported. For DP x TP "
                "pass the 1-D data-parallel slice (mesh=mesh['dp']); for HSDP use plain parameters")
    return [earlier[id(p)] if id(p) in earlier else tensor_parallel_param(fqn, p, mesh)
            for fqn, _, p in params]


def move_to_device(module: nn.Module, params: list[ParamEntry], device: torch.device) -> None:
    """Move the unit's parameters and the module's buffers to ``device`` (as
    torch's FSDP2 does); sharded parameters of absorbed units, and meta tensors
    (Note [meta init] in api.py), are left where they are."""
    if device.type == "cpu":
        return
    DTensor, _, _ = dtensor_api()
    with torch.no_grad():
        for _, _, p in params:
            if not isinstance(p, DTensor) and not p.is_meta and p.device != device:
                p.data = p.data.to(device)
        for m in module.modules():
            for name, b in m._buffers.items():
                if b is not None and not b.is_meta and b.device != device:
                    m._buffers[name] = b.to(device)
