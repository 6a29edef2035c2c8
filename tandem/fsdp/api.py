"""``tandem.fully_shard``: torch's FSDP2 API over tandem's units and schedule.

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
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem._compat import dtensor_api, fsdp_policies
from tandem.comm.group import GroupComm
from tandem.fsdp.convert import adopt_sharded_tensors
from tandem.fsdp.layout import DEFAULT_MIN_UNIT_BYTES
from tandem.fsdp.schedule import UNIT_ATTR, post_forward, pre_forward, unit_of
from tandem.fsdp.state_dict import register_state_dict_hooks
from tandem.fsdp.tensor_parallel import TensorParallelParam, tensor_parallel_param
from tandem.fsdp.unit import ShardState, ShardedUnit, UnitConfig
from tandem.fsdp.units import ParamEntry, walk_unit

__all__ = ["DEFAULT_MIN_UNIT_BYTES", "FSDPModule", "UnshardHandle", "fully_shard"]

logger = logging.getLogger(__name__)

def fully_shard(module: nn.Module, *, mesh: Any = None, reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Any = None, mp_policy: Any = None, offload_policy: Any = None,
                ignored_params: set[nn.Parameter] | None = None,
                min_unit_bytes: int = DEFAULT_MIN_UNIT_BYTES) -> nn.Module:
    """Shard ``module``'s parameters across the ranks of ``mesh`` (ZeRO-3), as
    ``torch.distributed.fsdp.fully_shard`` does, with the same arguments.

    Call it bottom-up: ``for block in model.layers: fully_shard(block)``, then
    ``fully_shard(model)``. Each call makes one *unit* of the parameters under
    ``module`` that no earlier call took; a unit is gathered with one
    all-gather before its forward, freed after it (``reshard_after_forward``),
    gathered again for its backward, and its gradients are reduce-scattered
    into shards. Parameters become ``DTensor`` s sharded on dim 0, so a torch
    optimizer built afterwards over ``model.parameters()`` steps only this
    rank's shards, ``torch.nn.utils.clip_grad_norm_`` clips by the global norm,
    ``model.state_dict()`` is sharded, and ``torch.distributed.checkpoint``
    saves and loads it (at any world size).

    Beyond torch's FSDP2: gathers are prefetched and reduce-scatters run async
    on every backend, CPU/gloo included (Note [prefetch] in schedule.py); ranks
    may use different parameters in a step (Note [gradient flags] in unit.py);
    units under ``min_unit_bytes`` merge into the enclosing unit (Note [tiny
    units]); a full, unsharded state dict loads straight into the sharded
    model (:func:`tandem.fsdp.load_full_state_dict`).

    Args:
        module: the module to shard; it becomes an instance of
            ``FSDP<its class>``, which adds :class:`FSDPModule`'s methods.
        mesh: a 1-D ``DeviceMesh`` of the data-parallel ranks (default: all
            ranks, on ``cuda`` for nccl and ``cpu`` otherwise).
        reshard_after_forward: True frees the parameters after forward and
            gathers them again in backward; False keeps them until after
            backward (no second gather: 1.0x DDP's traffic instead of 1.5x);
            None is True except for the root, whose backward starts at once;
            an int k keeps a 1/k slice after forward and gathers over the
            group of k neighbouring ranks in backward.
        shard_placement_fn: not supported (every parameter is sharded on dim 0);
            must be None.
        mp_policy: torch's ``MixedPrecisionPolicy``: gather and compute in
            ``param_dtype``, reduce in ``reduce_dtype``, cast the output to
            ``output_dtype``, cast floating inputs if ``cast_forward_inputs``.
            Shards, gradients and optimizer state stay in the original dtype.
        offload_policy: torch's ``CPUOffloadPolicy`` keeps shards, their
            gradients and the optimizer step on the CPU (copied to the device
            for each gather); ``OffloadPolicy()`` or None keeps them on the device.
        ignored_params: parameters left as they are: not sharded, not moved,
            their gradients not reduced.
        min_unit_bytes: tandem only: a unit with fewer bytes of parameters
            joins the unit of a later ``fully_shard`` call on an enclosing
            module (0 keeps every call a unit of its own, as torch does).

    Returns:
        ``module``, sharded in place.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: a bad ``reshard_after_forward`` or mesh, mixed dtypes in a
            unit, or a parameter tied to one in another unit.
        NotImplementedError: a 2-D mesh (HSDP) or a ``shard_placement_fn``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard takes an nn.Module, got {type(module).__name__} (groups of "
                        "modules are not supported: call fully_shard on their common parent)")
    if shard_placement_fn is not None:
        raise NotImplementedError("fully_shard: shard_placement_fn is not supported; tandem shards "
                                  "every parameter on dim 0 (pass None)")
    if unit_of(module) is not None and unit_of(module).module is module:  # type: ignore[union-attr]
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}")
    mesh = mesh if mesh is not None else _default_mesh()
    if mesh.ndim != 1:
        raise NotImplementedError(f"fully_shard takes a 1-D mesh of data-parallel ranks, got a {mesh.ndim}-D "
                                  "mesh; pass mesh['dp'] (hybrid sharding is not supported)")
    comm = GroupComm(mesh.get_group())
    reshard = _check_reshard(reshard_after_forward, comm.size)
    config = _unit_config(mesh, mp_policy, offload_policy)
    ignored = {id(p) for p in (ignored_params or ())}
    params, absorbed = _collect(module, ignored, mesh)
    tp = _tensor_parallel(params, absorbed, mesh)
    _move(module, params, config.device)
    unit = ShardedUnit(type(module).__name__, params, mesh, comm, config, tp)
    unit.module = module
    unit.reshard_after_forward = True if reshard is None else reshard
    unit.auto_reshard_after_forward = reshard is None
    unit.mergeable = unit.layout.numel * unit.orig_dtype.itemsize < min_unit_bytes
    for old in absorbed:
        for handle in old.hooks:
            handle.remove()
        assert old.module is not None  # set when its own fully_shard built it
        for m in old.module.modules():
            if unit_of(m) is old:
                setattr(m, UNIT_ATTR, unit)
    setattr(module, UNIT_ATTR, unit)
    unit.hooks = [
        module.register_forward_pre_hook(functools.partial(pre_forward, unit), prepend=True, with_kwargs=True),
        module.register_forward_hook(functools.partial(post_forward, unit)),
        *register_state_dict_hooks(module, unit),
    ]
    cls: type = type(module)  # as a plain type: mypy sees type[Module] as unhashable
    module.__class__ = _fsdp_class(cls)
    logger.debug("fully_shard: unit %s with %d parameters (%d elements), %d tiny units merged",
                 type(module).__name__, len(unit.managed), unit.layout.numel, len(absorbed))
    return module


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: ``wait()`` finishes the gather."""

    def __init__(self, unit: ShardedUnit) -> None:
        self._unit = unit

    def wait(self) -> None:
        if self._unit.state is ShardState.GATHERING:
            self._unit.wait_gather()


class FSDPModule:
    """The methods ``fully_shard`` adds to a module (torch's ``FSDPModule`` API)."""

    def reshard(self) -> None:
        """Free the full parameters now (registering the sharded ones)."""
        _unit(self).reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather the full parameters now; with ``async_op`` return a handle to wait on."""
        unit = _unit(self)
        if unit.state in (ShardState.SHARDED, ShardState.GROUP_SHARDED):
            unit.launch_gather()
        handle = UnshardHandle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward accumulates full gradients locally, without communication
        (torch DDP's ``no_sync``); the next backward with True reduces the sum."""
        for unit in _units(self, recurse):
            unit.requires_grad_sync = bool(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        for unit in _units(self, recurse):
            unit.reshard_after_forward = _check_reshard(reshard_after_forward, unit.comm.size) is not False
            unit.auto_reshard_after_forward = False

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False keeps the full parameters after a backward without gradient sync
        (while accumulating with ``set_requires_gradient_sync(False)``, the next
        forward then needs no gather). A backward that syncs gradients always
        reshards: the optimizer step that follows would leave kept parameters stale."""
        for unit in _units(self, recurse):
            unit.reshard_after_backward = bool(reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these modules' units when this one's forward starts (default: the
        unit that ran next in the previous iteration)."""
        _unit(self).forward_prefetch = [_unit(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these modules' units when this one's backward starts (default: the
        unit whose forward finished just before this one's)."""
        _unit(self).backward_prefetch = [_unit(m) for m in modules]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the world size."""
        if factor <= 0:
            raise ValueError(f"gradient divide factor must be positive, got {factor}")
        for unit in _units(self, True):
            unit.divide_factor = float(factor)

    set_reduce_scatter_divide_factor = set_gradient_divide_factor

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for torch compatibility; every backward finishes its reductions."""

    # Note [copying a sharded model]: torch's fully_shard refuses deepcopy
    # ("FSDP does not support deepcopy. Please use state dict for
    # serialization.") and its modules fail to pickle (their FSDP<class> cannot
    # be looked up); so do tandem's, with an error that names the fix. A copy
    # would need its own units, shard buffers and schedule over the group, which
    # rebuilding the model does better. A shallow copy.copy works, as in torch.
    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise _cannot_copy(self, "deep-copied")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise _cannot_copy(self, "pickled (torch.save)")

    def __copy__(self) -> Any:
        cls = type(self)
        new = cls.__new__(cls)
        new.__dict__.update(self.__dict__)
        return new

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``to_empty``/``to``/``cuda`` on a sharded model (Note [meta init])."""
        units = _units(self, True)
        for unit in units:
            unit.reshard()
        result = super()._apply(fn, recurse)  # type: ignore[misc]
        for unit in units:
            adopt_sharded_tensors(unit)
        return result


# ---------------------------------------------------------------------- helpers

def _unit(module: Any) -> ShardedUnit:
    unit = unit_of(module)
    if unit is None:
        raise ValueError(f"{type(module).__name__} is not a fully_shard module")
    return unit


def _cannot_copy(module: Any, how: str) -> TypeError:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return TypeError(
        f"rank {rank}: a {type(module).__name__} sharded by tandem.fully_shard cannot be {how}: its "
        "parameters are this rank's shards, bound to its process group (torch's fully_shard refuses "
        "this too). Copy its state instead: build the model again, fully_shard it the same way and "
        "load_state_dict(model.state_dict()) (sharded, no communication), or save model.state_dict() "
        "with torch.distributed.checkpoint (its DTensors' full_tensor() gathers a full one, a collective)")


def _units(module: Any, recurse: bool) -> list[ShardedUnit]:
    if not recurse:
        return [_unit(module)]
    units: list[ShardedUnit] = []
    for m in module.modules():
        unit = unit_of(m)
        if unit is not None and unit not in units:
            units.append(unit)
    return units


@functools.cache
def _fsdp_class(cls: type) -> type:
    """``FSDP<cls>``: FSDPModule's methods first, then the module's own class."""
    if issubclass(cls, FSDPModule):
        return cls
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})


def _default_mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed: call tandem.init() (or "
                           "torch.distributed.init_process_group) first, or pass a mesh")
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _check_reshard(value: Any, world_size: int) -> bool | int | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value < 1 or world_size % value:
            raise ValueError(f"reshard_after_forward={value} must divide the mesh size {world_size} "
                             "(the size of the group to gather from in backward)")
        if value == 1:
            return True
        if value == world_size:
            return False
        return value
    raise ValueError(f"reshard_after_forward must be a bool, an int or None, got {value!r}")


def _unit_config(mesh: Any, mp_policy: Any, offload_policy: Any) -> UnitConfig:
    MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy = fsdp_policies()
    mp = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    if not isinstance(mp, MixedPrecisionPolicy):
        raise ValueError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got {mp!r}")
    offload = offload_policy if offload_policy is not None else OffloadPolicy()
    if not isinstance(offload, OffloadPolicy):
        raise ValueError(f"offload_policy must be a torch.distributed.fsdp.OffloadPolicy, got {offload!r}")
    if mesh.device_type == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device(mesh.device_type, torch.cuda.current_device())
    cpu_offload = isinstance(offload, CPUOffloadPolicy)
    return UnitConfig(device=device, shard_device=torch.device("cpu") if cpu_offload else device,
                      param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                      pin_memory=cpu_offload and bool(getattr(offload, "pin_memory", True)),
                      cast_forward_inputs=bool(mp.cast_forward_inputs), output_dtype=mp.output_dtype)


def _collect(module: nn.Module, ignored: set[int], mesh: Any) -> tuple[list[ParamEntry], list[ShardedUnit]]:
    """The parameters under ``module`` that no other unit holds (units.py's walk),
    checked: an absorbed tiny unit must not have run, and a parameter another
    unit already shards (a tied weight) is an error."""
    DTensor, _, _ = dtensor_api()
    entries, absorbed = walk_unit(module, unit_of, lambda u: u.mergeable, ignored)
    for unit in absorbed:
        if unit.schedule is not None:
            raise RuntimeError(f"fully_shard: '{unit.name}' already ran forward; apply fully_shard to every "
                               "module before the first forward")
    for fqn, _, p in entries:
        if isinstance(p, DTensor) and not _held_by(p, absorbed) and _sharded_by_a_unit(p, mesh):
            raise ValueError(f"fully_shard: parameter '{fqn}' is already sharded by another unit (tied "
                             "weights?); call fully_shard on a module that contains every user of it")
    return entries, absorbed


def _held_by(param: nn.Parameter, units: list[ShardedUnit]) -> bool:
    return any(param is m.sharded for u in units for m in u.managed)


def _sharded_by_a_unit(param: Any, mesh: Any) -> bool:
    """Whether a DTensor parameter is a unit's shard: over this data-parallel
    mesh, or over a 2-D one (Note [2-D parameters] in tensor_parallel.py),
    rather than a tensor-parallel parameter over a sibling of ``mesh``."""
    return param.device_mesh.ndim == 2 or param.device_mesh == mesh


def _tensor_parallel(params: list[ParamEntry], absorbed: list[ShardedUnit],
                     mesh: Any) -> list[TensorParallelParam | None]:
    """Each parameter's 2-D layout (None for a plain one); an absorbed unit's
    parameters keep the layout that unit gave them."""
    earlier = {id(m.sharded): m.tp for u in absorbed for m in u.managed}
    return [earlier[id(p)] if id(p) in earlier else tensor_parallel_param(fqn, p, mesh)
            for fqn, _, p in params]


def _move(module: nn.Module, params: list[ParamEntry], device: torch.device) -> None:
    """Move the unit's parameters and the module's buffers to ``device`` (as
    torch's FSDP2 does); sharded parameters of absorbed units, and meta tensors
    (Note [meta init]), are left where they are."""
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
