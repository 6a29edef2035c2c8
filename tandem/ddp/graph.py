"""Which parameters can the outputs of a forward reach in the autograd graph?

Used by ``find_unused_parameters=True``: parameters the outputs cannot reach get
no gradient in this backward, so their buckets must not wait for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tandem._compat import is_opaque_backward_node

__all__ = ["Reach", "opaque_nodes", "reachable_params"]


@dataclass(frozen=True)
class Reach:
    params: frozenset[int]  # indices of the parameters reached
    opaque: bool            # the graph holds a node that hides what it reaches


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


def opaque_nodes(roots: list[Any]) -> list[Any]:
    """The opaque nodes (Note [end of backward] in reducer.py) in the graph behind
    the nodes ``roots``."""
    found, stack, seen = [], list(roots), set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if is_opaque_backward_node(node):
            found.append(node)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return found
