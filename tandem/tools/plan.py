"""``tandem plan``: will it fit, and how should I shard it? Answered before
anything is launched, from the model's shapes and one small forward on CPU.

Two parts, as everywhere in tandem: :func:`plan_report` is pure (a
:class:`PlanReport` from the model's parameters and buffers, what was
measured, and the options: DDP's buckets, the memory per rank under DDP,
ZeRO-1, ZeRO-2 and fully_shard (and HSDP with ``hsdp`` replicas: fully_shard's
at ``world_size // hsdp`` ranks) from :func:`tandem.zero.estimate_memory`, the
bytes each rank sends per step (:mod:`tandem.zero.traffic`), which strategy
fits, the batch arithmetic, the warnings; on a dp x tp mesh, per rank
of the mesh from the local shapes :func:`tensor_parallel_shards` derives from a
tensor-parallel plan); :func:`measure` runs the forward and backward that
measure the activations and find the parameters the forward does not reach;
:func:`plan` and :func:`main` (the command line) tie them together.

# Note [measured activations]
Activations are what autograd saves for backward: every tensor passed to a
saved-tensors pack hook during one forward with the sample batch, counted by
distinct storage (a view and its base are one allocation; an op that saves its
output shares the storage of the next op's saved input), leaving out the
parameters' and buffers' storages, which are counted as parameters. The
input batch is counted when an op saves it. The gradients are then taken with
``torch.autograd.grad``, so the model's ``.grad`` stays as it was; buffers
changed by the forward (BatchNorm's running statistics) are restored.
Measured on the device the model is on, in its dtype, without autocast: a
model trained under autocast saves some half-precision tensors instead.
Activations grow with the batch: measure with the per-rank batch you will train.
With ``activation_checkpointing`` each block's share is measured too, and the
activations are what checkpointing every block holds at most (Note
[checkpointed activations] in tandem/tools/activations.py).

On a dp x tp mesh: Note [planning a tensor-parallel mesh] in tandem/tools/tp_plan.py.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem._tree import iter_tensors
from tandem.ddp.graph import reachable_params
from tandem.ddp.plan import BucketPlan
from tandem.fsdp.layout import DEFAULT_MIN_UNIT_BYTES
from tandem.tools.activations import ActivationRecorder, BlockActivations, checkpointed_bytes
from tandem.tools.entry import load_entry
from tandem.tools.tp_plan import TensorParallelShard, parse_mesh, tensor_parallel_shards
from tandem.zero.memory import FullyShardSpec, MemoryEstimate, estimate_memory
from tandem.zero.traffic import Traffic, ddp_traffic, fully_shard_traffic

__all__ = ["OPTIMIZER_STATE_BYTES", "Measurement", "PlanReport", "StrategyMemory", "default_fsdp_units",
           "main", "measure", "parse_bytes", "plan", "plan_report"]

OPTIMIZER_STATE_BYTES = {
    "adamw": 8, "adam": 8,          # exp_avg, exp_avg_sq
    "sgd": 0,                       # torch's default: momentum=0, no state
    "sgd-momentum": 4, "momentum": 4, "adagrad": 4, "rmsprop": 4, "lion": 4,
}
"""Optimizer state bytes per fp32 parameter element, by ``--optimizer`` name."""

STRATEGIES = ("DDP", "ZeRO-1", "ZeRO-2", "fully_shard")
"""The strategies every report plans, in this order; with ``hsdp`` replicas an
``HSDP RxS`` row follows, and is preferred to fully_shard when both fit (the
first that fits in order of communication and complexity is chosen)."""


# ---------------------------------------------------------------------- the report

@dataclass(frozen=True)
class StrategyMemory:
    """One strategy's bytes per rank (:class:`tandem.zero.MemoryEstimate`) with
    the measured activations."""

    name: str
    estimate: MemoryEstimate
    activations: int
    refused: str | None = None
    """Why tandem cannot run this strategy on this model (None: it can)."""

    @property
    def peak(self) -> int:
        """The most this rank holds at once (:meth:`MemoryEstimate.peak`)."""
        return self.estimate.peak(self.activations)


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What one forward and backward with the sample batch found (:func:`measure`)."""

    activation_bytes: int
    """Bytes of the distinct storages saved for backward (Note [measured activations])."""
    batch_size: int | None
    """Dim 0 of the first input tensor: the per-rank batch."""
    unused: tuple[str, ...] = ()
    """Trainable parameters the outputs do not reach in the autograd graph."""
    opaque: bool = False
    """The graph hides what it reaches (reentrant checkpointing): ``unused`` is unknown."""
    blocks: tuple[BlockActivations, ...] = ()
    """Each measured block's share (Note [checkpointed activations]); empty unless asked for."""

    @property
    def checkpointed_bytes(self) -> int:
        """The activations held at most with every block in :attr:`blocks`
        checkpointed (``activation_bytes`` when there are none)."""
        return checkpointed_bytes(self.activation_bytes, self.blocks)


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    """Everything ``tandem plan`` prints (:meth:`describe`)."""

    model: str
    """The model's class name."""
    world_size: int
    """Data-parallel ranks planned for (all the ranks without tensor parallelism)."""
    tensor_parallel: int = 1
    """Ranks of each tensor-parallel group (``mesh["tp"]``); the mesh has
    ``world_size * tensor_parallel`` ranks."""
    tp_shards: tuple[TensorParallelShard, ...] = ()
    """The parameters ``tp_plan`` makes DTensors, with their local shapes."""
    optimizer: str
    """The optimizer's name."""
    optimizer_bytes_per_param: int
    """Its state per parameter element."""
    num_params: int
    """Parameter elements, frozen ones included (of the whole model)."""
    num_local: int
    """Parameter elements one rank holds (its tensor-parallel shards; ``num_params`` without)."""
    num_trainable: int
    """Elements DDP reduces on one rank."""
    param_bytes: int
    """Bytes of the parameters one rank holds."""
    buffers: tuple[tuple[str, int], ...]
    """Buffers DDP broadcasts before every forward (name, bytes); empty with ``broadcast_buffers=False``."""
    buckets: BucketPlan
    """The buckets DDP plans at construction."""
    param_names: tuple[str, ...]
    """The trainable parameters, by the indices the buckets use."""
    strategies: tuple[StrategyMemory, ...]
    """DDP, ZeRO-1, ZeRO-2 and fully_shard, in that order (ZeRO-1/2 refused
    with tensor-parallel parameters: :attr:`StrategyMemory.refused`)."""
    measurement: Measurement | None
    """What the sample forward measured (None: no sample given)."""
    grad_accum: int
    """Micro-batches per optimizer step."""
    device_memory: int | None
    """Bytes of one device, to choose a strategy (None: no choice)."""
    fsdp_units: tuple[str, ...]
    """The modules fully_shard is planned on (besides the root)."""
    hsdp: int = 1
    """Replicas of an HSDP mesh ``(hsdp, world_size // hsdp)`` planned beside
    fully_shard (1: none)."""
    traffic: tuple[tuple[str, Traffic], ...] = ()
    """Bytes one rank sends per step under DDP, fully_shard and HSDP (Note
    [traffic per step] in tandem/zero/traffic.py)."""
    activation_checkpointing: bool = False
    """Every block in ``measurement.blocks`` is checkpointed: the strategies'
    activations are :attr:`Measurement.checkpointed_bytes`."""
    warnings: tuple[str, ...]
    """What to change before launching."""

    @property
    def ranks(self) -> int:
        """Ranks of the whole mesh: ``world_size * tensor_parallel``."""
        return self.world_size * self.tensor_parallel

    @property
    def global_batch(self) -> int | None:
        """Per-rank batch x gradient accumulation x data-parallel size (the
        ranks of a tensor-parallel group share one batch; None: no sample)."""
        if self.measurement is None or self.measurement.batch_size is None:
            return None
        return self.measurement.batch_size * self.grad_accum * self.world_size

    @property
    def choice(self) -> StrategyMemory | None:
        """The first strategy (in :data:`STRATEGIES` order) that tandem can run
        and whose peak fits ``device_memory``; None when none does or no device
        memory was given."""
        if self.device_memory is None:
            return None
        preferred = sorted(self.strategies, key=lambda s: (s.name == "fully_shard", self.strategies.index(s)))
        return next((s for s in preferred if s.refused is None and s.peak <= self.device_memory), None)

    def describe(self) -> str:
        """The report as text (what ``tandem plan`` prints)."""
        return "\n".join(_describe(self))


