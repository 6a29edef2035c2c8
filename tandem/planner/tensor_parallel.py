"""What torch's tensor parallelism makes of a model's parameters, computed
without applying it: the planner's view of a dp x tp mesh (pure: no process
group, no DTensor).

# Note [planning a tensor-parallel mesh]
A model trained on a 2-D mesh is parallelised with torch's
``parallelize_module(model, mesh["tp"], tp_plan)`` and wrapped with tandem's
DDP or fully_shard over ``mesh["dp"]``. The planner takes the same ``tp_plan``
and the unsharded model and applies nothing: it resolves the plan's keys as
torch does (dot-separated atoms, each an fnmatch pattern over the children at
its level, ``""`` the module itself, a dict value a nested plan), and gives each
parameter the placement torch's style would give it: ``ColwiseParallel`` on an
``nn.Linear`` shards weight and bias on dim 0 and on an ``nn.Embedding`` the
weight on dim 1; ``RowwiseParallel`` shards a Linear's weight on dim 1 (its bias
is replicated) and an Embedding's on dim 0; ``SequenceParallel`` replicates;
``PrepareModule*`` hold no parameters. A DTensor's ``Shard`` splits as
``torch.chunk`` does, ``ceil(n / tp)`` to each rank until the rows run out, so
tensor-parallel rank 0 holds the most. Its local shapes are what every
per-rank size is planned on (Note [local shapes] in tandem/planner/memory/stages.py), with
``world_size`` the data-parallel size: DDP's buckets from the local numels, as
its reducer plans them, and fully_shard's units from the local shapes, chunked
across ``dp``. tandem's DDP refuses ZeRO-1/2 for DTensor parameters, so those
are reported as not applicable. A key that matches no module, or a style on a
module it cannot shard, is an error here (torch skips the first with a
warning and raises on the second).

Activations are still measured with one forward of the unsharded model in one
process, which overestimates a tensor-parallel rank: a Colwise layer's output,
and what the layers after it save, is split over ``tp`` at run time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any

from torch import nn

__all__ = ["TensorParallelShard", "parse_mesh", "tensor_parallel_shards"]


@dataclass(frozen=True)
class TensorParallelShard:
    """One parameter that ``parallelize_module`` makes a DTensor (Note
    [planning a tensor-parallel mesh])."""

    name: str
    """The parameter, by its name in ``named_parameters()``."""
    module: str
    """The module the style was applied to."""
    key: str
    """The ``tp_plan`` key that reached it (``"blocks.*.up"``)."""
    style: str
    """``"colwise"``, ``"rowwise"`` or ``"sequence"``."""
    dim: int | None
    """The dim it is sharded on over ``tp`` (None: replicated)."""
    shape: tuple[int, ...]
    """Its global shape."""
    local_shape: tuple[int, ...]
    """Tensor-parallel rank 0's shard (the largest)."""

    @property
    def placement(self) -> str:
        return "Replicate()" if self.dim is None else f"Shard({self.dim})"


def tensor_parallel_shards(model: nn.Module, tp_plan: Mapping[str, Any] | None, tensor_parallel: int = 1
                           ) -> tuple[TensorParallelShard, ...]:
    """The parameters ``parallelize_module(model, mesh["tp"], tp_plan)`` would
    make DTensors over ``tensor_parallel`` ranks, with rank 0's local shapes
    (Note [planning a tensor-parallel mesh]); nothing is applied.

    Raises:
        ValueError: ``tensor_parallel`` below 1, or above 1 without a plan; a
            key that matches no module; a style torch cannot apply to the module
            it matches, or one that is not planned; a parameter two keys shard.
    """
    if not isinstance(tensor_parallel, int) or isinstance(tensor_parallel, bool) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be an int >= 1 (the size of mesh['tp']), got {tensor_parallel!r}")
    if tp_plan is None:
        if tensor_parallel > 1:
            raise ValueError(f"tensor_parallel={tensor_parallel} needs tp_plan, the dict you give "
                             "parallelize_module (e.g. {'blocks.*.up': ColwiseParallel(), 'blocks.*.down': "
                             "RowwiseParallel()}, or 'colwise'/'rowwise'), to know which parameters are sharded")
        return ()
    if not isinstance(tp_plan, Mapping):
        raise ValueError(f"tp_plan must be a dict of module-path patterns to parallel styles, as "
                         f"parallelize_module takes it, got {type(tp_plan).__name__}")
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[int, TensorParallelShard] = {}
    for module_name, module, style, key in _resolve_plan(model, "", tp_plan, ""):
        for p, dim, kind in _style_params(module, module_name, style, key):
            name = names[id(p)]
            if id(p) in out:
                raise ValueError(f"tp_plan: parameter '{name}' would be distributed twice (by "
                                 f"'{out[id(p)].module}' and '{module_name}'; tied weights, or two keys "
                                 "matching one module?): torch cannot distribute a DTensor again")
            shape = tuple(p.shape)
            if dim is not None and dim >= len(shape):
                raise ValueError(f"tp_plan: '{key}' shards '{name}' of shape {shape} on dim {dim}, "
                                 f"which it does not have")
            local = shape if dim is None else (*shape[:dim], _chunk(shape[dim], tensor_parallel), *shape[dim + 1:])
            out[id(p)] = TensorParallelShard(name, module_name, key, kind, dim, shape, local)
    return tuple(out.values())


