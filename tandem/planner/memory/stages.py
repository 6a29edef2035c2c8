"""``estimate_memory``: the bytes per rank of one model at ZeRO stages 0 to 3
(buckets.py for stages 0 to 2, units.py and fully_shard.py for stage 3), on
the shapes one rank holds (Note [local shapes]); and the plain-text table of
its result (:func:`format_memory_table`).

# Note [local shapes]
Under tensor parallelism (Note [tensor-parallel parameters] in
tandem/dtensor.py) a rank holds its shard of a parameter, and tandem's data
parallelism reduces and shards that local tensor: DDP's buckets hold its
elements, fully_shard chunks its rows across the data-parallel ranks (Note
[2-D parameters] in tandem/fsdp/tensor_parallel.py). :func:`estimate_memory`
therefore takes the shapes one rank holds (``local_shapes``, tensor-parallel
rank 0's, the largest chunks) in place of the parameters' own, with
``world_size`` the data-parallel size, and every formula of Notes [stages 0
to 2 memory] (buckets.py) and [stage 3 memory] (fully_shard.py) applies to
them unchanged. ``tandem plan`` (tandem/tools/plan/) derives them from a
tensor-parallel plan. ``total`` adds the peaks of
``gathered`` and ``reducing`` to the steady state: an upper bound on what
fully_shard holds at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from torch import nn

from tandem.ddp.plan import ParamInfo
from tandem.planner.memory.buckets import ddp_bucket_plan, stage0_estimate, zero_stage_estimate
from tandem.planner.memory.estimate import FullyShardSpec, MemoryEstimate
from tandem.planner.memory.fully_shard import stage3_estimate
from tandem.planner.memory.units import plan_units

__all__ = ["estimate_memory", "format_memory_table"]


def estimate_memory(model: nn.Module, world_size: int, *, optimizer_bytes_per_param: int = 8,
                    bucket_cap_mb: float | None = None, fsdp: FullyShardSpec | None = None,
                    gradient_as_bucket_view: bool = False,
                    local_shapes: Mapping[str, Sequence[int]] | None = None) -> list[MemoryEstimate]:
    """Per-rank memory of ``model`` at ZeRO stages 0, 1, 2 and 3.

    Args:
        model: the model; only its parameters' shapes, dtypes and
            ``requires_grad`` are read (stages 0-2 reduce the trainable ones, as
            DDP does, skipping ``_ddp_params_and_buffers_to_ignore``; stage 3
            shards every parameter, frozen ones included).
        world_size: ranks the state would be sharded over.
        optimizer_bytes_per_param: optimizer state per parameter element; 8 is
            Adam's two fp32 moments, 4 is SGD with momentum, 0 plain SGD.
        bucket_cap_mb: DDP's bucket cap (None: DDP's default, a 1 MiB first
            bucket then 25 MiB).
        fsdp: how ``tandem.fully_shard`` is applied, for stage 3 (default: to
            the root only, one unit holding the whole model).
        gradient_as_bucket_view: DDP's argument, for stage 0.
        local_shapes: the shape one rank holds of each parameter named here
            (by its name in ``named_parameters()``) in place of its own: the
            tensor-parallel shards (tensor-parallel rank 0's, the largest);
            ``world_size`` is then the data-parallel size.

    Returns:
        One estimate per stage; stages 0-2 carry DDP's bucket plan, stage 3 its
        units. Activations are not included (:meth:`MemoryEstimate.peak` adds
        them).

    Raises:
        ValueError: ``world_size < 1``, a negative ``optimizer_bytes_per_param``,
            no trainable parameters, or an ``fsdp.units`` name that is not a
            submodule of ``model``; and what ``fully_shard`` would reject: a
            unit mixing dtypes, a parameter tied across units, a 0-d parameter.

    Warning:
        Stage 3's ``gathered`` assumes forward runs the units in module
        registration order; a model that calls its blocks in another order
        prefetches other neighbours.
    """
    # The formulas: Notes [stages 0 to 2 memory] in buckets.py and [stage 3 memory] in fully_shard.py;
    # local_shapes: Note [local shapes] above.
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if optimizer_bytes_per_param < 0:
        raise ValueError(f"optimizer_bytes_per_param must be >= 0, got {optimizer_bytes_per_param}")
    shapes = _shapes_of(model, local_shapes)
    ignored = frozenset(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    infos = [ParamInfo(n, math.prod(shapes[id(p)]), p.dtype, p.device)
             for n, p in model.named_parameters() if p.requires_grad and n not in ignored]
    if not infos:
        raise ValueError("the model has no trainable parameters")
    params = sum(math.prod(shapes[id(p)]) * p.element_size() for p in model.parameters())
    ddp = ddp_bucket_plan(infos, world_size, bucket_cap_mb=bucket_cap_mb,
                          gradient_as_bucket_view=gradient_as_bucket_view)
    zero = ddp_bucket_plan(infos, world_size, zero_stage=1, bucket_cap_mb=bucket_cap_mb)
    spec = fsdp if fsdp is not None else FullyShardSpec()
    units = plan_units(model, world_size, spec, shapes)
    return [
        stage0_estimate(ddp, infos, params, world_size, optimizer_bytes_per_param, gradient_as_bucket_view,
                tensor_parallel=bool(local_shapes)),
        *(zero_stage_estimate(stage, zero, infos, params, world_size, optimizer_bytes_per_param) for stage in (1, 2)),
        stage3_estimate(units, spec, optimizer_bytes_per_param),
    ]


def _shapes_of(model: nn.Module, local_shapes: Mapping[str, Sequence[int]] | None) -> dict[int, tuple[int, ...]]:
    """``id(parameter) -> the shape a rank holds`` (Note [local shapes])."""
    named = dict(model.named_parameters())
    unknown = sorted(set(local_shapes or ()) - set(named))
    if unknown:
        raise ValueError(f"local_shapes names {unknown}, not parameters of {type(model).__name__} "
                         f"(its parameters: {', '.join(list(named)[:6])}{', ...' if len(named) > 6 else ''})")
    shapes = {id(p): tuple(p.shape) for p in named.values()}
    for name, shape in (local_shapes or {}).items():
        shapes[id(named[name])] = tuple(int(s) for s in shape)
    return shapes


def format_memory_table(estimates: list[MemoryEstimate], world_size: int) -> str:
    """A plain-text table of :func:`estimate_memory`'s result.

    Args:
        estimates: what :func:`estimate_memory` returned.
        world_size: the world size it was given (for the title).

    Returns:
        One row per stage, and for stage 3 a line on its units.
    """
    columns = ("params", "grads", "optimizer", "gathered", "reducing", "total")
    title = (f"ZeRO memory per rank at world size {world_size} (steady state, then the transient peaks: "
             "the larger of the two at stages 0-2, both at stage 3; activations not included)")
    rows = [title, f"{'stage':>5}" + "".join(f"  {c:>10}" for c in columns)]
    for e in estimates:
        values = (e.params, e.grads, e.optimizer, e.gathered, e.reducing, e.total)
        rows.append(f"{e.stage:>5}" + "".join(f"  {_size(v):>10}" for v in values))
    for e in estimates:
        if e.units:
            largest = max(e.units, key=lambda u: u.layout.unsharded_numel)
            merged = sum(len(u.merged) for u in e.units)
            rows.append(f"stage {e.stage}: {len(e.units)} fully_shard units ({merged} tiny units merged), "
                        f"the largest '{largest.name or '<root>'}' with {largest.layout.numel:,} elements")
    return "\n".join(rows)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
