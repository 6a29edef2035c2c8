"""The plan itself, pure: :func:`plan_report` turns the model's parameters and
buffers (shapes, dtypes, ``requires_grad``; nothing runs) and an optional
:class:`Measurement` into a :class:`PlanReport`: the memory and traffic per
strategy and what to change before launching; with the options it takes
(:func:`parse_bytes`, :data:`OPTIMIZER_STATE_BYTES`, :func:`default_fsdp_units`)."""

from __future__ import annotations

import dataclasses

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tandem.ddp.plan import BucketPlan
from tandem.fsdp.layout import DEFAULT_MIN_UNIT_BYTES
from tandem.planner.memory import FullyShardSpec, MemoryEstimate, estimate_memory, stage3_peak
from tandem.planner.tensor_parallel import tensor_parallel_shards
from tandem.planner.traffic import Traffic, ddp_traffic, fully_shard_traffic, zero_traffic
from tandem.tools.plan.measure import Measurement
from tandem.tools.plan.report import STRATEGIES, PlanReport, StrategyMemory, _size
from tandem.train.strategy import fully_shard_units

__all__ = ["OPTIMIZER_STATE_BYTES", "default_fsdp_units", "parse_bytes", "plan_report"]

OPTIMIZER_STATE_BYTES = {
    "adamw": 8, "adam": 8,          # exp_avg, exp_avg_sq
    "sgd": 0,                       # torch's default: momentum=0, no state
    "sgd-momentum": 4, "momentum": 4, "adagrad": 4, "rmsprop": 4, "lion": 4,
}
"""Optimizer state bytes per fp32 parameter element, by ``--optimizer`` name."""


