"""What ``nn.Module._apply`` (``to_empty``, ``to(device)``, ``to(dtype)``,
``cuda()``, ``bfloat16()``) does to a sharded unit: Note [meta init] in api.py.

``_apply`` swaps each sharded parameter's contents for a new local tensor; the
unit then takes them back into its shard buffer, the all-gather's input, and
follows a change of device or dtype with its other buffers.

# Note [dtype after sharding]
A conversion to another dtype (``model.to(torch.bfloat16)`` after fully_shard,
as torch's FSDP2 allows) changes the unit's dtypes with it: the shards (and
so the optimizer's view and the reduced gradients) are in the new dtype, and so
are the gathered parameters unless a MixedPrecisionPolicy names
``param_dtype``. The unsharded parameter objects stay (post-accumulate-grad
hooks and compiled graphs hold them) and point into a new unsharded buffer in
the new compute dtype. Allowed between steps only: ``_apply`` reshards first,
and a reduction in flight would write the old dtype.
"""

from __future__ import annotations

import torch

from tandem._compat import dtensor_local
from tandem.fsdp.unit import ShardedUnit
from tandem.fsdp.unit_state import ReduceState, ShardState

__all__ = ["adopt_sharded_tensors"]


def adopt_sharded_tensors(unit: ShardedUnit) -> None:
    """Take the sharded parameters' local tensors back into ``unit``'s shard
    buffer after ``nn.Module._apply`` replaced them.

    Raises:
        ValueError: the conversion left the unit's parameters in several dtypes.
    """
    # Those that gather themselves keep the local tensor _apply made (Note [tensor-subclass gathers] in unit_params.py).
    locals_ = [dtensor_local(m.sharded) for m in unit.params.flat]
    if not locals_:
        return
    if len({t.is_meta for t in locals_}) > 1:
        # Only part of the unit was given memory: the module of an absorbed tiny
        # unit (Note [tiny units] in api.py), whose _apply runs before that of
        # the module owning the unit. That one converts the rest and adopts all;
        # until it does, the unit stays on meta (its first forward says so).
        return
    dtypes = {t.dtype for t in locals_}
    if len(dtypes) > 1:
        listing = ", ".join(f"{m.fqn}: {t.dtype}" for m, t in zip(unit.params.flat, locals_))
        raise ValueError(f"fully_shard unit '{unit.name}': a conversion left its parameters with mixed "
                         f"dtypes ({listing}); one collective gathers a unit, so its parameters need one "
                         "dtype: convert them all (model.to(dtype))")
    device, dtype = locals_[0].device, dtypes.pop()
    if dtype != unit.params.orig_dtype:
        _change_dtype(unit, dtype)
    if device != unit.params.shard_flat.device or dtype != unit.params.shard_flat.dtype:
        # On the shard device, a new buffer as the unit makes it: pinned under CPUOffloadPolicy
        # (a meta model's shards get their memory here), so that each gather's copy to the
        # device is asynchronous, as torch's FSDP2 pins them in to_empty too.
        unit.params.shard_flat = (unit.params.new_shard_buffer() if device == unit.config.shard_device
                                  else torch.zeros(unit.params.shard_flat.shape, dtype=dtype, device=device))
    with torch.no_grad():
        for m, t in zip(unit.params.flat, locals_):
            view = unit.params.shard_flat.narrow(0, m.spec.shard_offset, m.spec.local_numel).view(m.spec.local_shape)
            if t.data_ptr() != view.data_ptr() or t.device != view.device:
                view.copy_(t)
                t.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
    if unit.params.unsharded_flat.is_meta and device.type != "meta":  # after the copies freed the old shards
        unit.params.rebuild_unsharded()


def _change_dtype(unit: ShardedUnit, dtype: torch.dtype) -> None:
    """Note [dtype after sharding]."""
    if unit.state is not ShardState.SHARDED or unit.reduce_state is not ReduceState.IDLE:
        raise RuntimeError(f"fully_shard unit '{unit.name}' changes dtype while {unit.state.name} with its "
                           f"gradient reduction {unit.reduce_state.name}: convert the model between steps")
    if any(m.tp is not None for m in unit.params.managed):
        raise NotImplementedError(f"fully_shard unit '{unit.name}': changing the dtype of tensor-parallel "
                                  "parameters after sharding; cast the model before parallelising it")
    params = unit.params
    params.orig_dtype = dtype
    param_dtype = unit.config.param_dtype or dtype
    params.reduce_dtype = unit.config.reduce_dtype or param_dtype
    if param_dtype != params.param_dtype:
        params.param_dtype = param_dtype
        unit.params.rebuild_unsharded()
