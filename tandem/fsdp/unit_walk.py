"""Which parameters one ``fully_shard`` call takes: a pure walk over the module
tree, shared by ``fully_shard`` and the memory planner (tandem.planner.memory),
so that the planner predicts the units fully_shard builds."""

from __future__ import annotations

from collections.abc import Callable, Set
from typing import Any, TypeVar

from torch import nn

__all__ = ["ParamEntry", "walk_unit"]

U = TypeVar("U")

ParamEntry = tuple[str, list[tuple[nn.Module, str]], nn.Parameter]
"""A parameter's name under the walked module, every (module, attribute) that
holds it (several for tied weights), and the parameter."""


def walk_unit(module: nn.Module, unit_of: Callable[[nn.Module], U | None], mergeable: Callable[[U], bool],
              ignored: Set[int] = frozenset(), prefix: str = "") -> tuple[list[ParamEntry], list[U]]:
    """The parameters under ``module`` that ``fully_shard(module)`` takes.

    Depth first, a module's own parameters before its children's. A submodule
    that is a unit of its own (``unit_of`` returns it and it is not
    ``mergeable``) is skipped with its subtree; a mergeable (tiny) one is
    walked into and returned as absorbed (Note [tiny units] in api.py).

    Args:
        unit_of: the unit an earlier call made of a module, or None.
        mergeable: whether that unit joins this one.
        ignored: ``id()`` of parameters to leave out.
        prefix: prepended to every name (``"blocks.0."``).

    Returns:
        The parameter entries, in walk order, and the absorbed units.
    """
    entries: dict[int, ParamEntry] = {}
    absorbed: list[Any] = []
    stack: list[tuple[str, nn.Module]] = [(prefix, module)]
    while stack:
        path, m = stack.pop()
        unit = unit_of(m)
        if unit is not None and m is not module:
            if not mergeable(unit):
                continue
            if unit not in absorbed:
                absorbed.append(unit)
        for attr, p in m._parameters.items():
            if p is None or id(p) in ignored:
                continue
            if id(p) in entries:
                entries[id(p)][1].append((m, attr))
            else:
                entries[id(p)] = (f"{path}{attr}", [(m, attr)], p)
        for name, child in reversed(list(m.named_children())):
            stack.append((f"{path}{name}.", child))
    return list(entries.values()), absorbed