def plan_report(model: nn.Module, *, world_size: int, measurement: Measurement | None = None,
                optimizer: str | int = "adamw", device_memory: int | str | None = None, grad_accum: int = 1,
                bucket_cap_mb: float | None = None, fsdp_units: Sequence[str] | None = None,
                min_unit_bytes: int = DEFAULT_MIN_UNIT_BYTES, broadcast_buffers: bool = True,
                tensor_parallel: int = 1, tp_plan: Mapping[str, Any] | None = None, hsdp: int = 1,
                activation_checkpointing: bool = False, elastic: bool = False, nodes: int = 1,
                param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                cpu_offload: bool = False) -> PlanReport:
    """The plan, from the model's parameters and buffers (shapes, dtypes,
    ``requires_grad``; nothing runs) and an optional :class:`Measurement`.

    Args:
        model: the model, as it will be wrapped (not yet tensor-parallel).
        world_size: data-parallel ranks (all the ranks without tensor parallelism).
        measurement: what :func:`measure` found (None: activations unknown).
        optimizer: a name in :data:`OPTIMIZER_STATE_BYTES`, or bytes of state
            per parameter element.
        device_memory: bytes of one device (an int or ``"16GiB"``), to choose
            the first strategy that fits.
        grad_accum: micro-batches per optimizer step (for the global batch).
        bucket_cap_mb: DDP's ``bucket_cap_mb`` (None: its default).
        fsdp_units: modules fully_shard is called on (None:
            :func:`default_fsdp_units`).
        min_unit_bytes: fully_shard's ``min_unit_bytes``.
        broadcast_buffers: DDP's ``broadcast_buffers``.
        tensor_parallel: ranks of ``mesh["tp"]``: the mesh is ``world_size x
            tensor_parallel``, and sizes are planned on the local shapes that
            ``tp_plan`` gives each parameter.
        tp_plan: what you pass to ``parallelize_module(model, mesh["tp"], ...)``:
            module-path patterns -> ``ColwiseParallel()``, ``RowwiseParallel()``
            (or ``"colwise"``, ``"rowwise"``), ``SequenceParallel()``, ...
        hsdp: replicas of an HSDP mesh ``(hsdp, world_size // hsdp)``
            (``fully_shard(model, mesh=...)`` with a 2-D mesh), planned as an
            extra strategy (1: none).
        elastic: an elastic job (``tandem run --elastic``): ZeRO-1/2 ranks also
            hold a copy of the previous rank's optimizer-state shard, fully_shard
            ranks of its parameter and optimizer-state shards, so that a lost
            rank's shards survive on its neighbour.
        activation_checkpointing: plan with the blocks of ``measurement``
            checkpointed (it must have measured them: :func:`measure` with ``blocks``).
        nodes: the nodes the ranks are on, ``world_size // nodes`` each: the
            report adds each strategy's bytes per step between the nodes.
        param_dtype: fully_shard's ``MixedPrecisionPolicy.param_dtype``: units are
            gathered in it (None: the parameters' own dtype). The measurement
            should have run in it too (:func:`tandem.tools.plan.plan` does).
        reduce_dtype: ``MixedPrecisionPolicy.reduce_dtype`` (None: ``param_dtype``).
        cpu_offload: fully_shard with ``offload_policy=CPUOffloadPolicy()``: its
            shards, gradients and optimizer state are on the host, not in the
            device's peak.

    Raises:
        ValueError: a bad ``world_size``, ``grad_accum``, ``optimizer``,
            ``device_memory``, ``tensor_parallel``, ``tp_plan``, ``hsdp`` or ``nodes``,
            ``param_dtype``, ``reduce_dtype`` and what :func:`tandem.planner.estimate_memory` rejects.
    """
    # For developers: tensor_parallel is Note [planning a tensor-parallel mesh] in tandem/planner/tensor_parallel.py;
    # elastic Note [buddy copies] in tandem/elastic/buddy.py; nodes Note [bytes between nodes] in
    # tandem/planner/traffic.py; cpu_offload Note [stage 3 memory] in tandem/planner/memory/fully_shard.py.
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(nodes, int) or nodes < 1 or world_size % nodes:
        raise ValueError(f"nodes={nodes!r} must be a number of nodes that divides world_size={world_size} "
                         "(the same number of ranks on each)")
    if not isinstance(hsdp, int) or hsdp < 1 or world_size % hsdp:
        raise ValueError(f"hsdp={hsdp!r} must be a number of replicas that divides world_size={world_size} "
                         "(the HSDP mesh is replicas x shards)")
    if hsdp > 1 and tensor_parallel > 1:
        raise ValueError(f"hsdp={hsdp} with tensor_parallel={tensor_parallel}: fully_shard does not run HSDP of "
                         "tensor-parallel parameters; plan one or the other")
    shards = tensor_parallel_shards(model, tp_plan, tensor_parallel)
    if not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum must be an int >= 1, got {grad_accum!r}")
    opt_name, opt_bytes = _optimizer_bytes(optimizer)
    device = parse_bytes(device_memory) if isinstance(device_memory, str) else device_memory
    if device is not None and device <= 0:
        raise ValueError(f"device_memory must be positive, got {device_memory!r}")
    units = tuple(default_fsdp_units(model) if fsdp_units is None else fsdp_units)
    spec = FullyShardSpec(units=units, min_unit_bytes=min_unit_bytes, param_dtype=param_dtype,
                          reduce_dtype=reduce_dtype, cpu_offload=cpu_offload)
    local_shapes = {s.name: s.local_shape for s in shards}
    estimates = estimate_memory(model, world_size, optimizer_bytes_per_param=opt_bytes,
                                bucket_cap_mb=bucket_cap_mb, fsdp=spec, local_shapes=local_shapes)
    if elastic:
        # Notes [buddy copies] and [one step back] in tandem/elastic/buddy.py: the copy of the
        # previous rank's shard and this rank's kept one; ZeRO-1/2's is the state shard and the
        # rows of the parameters, fully_shard's the parameter shard and its state (Note
        # [elastic fully_shard]).
        estimates = [dataclasses.replace(e, buddy=2 * (e.state + e.rows)) if e.stage in (1, 2) else
                     dataclasses.replace(e, buddy=2 * (e.params + e.optimizer)) if e.stage == 3 else e
                     for e in estimates]
    shard_size = world_size // hsdp
    hybrid = (estimate_memory(model, shard_size, optimizer_bytes_per_param=opt_bytes, fsdp=spec)[3]
              if hsdp > 1 else None)
    refused = (None if not shards else
               "tandem's DDP does not shard tensor-parallel (DTensor) parameters; use fully_shard")
    if activation_checkpointing and (measurement is None or not measurement.blocks):
        raise ValueError("activation_checkpointing=True needs a measurement of the blocks: give a sample "
                         "(--sample), and blocks to checkpoint (the fully_shard units, or --fsdp-units)")
    activations = (0 if measurement is None else
                   measurement.checkpointed_bytes if activation_checkpointing else measurement.activation_bytes)
    step = None if measurement is None or measurement.step is None or tensor_parallel > 1 else \
        dataclasses.replace(measurement.step, checkpointed=activation_checkpointing)

    def phased(e: MemoryEstimate) -> int | None:  # Note [stage 3 peak]
        return None if step is None or e.stage != 3 else stage3_peak(e, spec, step, opt_bytes)
    ignored = frozenset(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    params = dict(model.named_parameters())
    buffers = tuple((n, b.numel() * b.element_size()) for n, b in model.named_buffers()
                    if n not in ignored) if broadcast_buffers else ()
    trainable = tuple(n for n, p in params.items() if p.requires_grad and n not in ignored)
    local = {n: math.prod(local_shapes.get(n, p.shape)) for n, p in params.items()}
    report = PlanReport(
        model=type(model).__name__, world_size=world_size, tensor_parallel=tensor_parallel, tp_shards=shards,
        optimizer=opt_name, optimizer_bytes_per_param=opt_bytes,
        num_params=sum(p.numel() for p in params.values()), num_local=sum(local.values()),
        num_trainable=sum(local[n] for n in trainable),
        param_bytes=estimates[0].params, buffers=buffers,
        buckets=_buckets_of(estimates[0]), param_names=trainable,
        strategies=tuple(StrategyMemory(name, e, activations, refused if name.startswith("ZeRO") else None,
                                        phased(e)) for name, e in zip(STRATEGIES, estimates))
        + ((StrategyMemory(f"HSDP {hsdp}x{shard_size}", hybrid, activations, step_peak=phased(hybrid)),)
           if hybrid is not None else ()),
        measurement=measurement, grad_accum=grad_accum, device_memory=device, fsdp_units=units, warnings=(),
        hsdp=hsdp, traffic=_traffic(estimates, hybrid, spec, world_size, hsdp, grad_accum), nodes=nodes,
        activation_checkpointing=activation_checkpointing, elastic=elastic)
    warnings = _warnings(report, model, spec, estimates[3])
    return PlanReport(**{**report.__dict__, "warnings": tuple(warnings)})


def _traffic(estimates: list[MemoryEstimate], hybrid: MemoryEstimate | None, spec: FullyShardSpec,
             world_size: int, hsdp: int, grad_accum: int) -> tuple[tuple[str, Traffic], ...]:
    rows = [("DDP", ddp_traffic(_buckets_of(estimates[0]), world_size)),
            ("ZeRO-1/2", zero_traffic(_buckets_of(estimates[0]), world_size)),
            ("fully_shard", fully_shard_traffic(estimates[3].units, spec, micro_batches=grad_accum))]
    if hybrid is not None:
        rows.append((f"HSDP {hsdp}x{world_size // hsdp}",
                     fully_shard_traffic(hybrid.units, spec, replicate=hsdp, micro_batches=grad_accum)))
    return tuple(rows)


def default_fsdp_units(model: nn.Module) -> list[str]:
    """The modules to call fully_shard on by default: the items of every
    ``nn.ModuleList`` (the repeated blocks of a transformer or an MLP), as
    torchtitan shards ``model.layers``, innermost first; the root is always a
    unit. The same rule as ``prepare`` and ``tandem check``."""
    return fully_shard_units(model)  # Note [one strategy vocabulary] in tandem/train/strategy.py


def _buckets_of(estimate: MemoryEstimate) -> BucketPlan:
    assert estimate.buckets is not None  # stages 0-2 carry their plan
    return estimate.buckets


def _optimizer_bytes(optimizer: str | int) -> tuple[str, int]:
    if isinstance(optimizer, int) and not isinstance(optimizer, bool) and optimizer >= 0:
        return f"{optimizer} bytes/element", optimizer
    if isinstance(optimizer, str) and optimizer.lower() in OPTIMIZER_STATE_BYTES:
        return optimizer.lower(), OPTIMIZER_STATE_BYTES[optimizer.lower()]
    if isinstance(optimizer, str) and optimizer.isdigit():
        return f"{optimizer} bytes/element", int(optimizer)
    raise ValueError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZER_STATE_BYTES)}: "
                     "name one, or give its state in bytes per parameter element (e.g. 12)")


