"""Which units ``fully_shard`` would build: its calls replayed bottom-up on the
modules named, with tiny units merged as it merges them, each unit with rank
0's layout (:func:`plan_units`, for stage 3 of the memory planner)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tandem.fsdp.layout import plan_unit
from tandem.fsdp.unit_walk import walk_unit
from tandem.planner.memory.estimate import FullyShardSpec, UnitEstimate

__all__ = ["plan_units"]


@dataclass
class _Draft:
    """A unit while the calls are replayed (it may still be absorbed)."""

    name: str
    params: list[tuple[str, nn.Parameter]]
    merged: list[str]
    mergeable: bool


def plan_units(model: nn.Module, world_size: int, spec: FullyShardSpec, shapes: dict[int, tuple[int, ...]]
                ) -> tuple[UnitEstimate, ...]:
    """The units ``fully_shard`` builds when called bottom-up on ``spec.units``
    and the root, in module order (root first), with tiny units merged as
    fully_shard merges them (Note [tiny units] in tandem/fsdp/api.py).

    Args:
        model: the model, not yet sharded.
        world_size: ranks of the mesh.
        spec: the modules and options (:class:`FullyShardSpec`).
        shapes: ``id(parameter) -> the shape a rank holds`` (Note [local shapes] in stages.py).

    Returns:
        One :class:`UnitEstimate` per unit, each with rank 0's layout.

    Raises:
        ValueError: a name in ``spec.units`` that is not a submodule, a unit
            mixing dtypes, a parameter tied across units, or a 0-d parameter.
    """
    modules = dict(model.named_modules())
    missing = [name for name in spec.units if name not in modules]
    if missing:
        known = ", ".join(repr(n) for n in list(modules)[1:9])
        raise ValueError(f"FullyShardSpec.units names {missing}, not submodules of {type(model).__name__} "
                         f"(its submodules: {known}{', ...' if len(modules) > 9 else ''})")
    wanted = set(spec.units) | {""}
    unit_of: dict[int, _Draft] = {}    # id(module given to fully_shard) -> its unit now
    owner: dict[int, _Draft] = {}      # id(parameter) -> the unit holding it
    for name in _post_order(model):    # bottom-up: every call after its submodules' calls
        if name not in wanted:
            continue
        draft = _replay_call(name, modules[name], unit_of, owner, spec.min_unit_bytes, shapes)
        for p in draft.params:
            owner[id(p[1])] = draft
        unit_of.update({key: draft for key, old in unit_of.items() if old.name in draft.merged})
        unit_of[id(modules[name])] = draft
    order = {name: k for k, name in enumerate(modules)}
    drafts = sorted({id(d): d for d in unit_of.values()}.values(), key=lambda d: order[d.name])
    return tuple(UnitEstimate(name=d.name, merged=tuple(d.merged),
                              layout=plan_unit([shapes[id(p)] for _, p in d.params], world_size, 0),
                              dtype=_unit_dtype(d), trainable=tuple(p.requires_grad for _, p in d.params))
                 for d in drafts)


def _replay_call(name: str, module: nn.Module, unit_of: dict[int, _Draft], owner: dict[int, _Draft],
                 min_unit_bytes: int, shapes: dict[int, tuple[int, ...]]) -> _Draft:
    """The unit of ``fully_shard(module)``: the parameters under ``module`` that no
    earlier unit holds, walked as fully_shard walks them (depth first, a
    module's own parameters before its children's), through tiny units (which
    it absorbs) and around the others."""
    entries, absorbed = walk_unit(module, lambda m: unit_of.get(id(m)), lambda u: u.mergeable,
                                  prefix=f"{name}." if name else "")
    params: dict[int, tuple[str, nn.Parameter]] = {}
    for fqn, _, p in entries:
        holder = owner.get(id(p))
        if holder is not None and holder not in absorbed:
            raise ValueError(f"parameter '{fqn}' is also under unit '{holder.name}' (tied weights?); "
                             "fully_shard would reject it: shard a module that contains every user of it")
        params[id(p)] = (fqn, p)
    draft = _Draft(name, list(params.values()), [n for a in absorbed for n in (a.name, *a.merged)], False)
    numel = sum(math.prod(shapes[id(p)]) for _, p in draft.params)
    draft.mergeable = numel * _unit_dtype(draft).itemsize < min_unit_bytes
    return draft


def _unit_dtype(draft: _Draft) -> torch.dtype:
    dtypes = {p.dtype for _, p in draft.params}
    if len(dtypes) > 1:
        listing = ", ".join(f"{fqn}: {p.dtype}" for fqn, p in draft.params)
        raise ValueError(f"unit '{draft.name}' would mix parameter dtypes ({listing}); fully_shard gathers "
                         "a unit with one collective: shard the submodules of each dtype separately")
    return dtypes.pop() if dtypes else torch.get_default_dtype()


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[str]:
    for name, child in module.named_children():
        yield from _post_order(child, _join(prefix, name))
    yield prefix


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
