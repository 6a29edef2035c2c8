"""Splitting a call's inputs across devices, and joining the replicas' outputs.

Both directions are ordinary autograd operations (``chunk``, ``.to``, ``cat``),
so backward needs nothing custom: the gradient of a chunk lands in its slice of
the input, and the gradient of a gathered output goes back to the device of the
replica that produced it. Where source and target are the same device, ``.to``
returns the tensor itself and ``chunk`` returns views, so nothing is copied.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["gather", "scatter", "scatter_kwargs"]


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _init_fields(obj: Any) -> list[str]:
    # Fields with init=False are recomputed by the class (__post_init__, defaults).
    return [f.name for f in dataclasses.fields(obj) if f.init]


def scatter(obj: Any, devices: Sequence[torch.device], dim: int = 0) -> list[Any]:
    """Split ``obj`` into one piece per device, as torch's ``scatter`` does.

    Tensors are split with ``torch.chunk`` along ``dim`` and each chunk is moved
    to its device. ``chunk`` sizes are ``ceil(n / len(devices))``: a batch of 7
    over 3 devices gives 3, 3 and 1, and a batch of 2 over 3 devices gives only
    two pieces. Tuples, namedtuples, lists, dicts and dataclass instances are
    split member by member, giving as many pieces as their shortest member.
    Anything else (numbers, strings, ``None``, empty containers) is passed by
    reference to every device.

    Returns:
        A list of at most ``len(devices)`` pieces; piece ``i`` is for ``devices[i]``.
    """

    def split(o: Any) -> list[Any]:
        if isinstance(o, torch.Tensor):
            return [c.to(d) for c, d in zip(o.chunk(len(devices), dim), devices)]
        if _is_namedtuple(o):
            return [type(o)(*members) for members in zip(*map(split, o))]
        if isinstance(o, tuple) and o:
            return list(zip(*map(split, o)))
        if isinstance(o, list) and o:
            return [list(members) for members in zip(*map(split, o))]
        if isinstance(o, dict) and o:
            keys = list(o)
            return [type(o)(zip(keys, values)) for values in zip(*(split(o[k]) for k in keys))]
        if _is_dataclass_instance(o):
            names = _init_fields(o)
            if names:
                return [dataclasses.replace(o, **dict(zip(names, values)))
                        for values in zip(*(split(getattr(o, n)) for n in names))]
        return [o for _ in devices]

    return split(obj)


def scatter_kwargs(inputs: tuple[Any, ...], kwargs: dict[str, Any] | None,
                   devices: Sequence[torch.device],
                   dim: int = 0) -> tuple[tuple[tuple[Any, ...], ...], tuple[dict[str, Any], ...]]:
    """Scatter positional and keyword arguments together: piece ``i`` of both is
    for ``devices[i]``.

    Arguments are split as one structure, so there are as many pieces as the
    tensor that splits into the fewest (torch instead pads the shorter list with
    empty arguments, and a replica can then be called without its inputs).
    """
    pieces = scatter((tuple(inputs), dict(kwargs or {})), devices, dim)
    return tuple(args for args, _ in pieces), tuple(kw for _, kw in pieces)


def gather(outputs: Sequence[Any], device: torch.device, dim: int = 0) -> Any:
    """Join one output per replica into one output on ``device``.

    Tensors are concatenated along ``dim`` (0-dim tensors, such as a loss each
    replica computed, are stacked into a vector, with torch's warning). Tuples,
    namedtuples, lists, dicts and dataclass instances are gathered member by
    member; ``None`` stays ``None``. Other values come back as a list with one
    entry per replica.

    Raises:
        ValueError: replicas returned dicts with different keys, or sequences of
            different lengths.
    """

    def join(outs: Sequence[Any]) -> Any:
        first = outs[0]
        if isinstance(first, torch.Tensor):
            if all(t.dim() == 0 for t in outs):
                warnings.warn(
                    f"Was asked to gather along dimension {dim}, but all input tensors were "
                    "scalars; will instead unsqueeze and return a vector.", stacklevel=4)
                outs = [t.view(1) for t in outs]
            return torch.cat([t.to(device) for t in outs], dim)
        if first is None:
            return None
        if isinstance(first, dict):
            if any(d.keys() != first.keys() for d in outs):
                raise ValueError("DataParallel: replicas returned dicts with different keys: "
                                 f"{[sorted(map(str, d)) for d in outs]}")
            return type(first)((k, join([d[k] for d in outs])) for k in first)
        if isinstance(first, (tuple, list)):
            if any(len(o) != len(first) for o in outs):
                raise ValueError("DataParallel: replicas returned sequences of different "
                                 f"lengths: {[len(o) for o in outs]}")
            members = [join(column) for column in zip(*outs)]
            return type(first)(*members) if _is_namedtuple(first) else type(first)(members)
        if _is_dataclass_instance(first):
            names = _init_fields(first)
            return dataclasses.replace(first, **{n: join([getattr(o, n) for o in outs]) for n in names})
        return list(outs)

    return join(outputs)