_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """``"16GiB"``, ``"80GB"``, ``"512M"`` (binary), ``"1e9"`` -> bytes.

    Raises:
        ValueError: naming the text and the units understood.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"device memory {text!r} is not a size: write e.g. 16GiB, 80GB or 512MiB "
                         "(KiB/MiB/GiB/TiB or K/M/G/T are powers of 1024, KB/MB/GB/TB of 1000)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


# ---------------------------------------------------------------------- warnings

def _warnings(report: PlanReport, model: nn.Module, spec: FullyShardSpec, stage3: MemoryEstimate) -> list[str]:
    out = []
    m = report.measurement
    if m is not None and m.opaque:
        out.append("the forward's graph holds a reentrant checkpoint, which hides the parameters it "
                   "reaches: unused parameters could not be checked")
    elif m is not None and m.unused:
        out.append(f"{len(m.unused)} trainable parameter(s) get no gradient from this forward "
                   f"({_names(m.unused)}): DDP needs find_unused_parameters=True (or freeze them with "
                   "requires_grad_(False), or remove them)")
    if report.buffers:
        total = sum(b for _, b in report.buffers)
        out.append(f"DDP broadcasts {len(report.buffers)} buffer(s) ({_size(total)}: "
                   f"{_names([n for n, _ in report.buffers])}) from rank 0 before every forward "
                   "(broadcast_buffers=True, the default): pass broadcast_buffers=False if each rank may "
                   "keep its own (BatchNorm statistics: or tandem.SyncBatchNorm.convert_sync_batchnorm)")
    merged = [n for u in stage3.units for n in u.merged]
    if merged:
        out.append(f"fully_shard: {len(merged)} of the {len(report.fsdp_units)} unit(s) asked for are under "
                   f"min_unit_bytes ({_size(spec.min_unit_bytes)}) and join an enclosing unit "
                   f"({_names(merged)}): each unit costs two or three collectives a step")
    if report.param_bytes < spec.min_unit_bytes and report.world_size > 1:
        out.append(f"the whole model ({_size(report.param_bytes)}) is under fully_shard's min_unit_bytes "
                   f"({_size(spec.min_unit_bytes)}): sharding it saves little and adds collectives; "
                   "DDP is the better choice")
    local = {s.name: s.local_shape for s in report.tp_shards}
    few_rows = [n for n, p in model.named_parameters()
                if p.dim() and local.get(n, tuple(p.shape))[0] < report.world_size]
    if few_rows:
        ranks = f"{report.world_size} data-parallel" if report.tp_shards else f"{report.world_size}"
        out.append(f"fully_shard: {len(few_rows)} parameter(s) have fewer rows than the {ranks} "
                   f"ranks ({_names(few_rows)}): some ranks hold none of them, the others padding")
    uneven = [s.name for s in report.tp_shards if s.dim is not None and s.shape[s.dim] < report.tensor_parallel]
    if uneven:
        out.append(f"tensor parallelism: {len(uneven)} parameter(s) are shorter than the {report.tensor_parallel} "
                   f"tensor-parallel ranks along their sharded dim ({_names(uneven)}): some ranks hold none of them")
    return out


def _names(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", and {len(names) - limit} more" if len(names) > limit else "")