def plan_report(model: nn.Module, *, world_size: int, measurement: Measurement | None = None,
                optimizer: str | int = "adamw", device_memory: int | str | None = None, grad_accum: int = 1,
                bucket_cap_mb: float | None = None, fsdp_units: Sequence[str] | None = None,
                min_unit_bytes: int = DEFAULT_MIN_UNIT_BYTES, broadcast_buffers: bool = True,
                tensor_parallel: int = 1, tp_plan: Mapping[str, Any] | None = None, hsdp: int = 1,
                activation_checkpointing: bool = False) -> PlanReport:
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
            tensor_parallel`` (Note [planning a tensor-parallel mesh]).
        tp_plan: what you pass to ``parallelize_module(model, mesh["tp"], ...)``:
            module-path patterns -> ``ColwiseParallel()``, ``RowwiseParallel()``
            (or ``"colwise"``, ``"rowwise"``), ``SequenceParallel()``, ...
        hsdp: replicas of an HSDP mesh ``(hsdp, world_size // hsdp)``
            (``fully_shard(model, mesh=...)`` with a 2-D mesh), planned as an
            extra strategy (1: none).
        activation_checkpointing: plan with the blocks of ``measurement``
            checkpointed (it must have measured them: :func:`measure` with ``blocks``).

    Raises:
        ValueError: a bad ``world_size``, ``grad_accum``, ``optimizer``,
            ``device_memory``, ``tensor_parallel``, ``tp_plan`` or ``hsdp``,
            and what :func:`tandem.zero.estimate_memory` rejects.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
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
    spec = FullyShardSpec(units=units, min_unit_bytes=min_unit_bytes)
    local_shapes = {s.name: s.local_shape for s in shards}
    estimates = estimate_memory(model, world_size, optimizer_bytes_per_param=opt_bytes,
                                bucket_cap_mb=bucket_cap_mb, fsdp=spec, local_shapes=local_shapes)
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
        strategies=tuple(StrategyMemory(name, e, activations, refused if name.startswith("ZeRO") else None)
                         for name, e in zip(STRATEGIES, estimates))
        + ((StrategyMemory(f"HSDP {hsdp}x{shard_size}", hybrid, activations),) if hybrid is not None else ()),
        measurement=measurement, grad_accum=grad_accum, device_memory=device, fsdp_units=units, warnings=(),
        hsdp=hsdp, traffic=_traffic(estimates, hybrid, spec, world_size, hsdp, grad_accum),
        activation_checkpointing=activation_checkpointing)
    warnings = _warnings(report, model, spec, estimates[3])
    return PlanReport(**{**report.__dict__, "warnings": tuple(warnings)})


