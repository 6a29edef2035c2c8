"""State dicts of a fully-sharded model: sharded out, sharded or full in.

``model.state_dict()`` holds the sharded parameters (DTensors), which is what
``torch.distributed.checkpoint`` saves and reshards at load. Loading also takes
a *full* state dict, as single-device training writes it with
``torch.save(model.state_dict())``: each plain tensor is cut to this rank's
dim-0 rows before it is copied, so with :func:`load_full_state_dict` (which
memory-maps the file) a rank reads only its own rows and no rank ever holds
the whole model (torch's FSDP2 loads only sharded state dicts).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tandem._compat import dtensor_api

__all__ = ["load_full_state_dict", "register_state_dict_hooks"]


def register_state_dict_hooks(module: nn.Module, unit: Any) -> list[Any]:
    """Hooks on a unit's module: register the sharded parameters before
    ``state_dict()``, and shard full tensors before ``load_state_dict()``."""
    return [
        module.register_state_dict_pre_hook(functools.partial(_to_sharded, unit)),
        module._register_load_state_dict_pre_hook(functools.partial(_shard_full_tensors, unit),
                                                  with_module=True),
    ]


def _to_sharded(unit: Any, module: nn.Module, prefix: str, keep_vars: bool) -> None:
    unit.params.register(unsharded=False)


def _shard_full_tensors(unit: Any, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                        *args: Any) -> None:
    DTensor, _, _ = dtensor_api()
    unit.params.register(unsharded=False)
    # A unit of several modules (Note [grouped modules] in schedule.py) names each
    # parameter under the module it was found in: this hook takes that module's.
    inside = {id(sub) for sub in module.modules()} if len(unit.modules) > 1 else None
    for m in unit.params.managed:
        if inside is not None and id(m.owners[0][0]) not in inside:
            continue
        key = prefix + m.fqn
        value = state_dict.get(key)
        if value is None or isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
            continue
        shape = m.spec.shape if m.tp is None else tuple(m.tp.unsharded_spec.shape)
        if tuple(value.shape) != shape:
            raise ValueError(f"rank {unit.comm.rank}: '{key}' in the state dict has shape {tuple(value.shape)}, "
                             f"the model's parameter has {shape}")
        if m.tp is not None:  # Note [2-D parameters] in tensor_parallel.py: the tensor-parallel shard first
            value = m.tp.local_of_full(value)
        rows = value.narrow(m.spec.shard_dim, m.spec.row_start, m.spec.local_rows)
        local = rows.to(unit.config.shard_device, unit.params.orig_dtype, copy=True)
        state_dict[key] = unit.params.to_dtensor(local, m.spec, m.tp)


def load_full_state_dict(model: nn.Module, source: str | os.PathLike | Mapping[str, Any], *,
                         strict: bool = True) -> Any:
    """Load a full (unsharded) state dict into a fully-sharded ``model``.

    Args:
        model: the model after ``fully_shard``.
        source: a path written by ``torch.save(model.state_dict())`` (memory-mapped,
            so each rank reads only its rows), or the state dict itself.
        strict: as for ``nn.Module.load_state_dict``.

    Returns:
        ``load_state_dict``'s result (missing and unexpected keys).
    """
    if isinstance(source, Mapping):
        state = source
    else:
        state = torch.load(source, map_location="cpu", mmap=True, weights_only=True)
    return model.load_state_dict(state, strict=strict)
