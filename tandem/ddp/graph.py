"""Which parameters can the outputs of a forward reach in the autograd graph?

Used by ``find_unused_parameters=True``: parameters the outputs cannot reach get
no gradient in this backward, so their buckets must not wait for them. Also the
walks over nested inputs and outputs (tuples, lists, dicts, dataclasses) that
DDP, fully_shard and the Trainer share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tandem._compat import is_opaque_backward_node

__all__ = ["Reach", "iter_tensors", "map_tensors", "reachable_params", "to_device"]


@dataclass(frozen=True)
class Reach:
    params: frozenset[int]  # indices of the parameters reached
    opaque: bool            # the graph holds a node that hides what it reaches


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) output: tuples, lists, dicts, dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name))


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it moved to ``device`` (see :func:`map_tensors`)."""
    return map_tensors(lambda t: t.to(device, non_blocking=True), obj)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it (tuples, named tuples,
    lists, dicts, dataclasses rebuilt; anything else as it is)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(fn, o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, o) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(fn, v)) for k, v in obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(fn, getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def reachable_params(outputs: list[torch.Tensor], index_of: dict[int, int]) -> Reach:
    """Walk the graph back from ``outputs``.

    Args:
        outputs: tensors produced by the forward.
        index_of: ``id(param) -> index`` for the parameters of interest.
    """
    reached: set[int] = set()
    opaque = False
    stack = []
    for t in outputs:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif id(t) in index_of:
            reached.add(index_of[id(t)])
    seen: set[Any] = set()  # the nodes themselves, so that ids are not reused
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad holds its leaf
        if variable is not None:
            idx = index_of.get(id(variable))
            if idx is not None:
                reached.add(idx)
            continue
        if is_opaque_backward_node(node):
            opaque = True
        for nxt, _ in node.next_functions:
            if nxt is not None:
                stack.append(nxt)
    return Reach(frozenset(reached), opaque)