def _traffic(estimates: list[MemoryEstimate], hybrid: MemoryEstimate | None, spec: FullyShardSpec,
             world_size: int, hsdp: int, grad_accum: int) -> tuple[tuple[str, Traffic], ...]:
    rows = [("DDP", ddp_traffic(_buckets_of(estimates[0]), world_size)),
            ("fully_shard", fully_shard_traffic(estimates[3].units, spec, micro_batches=grad_accum))]
    if hybrid is not None:
        rows.append((f"HSDP {hsdp}x{world_size // hsdp}",
                     fully_shard_traffic(hybrid.units, spec, replicate=hsdp, micro_batches=grad_accum)))
    return tuple(rows)


def default_fsdp_units(model: nn.Module) -> list[str]:
    """The modules to call fully_shard on by default: the items of every
    ``nn.ModuleList`` (the repeated blocks of a transformer or an MLP), as
    torchtitan shards ``model.layers``; the root is always a unit."""
    units = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            units += [f"{name}.{k}" if name else k for k, _ in module.named_children()]
    return units


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


# ---------------------------------------------------------------------- the text

def _describe(r: PlanReport) -> list[str]:
    mesh = r.tp_shards or r.tensor_parallel > 1
    where = (f"a {r.world_size} x {r.tensor_parallel} mesh (dp={r.world_size} x tp={r.tensor_parallel} = "
             f"{r.ranks} ranks)" if mesh else f"{r.world_size} rank(s)")
    lines = [f"tandem plan: {r.model} on {where}, optimizer {r.optimizer} "
             f"({r.optimizer_bytes_per_param} bytes of state per parameter element)", ""]
    frozen = r.num_local - r.num_trainable
    per_rank = f", {r.num_local:,} per rank" if mesh else ""
    lines.append(f"model        {r.num_params:,} parameter elements{per_rank} ({_size(r.param_bytes)})"
                 + (f", {frozen:,} of them frozen" if frozen else "")
                 + f"; {len(r.buffers)} buffer(s) broadcast by DDP")
    m = r.measurement
    if m is None:
        lines.append("batch        no sample given (--sample): activations not measured, not included below")
    else:
        if r.global_batch is not None:
            ranks = f"{r.world_size} data-parallel rank(s)" if mesh else f"{r.world_size} rank(s)"
            lines.append(f"batch        {m.batch_size} per rank x {r.grad_accum} accumulation step(s) x "
                         f"{ranks} = global batch {r.global_batch}"
                         + (f" (the {r.tensor_parallel} ranks of a tensor-parallel group share a batch)"
                            if mesh else ""))
        lines.append(f"activations  {_size(m.activation_bytes)} per rank per micro-batch "
                     "(measured: tensors saved for backward in one forward"
                     + ("; unsharded, in one process: an overestimate for the tensor-parallel layers)"
                        if mesh else ")"))
        if m.blocks:
            lines += _checkpoint_lines(r, m)
    if mesh:
        lines += ["", *_mesh_lines(r)]
    lines += ["", *_bucket_lines(r), "", *_memory_lines(r), "", *_traffic_lines(r)]
    if r.device_memory is not None:
        lines.append("")
        choice = r.choice
        if choice is None:
            best = min((s for s in r.strategies if s.refused is None), key=lambda s: s.peak)
            lines.append(f"fits in {_size(r.device_memory)}: nothing; the smallest is {best.name} at "
                         f"{_size(best.peak)} ({_size(best.peak - r.device_memory)} over): use more ranks, "
                         "a smaller per-rank batch with more accumulation steps, or activation checkpointing")
        else:
            margin = r.device_memory - choice.peak
            lines.append(f"fits in {_size(r.device_memory)}: {choice.name}, peak {_size(choice.peak)}, "
                         f"margin {_size(margin)} ({margin / r.device_memory:.0%})")
    if r.warnings:
        lines += ["", "warnings:", *(f"  - {w}" for w in r.warnings)]
    return lines