def _resolve_plan(module: nn.Module, name: str, plan: Any, key: str) -> list[tuple[str, nn.Module, Any, str]]:
    """``(module name, module, style, the plan key)`` for every module the
    plan reaches, as ``parallelize_module`` walks it (``key``: the keys that
    led to ``module``, joined)."""
    if not isinstance(plan, Mapping):
        return [(name, module, plan, key)]
    out = []
    for path, style in plan.items():
        full = ".".join(k for k in (key, str(path)) if k)
        out += _resolve_path(module, name, str(path).split(".") if path else [], style, full)
    return out


def _resolve_path(module: nn.Module, name: str, tokens: list[str], style: Any, key: str
                  ) -> list[tuple[str, nn.Module, Any, str]]:
    """The modules ``tokens`` (fnmatch patterns, one per level) reach from ``module``."""
    if not tokens:
        return _resolve_plan(module, name, style, key)
    matched = [(n, c) for n, c in module.named_children() if fnmatch(n, tokens[0])]
    if not matched:
        children = ", ".join(n for n, _ in list(module.named_children())[:8]) or "none"
        raise ValueError(f"tp_plan key '{key}' matches no module: '{tokens[0]}' matches no child of "
                         f"{repr(name) if name else 'the model'} ({type(module).__name__}, children: {children}); "
                         "torch would skip it with a warning, leaving those layers unsharded. Fix the path")
    out = []
    for child_name, child in matched:
        out += _resolve_path(child, f"{name}.{child_name}" if name else child_name, tokens[1:], style, key)
    return out


def _style_params(module: nn.Module, module_name: str, style: Any, key: str
                  ) -> list[tuple[nn.Parameter, int | None, str]]:
    """``(parameter, shard dim or None, kind)`` of what ``style`` distributes
    on ``module``, as torch's styles do."""
    kind = _style_kind(style, key)
    where = f"tp_plan['{key}'] matches '{module_name or '<root>'}', a {type(module).__name__}"
    if kind == "none":
        return []
    params = list(module.named_parameters())
    if kind == "sequence":
        return [(p, None, kind) for _, p in params]
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        raise ValueError(f"{where}: {kind} parallelism shards only nn.Linear and nn.Embedding (torch raises "
                         "NotImplementedError); name the layers inside it (e.g. 'blocks.*.mlp.up')")
    if isinstance(module, nn.Embedding):
        return [(p, 1 if kind == "colwise" else 0, kind) for _, p in params]
    if kind == "colwise":
        return [(p, 0, kind) for _, p in params]
    return [(p, 1 if n == "weight" else None, kind) for n, p in params]


def _style_kind(style: Any, key: str) -> str:
    if isinstance(style, str) and style.lower() in ("colwise", "rowwise"):
        return style.lower()
    tp: Any
    try:
        from torch.distributed.tensor import parallel as tp
    except ImportError:  # a torch built without distributed: only the names can be planned
        tp = None
    if tp is not None:
        if isinstance(style, tp.ColwiseParallel):
            return "colwise"
        if isinstance(style, tp.RowwiseParallel):
            return "rowwise"
        if isinstance(style, tp.SequenceParallel):
            return "sequence"
        prepares = tuple(getattr(tp, n) for n in ("PrepareModuleInput", "PrepareModuleOutput",
                                                  "PrepareModuleInputOutput") if hasattr(tp, n))
        if isinstance(style, prepares):
            return "none"
    raise ValueError(f"tp_plan['{key}'] is {style!r}: give ColwiseParallel(), RowwiseParallel(), "
                     "SequenceParallel() or PrepareModuleInput/Output() from torch.distributed.tensor.parallel, "
                     "or the strings 'colwise' or 'rowwise'")


def _chunk(n: int, ranks: int) -> int:
    """Rank 0's part of ``n`` rows split as ``torch.chunk`` splits them."""
    return -(-n // ranks)


def parse_mesh(text: str) -> tuple[int, int]:
    """``"dp=2,tp=4"`` (either order; ``tp`` may be left out) -> ``(dp, tp)``.

    Raises:
        ValueError: naming the text and the form expected.
    """
    sizes: dict[str, int] = {}
    for part in str(text).split(","):
        name, eq, value = part.strip().partition("=")
        name = name.strip().lower()
        if not eq or name not in ("dp", "tp") or name in sizes or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"mesh {text!r} is not 'dp=N,tp=M': name each dimension once, dp (data parallel) "
                             "and tp (tensor parallel), with a size >= 1, e.g. --mesh dp=2,tp=4")
        sizes[name] = int(value)
    if "dp" not in sizes:
        raise ValueError(f"mesh {text!r} has no dp: give the data-parallel size too, e.g. dp=2,tp=4")
    return sizes["dp"], sizes.get("tp", 1)
