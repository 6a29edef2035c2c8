"""``plan``: will a model fit, and how should it be sharded? The model, sample,
loss and tensor-parallel plan loaded from objects or entry points, the sample
measured (:func:`measure`), the report built (:func:`plan_report`)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tandem.fsdp.layout import DEFAULT_MIN_UNIT_BYTES
from tandem.planner.tensor_parallel import tensor_parallel_shards
from tandem.tools.entry import load_entry
from tandem.tools.plan.build import default_fsdp_units, plan_report
from tandem.tools.plan.measure import measure
from tandem.tools.plan.report import PlanReport

__all__ = ["plan"]


def plan(model: nn.Module | str, *, world_size: int, sample: Any = None, optimizer: str | int = "adamw",
         device_memory: int | str | None = None, grad_accum: int = 1,
         loss_fn: Callable[[Any, Any], torch.Tensor] | str | None = None, bucket_cap_mb: float | None = None,
         fsdp_units: Sequence[str] | None = None, min_unit_bytes: int = DEFAULT_MIN_UNIT_BYTES,
         broadcast_buffers: bool = True, tensor_parallel: int = 1,
         tp_plan: Mapping[str, Any] | str | None = None, hsdp: int = 1,
         activation_checkpointing: bool = False, elastic: bool = False, nodes: int = 1,
         param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
         cpu_offload: bool = False) -> PlanReport:
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
        bucket_cap_mb: DDP's argument.
        broadcast_buffers: DDP's argument.
        fsdp_units: the modules fully_shard is applied to
            (:func:`default_fsdp_units`).
        min_unit_bytes: fully_shard's argument.
        tensor_parallel: the size of ``mesh["tp"]`` on a 2-D mesh ``(dp, tp)``;
            sizes are then per rank of the mesh, planned on the local shapes
            ``tp_plan`` gives each parameter (activations are still measured
            on the unsharded model, an overestimate).
        tp_plan: the plan given to ``parallelize_module(model, mesh["tp"],
            tp_plan)`` (or an entry point returning it): module-path patterns
            (``"blocks.*.up"``) -> ``ColwiseParallel()``, ``RowwiseParallel()``
            or ``"colwise"``, ``"rowwise"``, ...
        hsdp: replicas of an HSDP mesh ``(hsdp, world_size // hsdp)``,
            planned beside fully_shard (1: none).
        elastic: plan for an elastic job (ZeRO-1/2's buddy copies).
        nodes: the nodes the ranks are on: the report adds each strategy's
            bytes per step between them (``report.between_nodes(name)``).
        activation_checkpointing: plan with each fully_shard unit's module
            (``fsdp_units``: every block) checkpointed, as torchtitan applies
            ``checkpoint_wrapper``; the report shows each block's activations
            with and without. With checkpointing, a rank holds at most what the
            rest of the model saves, every block's inputs, and the largest
            block's activations during its recomputation.
        param_dtype: fully_shard's ``MixedPrecisionPolicy.param_dtype``: the
            units are gathered in it, and the sample's forward runs on a copy
            of the model with its floating parameters and inputs cast to it,
            as fully_shard computes (None: in the parameters' own dtype).
        reduce_dtype: ``MixedPrecisionPolicy.reduce_dtype`` (None: ``param_dtype``).
        cpu_offload: fully_shard with ``offload_policy=CPUOffloadPolicy()``
            (shards, gradients and optimizer state on the host).

    Returns:
        The :class:`PlanReport`; ``print(report.describe())`` shows it.

    Raises:
        ValueError: an entry point that cannot be loaded, or a bad option
            (naming it and the value).

    Warning:
        The sample's forward runs for real, on the device the model is
        on: build the model on CPU (and measure with the per-rank batch) when it
        is large. With ``param_dtype`` the copy it runs on adds the
        parameters' size in that dtype.
    """
    # tensor_parallel: Note [planning a tensor-parallel mesh] in tandem/planner/tensor_parallel.py;
    # activation_checkpointing: Note [checkpointed activations] in tandem/tools/activations.py.
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
    units = default_fsdp_units(model) if fsdp_units is None else fsdp_units
    blocks: Sequence[str] = units if activation_checkpointing else ()
    measurement = None if sample is None else measure(
        _computing_in(model, param_dtype), sample, loss_fn=loss_fn, blocks=blocks, input_dtype=param_dtype,
        units=units)
    return plan_report(model, world_size=world_size, measurement=measurement, optimizer=optimizer,
                       device_memory=device_memory, grad_accum=grad_accum, bucket_cap_mb=bucket_cap_mb,
                       fsdp_units=fsdp_units, min_unit_bytes=min_unit_bytes, broadcast_buffers=broadcast_buffers,
                       tensor_parallel=tensor_parallel, tp_plan=styles, hsdp=hsdp,
                       activation_checkpointing=activation_checkpointing, elastic=elastic, nodes=nodes,
                       param_dtype=param_dtype, reduce_dtype=reduce_dtype, cpu_offload=cpu_offload)


def _computing_in(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """``model``, or a copy of it computing in ``dtype`` as fully_shard does under
    ``MixedPrecisionPolicy(param_dtype=dtype)``: floating parameters cast,
    buffers as they are. Only the cast parameters are new memory."""
    cast = {id(p): nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            for p in model.parameters() if dtype is not None and p.is_floating_point() and p.dtype != dtype}
    return copy.deepcopy(model, cast) if cast else model


def _call(spec: str, what: str) -> Any:
    return load_entry(spec, what=what)()