def _checkpoint_lines(r: PlanReport, m: Measurement, limit: int = 8) -> list[str]:
    used = "used below" if r.activation_checkpointing else "not used below: pass --activation-checkpointing"
    lines = [f"  with activation checkpointing of {len(m.blocks)} block(s): {_size(m.checkpointed_bytes)} "
             f"({used}); per block: saved without, kept with (its inputs)"]
    width = max(len(b.name) for b in m.blocks)
    for b in m.blocks[:limit]:
        lines.append(f"    {b.name:<{width}}  {_size(b.saved):>10}  {_size(b.inputs):>10}")
    if len(m.blocks) > limit:
        lines.append(f"    ... and {len(m.blocks) - limit} more")
    return lines


def _mesh_lines(r: PlanReport, limit: int = 12) -> list[str]:
    modules = {s.module for s in r.tp_shards}
    lines = [f"tensor parallel  {len(r.tp_shards)} parameter(s) of {len(modules)} module(s) are DTensors over "
             f"tp={r.tensor_parallel}; every size below is one rank's: its tensor-parallel shard (tp rank 0's, "
             f"the largest), then its share over dp={r.world_size}"]
    groups: dict[tuple[str, ...], int] = {}   # one line per plan key, parameter and layout
    for s in r.tp_shards:
        attr = s.name[len(s.module) + 1:] if s.name.startswith(f"{s.module}.") else s.name
        row = (f"{s.key}: {attr}" if s.key else attr, s.style, s.placement,
               "x".join(map(str, s.shape)) + " -> " + "x".join(map(str, s.local_shape)))
        groups[row] = groups.get(row, 0) + 1
    width = max((len(row[0]) for row in groups), default=0)
    for (what, style, placement, shapes), count in list(groups.items())[:limit]:
        lines.append(f"  {what:<{width}}  {style:<8}  {placement:<11}  {shapes}"
                     + (f"  (x{count})" if count > 1 else ""))
    if len(groups) > limit:
        lines.append(f"  ... and {len(groups) - limit} more")
    return lines


def _bucket_lines(r: PlanReport, limit: int = 8) -> list[str]:
    plan = r.buckets
    solo = sum(b.solo for b in plan.buckets)
    lines = [f"DDP buckets  {plan.describe()}" + (f", {solo} solo (reduced in place)" if solo else "")
             + "; re-planned after step 1 in gradient arrival order"]
    for b in plan.buckets[:limit]:
        names = [r.param_names[i] for i in b.params]
        span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        lines.append(f"  {b.index:>4}  {len(names):>4} param(s)  {_size(b.nbytes):>10}"
                     f"{'  solo' if b.solo else ''}  {span}")
    if len(plan.buckets) > limit:
        lines.append(f"  ... and {len(plan.buckets) - limit} more")
    return lines


def _memory_lines(r: PlanReport) -> list[str]:
    columns = ("params", "grads", "optimizer", "between", "activations", "peak")
    lines = ["memory per rank (between: held between steps; peak: adds activations and the "
             "transient buffers)",
             f"  {'':<12}" + "".join(f"{c:>12}" for c in columns)]
    for s in r.strategies:
        e = s.estimate
        if s.refused is not None:
            lines.append(f"  {s.name:<12}" + f"{'n/a':>12}  {s.refused}")
            continue
        values = (e.params, e.grads, e.optimizer, e.steady, s.activations, s.peak)
        lines.append(f"  {s.name:<12}" + "".join(f"{_size(v):>12}" for v in values))
    units = r.strategies[3].estimate.units
    lines.append(f"  fully_shard: {len(units)} unit(s) ("
                 + (", ".join(u.name or "<root>" for u in units[:4]) + (", ..." if len(units) > 4 else ""))
                 + (")" if r.strategies[1].refused else
                    "); ZeRO-1/2 also hold fp32 master copies of their shard, counted as optimizer"))
    return lines


def _traffic_lines(r: PlanReport) -> list[str]:
    lines = [f"traffic per rank per step (bytes sent, ring algorithms; {r.grad_accum} micro-batch(es))"]
    for name, t in r.traffic:
        hybrid = name.startswith("HSDP")
        parts = [f"{what} {_size(n)}" for what, n in (("all-gather", t.all_gather),
                                                        ("reduce-scatter", t.reduce_scatter)) if n]
        text = ", ".join(parts) + (f" within shard groups of {r.world_size // r.hsdp}" if hybrid and parts else "")
        if t.all_reduce:
            text += ("; " if parts else "") + f"all-reduce {_size(t.all_reduce)}" + (
                f" across the {r.hsdp} replicas" if hybrid else "")
        lines.append(f"  {name:<12}{_size(t.total):>12}  {text}")
    return lines


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------- measuring

def measure(model: nn.Module, sample: Any, *, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
            blocks: Sequence[str] = ()) -> Measurement:
    """One forward with ``sample`` and the gradients of its loss, measuring the
    activations (Note [measured activations]) and the parameters the outputs
    do not reach. The model's ``.grad`` and buffers are left as they were.

    Args:
        model: the model, measured in the mode it is in (a new module trains:
            dropout saves its masks; ``eval()`` would not).
        sample: one rank's batch, as a Trainer sees it: ``(inputs, targets)``,
            or the inputs alone; the model is called as ``model(inputs)``.
        loss_fn: ``loss_fn(outputs, targets)``; None (or no targets): the sum
            of the outputs' floating tensors stands in for the loss.
        blocks: module paths whose share of the activations to measure, for
            activation checkpointing (Note [checkpointed activations]).

    Raises:
        ValueError: the forward produces no tensor that requires grad, or a
            block that is not a module of ``model``.
    """
    inputs, targets = _split(sample)
    ignored = frozenset(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and n not in ignored]
    params = [p for _, p in named]
    names = {id(p): n for n, p in named}
    recorder = ActivationRecorder(model, blocks)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.enable_grad(), recorder:
            outputs = model(inputs)
            loss = _loss(outputs, targets, loss_fn)
        reach = reachable_params([t for t in iter_tensors(outputs) if t.requires_grad],
                                 {id(p): i for i, p in enumerate(params)})
        wanted = [p for i, p in enumerate(params) if i in reach.params]
        if wanted:
            torch.autograd.grad(loss, wanted, allow_unused=True)
    finally:
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
    unused = () if reach.opaque else tuple(names[id(p)] for i, p in enumerate(params) if i not in reach.params)
    first = next(iter_tensors(inputs), None)
    return Measurement(activation_bytes=recorder.total,
                       batch_size=int(first.shape[0]) if first is not None and first.dim() else None,
                       unused=unused, opaque=reach.opaque, blocks=recorder.blocks())


def _split(sample: Any) -> tuple[Any, Any]:
    if isinstance(sample, (tuple, list)) and len(sample) == 2:
        return sample[0], sample[1]
    return sample, None


def _loss(outputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> torch.Tensor:
    if loss_fn is not None and targets is not None:
        return loss_fn(outputs, targets)
    parts = [t.float().sum() for t in iter_tensors(outputs) if t.requires_grad and t.is_floating_point()]
    if not parts:
        raise ValueError(f"the model's output ({type(outputs).__name__}) holds no floating tensor that "
                         "requires grad: nothing to take gradients of; does the model have trainable "
                         "parameters, and does the sample reach them?")
    return torch.stack(parts).sum()


# ---------------------------------------------------------------------- the runner

def plan(model: nn.Module | str, *, world_size: int, sample: Any = None, optimizer: str | int = "adamw",
         device_memory: int | str | None = None, grad_accum: int = 1,
         loss_fn: Callable[[Any, Any], torch.Tensor] | str | None = None, bucket_cap_mb: float | None = None,
         fsdp_units: Sequence[str] | None = None, min_unit_bytes: int = DEFAULT_MIN_UNIT_BYTES,
         broadcast_buffers: bool = True, tensor_parallel: int = 1,
         tp_plan: Mapping[str, Any] | str | None = None, hsdp: int = 1,
         activation_checkpointing: bool = False) -> PlanReport:
    """Will ``model`` fit on ``world_size`` ranks, and how should it be sharded?

    Args:
        model: an ``nn.Module``, or an entry point ``"package.module:build"``
            called with no arguments to build it; not yet tensor-parallel.
        world_size: data-parallel ranks (all the ranks without tensor parallelism).
        sample: one rank's batch, ``(inputs, targets)`` or the inputs (or an
            entry point returning it); None: activations are not measured.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd-momentum"``, ...
            (:data:`OPTIMIZER_STATE_BYTES`) or bytes of state per element.
        device_memory: bytes (or ``"16GiB"``) of one device: the report names
            the first of DDP, ZeRO-1, ZeRO-2, fully_shard that fits, with the margin.
        grad_accum: micro-batches per optimizer step.
        loss_fn: ``loss_fn(outputs, targets)`` (or an entry point), for the
            measured backward.
        bucket_cap_mb, broadcast_buffers: DDP's arguments.
        fsdp_units, min_unit_bytes: how fully_shard is applied
            (:func:`default_fsdp_units`).
        tensor_parallel: the size of ``mesh["tp"]`` on a 2-D mesh ``(dp, tp)``
            (Note [planning a tensor-parallel mesh]); sizes are then per rank
            of the mesh.
        tp_plan: the plan given to ``parallelize_module(model, mesh["tp"],
            tp_plan)`` (or an entry point returning it): module-path patterns
            (``"blocks.*.up"``) -> ``ColwiseParallel()``, ``RowwiseParallel()``
            or ``"colwise"``, ``"rowwise"``, ...
        hsdp: replicas of an HSDP mesh ``(hsdp, world_size // hsdp)``,
            planned beside fully_shard (1: none).
        activation_checkpointing: plan with each fully_shard unit's module
            (``fsdp_units``: every block) checkpointed, as torchtitan applies
            ``checkpoint_wrapper``; the report shows each block's activations
            with and without (Note [checkpointed activations]).

    Returns:
        The :class:`PlanReport`; ``print(report.describe())`` shows it.

    Raises:
        ValueError: an entry point that cannot be loaded, or a bad option
            (naming it and the value).

    .. warning:: the sample's forward runs for real, on the device the model is
        on: build the model on CPU (and measure with the per-rank batch) when it
        is large.
    """
    if isinstance(model, str):
        model = _call(model, "--model")
    if not isinstance(model, nn.Module):
        raise ValueError(f"the model must be an nn.Module or an entry point 'module:function' returning "
                         f"one, got {type(model).__name__}")
    if isinstance(sample, str):
        sample = _call(sample, "--sample")
    if isinstance(loss_fn, str):
        loss_fn = load_entry(loss_fn, what="--loss")
    styles: Mapping[str, Any] | None = _call(tp_plan, "--tp-plan") if isinstance(tp_plan, str) else tp_plan
    tensor_parallel_shards(model, styles, tensor_parallel)   # a bad plan fails before the forward runs
    blocks: Sequence[str] = ()
    if activation_checkpointing:
        blocks = default_fsdp_units(model) if fsdp_units is None else fsdp_units
    measurement = None if sample is None else measure(model, sample, loss_fn=loss_fn, blocks=blocks)
    return plan_report(model, world_size=world_size, measurement=measurement, optimizer=optimizer,
                       device_memory=device_memory, grad_accum=grad_accum, bucket_cap_mb=bucket_cap_mb,
                       fsdp_units=fsdp_units, min_unit_bytes=min_unit_bytes, broadcast_buffers=broadcast_buffers,
                       tensor_parallel=tensor_parallel, tp_plan=styles, hsdp=hsdp,
                       activation_checkpointing=activation_checkpointing)


def _call(spec: str, what: str) -> Any:
    return load_entry(spec, what=what)()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem plan",
        description="Before launching: DDP's buckets, memory per rank under DDP, ZeRO-1, ZeRO-2 and "
                    "fully_shard (activations measured with one forward on a sample batch), which fits "
                    "a device, and what to fix; on a dp x tp mesh with torch's tensor parallelism too.")
    p.add_argument("--model", required=True, metavar="MOD:FN", help="a function building the model")
    p.add_argument("--sample", metavar="MOD:FN",
                   help="a function returning one rank's batch, (inputs, targets) or inputs")
    p.add_argument("--loss", metavar="MOD:FN", help="loss_fn(outputs, targets) (default: sum of the outputs)")
    ranks = p.add_mutually_exclusive_group(required=True)
    ranks.add_argument("--world-size", type=int, help="number of ranks (data parallel only)")
    ranks.add_argument("--mesh", metavar="dp=N,tp=M",
                       help="a 2-D mesh: N data-parallel x M tensor-parallel ranks (with --tp-plan)")
    p.add_argument("--tp-plan", metavar="MOD:FN",
                   help="a function returning the dict given to parallelize_module(model, mesh['tp'], plan): "
                        "module patterns -> ColwiseParallel()/RowwiseParallel() or 'colwise'/'rowwise'")
    p.add_argument("--optimizer", default="adamw",
                   help=f"{', '.join(OPTIMIZER_STATE_BYTES)}, or state bytes per element (default adamw)")
    p.add_argument("--device-memory", metavar="SIZE", help="memory of one device, e.g. 16GiB or 80GB")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP's bucket_cap_mb")
    p.add_argument("--fsdp-units", metavar="NAMES",
                   help="comma-separated modules to fully_shard (default: the items of every ModuleList)")
    p.add_argument("--no-broadcast-buffers", action="store_true", help="DDP's broadcast_buffers=False")
    p.add_argument("--hsdp", type=int, default=1, metavar="R",
                   help="also plan HSDP: fully_shard over a 2-D mesh of R replicas x world-size/R shards")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="plan with each block (the fully_shard units) checkpointed; shows each block's "
                        "activations with and without (needs --sample)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``tandem plan``. Returns 0, 1 when ``--device-memory`` is given and no
    strategy fits, 2 on bad arguments."""
    parser = build_parser()
    args = parser.parse_args(argv)
    units = None if args.fsdp_units is None else [u for u in args.fsdp_units.split(",") if u]
    try:
        dp, tp = (args.world_size, 1) if args.mesh is None else parse_mesh(args.mesh)
        report = plan(args.model, world_size=dp, sample=args.sample, optimizer=args.optimizer,
                      device_memory=args.device_memory, grad_accum=args.grad_accum, loss_fn=args.loss,
                      bucket_cap_mb=args.bucket_cap_mb, fsdp_units=units,
                      broadcast_buffers=not args.no_broadcast_buffers, tensor_parallel=tp, tp_plan=args.tp_plan,
                      hsdp=args.hsdp, activation_checkpointing=args.activation_checkpointing)
    except ValueError as e:
        print(f"tandem plan: error: {e}", file=sys.stderr)
        return 2
    print(report.describe())
    return 1 if report.device_memory is not None and report.choice is None else 0
