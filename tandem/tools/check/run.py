"""The two runs of ``tandem check``: the one-process reference on the global
batch (in the calling process) and each rank's run under a strategy (in the
ranks :func:`tandem.spawn` starts; :func:`_rank_main` is what they run, sent by
its module path). Both train with :func:`_train` and record the same things.

# Note [dropout]
One process and N ranks cannot draw the same dropout masks, so for the
comparison every dropout module (``nn.Dropout``, ``Dropout1d/2d/3d``,
``AlphaDropout``, ``FeatureAlphaDropout``) is put in eval mode and
``nn.MultiheadAttention``'s dropout is set to 0, on both sides; the report
lists them. What the comparison cannot see is checked apart: if the model's
forward draws random numbers in training mode and torch's generator is in the
same state on every rank after the factory returns, every rank draws the same
masks, so samples k, k + B/N, ... of the global batch share a mask, which one
process never does. That is reported as a divergence ("every rank draws the
same dropout masks") with the fix. A forward that still draws random numbers
with the dropout modules off (functional dropout) is named in the notes: the
two runs cannot match draw for draw, and a divergence may come from it.
"""

from __future__ import annotations

import collections
import copy
import functools
import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.fsdp.precision import PrecisionFinding, unit_findings
from tandem.tools.check.inputs import (
    _Batches,
    _build_model,
    _call,
    _loss_fn,
    _loss_name,
    _optimizer_class,
    _Spec,
    sample_keys,
)
from tandem.tools.check.records import RankRecord, ReferenceRun
from tandem.train.strategy import Strategy, apply_strategy

__all__ = ["STRATEGIES"]

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
"""``tandem.DistributedDataParallel``, with ``zero_stage=1`` or ``2`` and a
:class:`tandem.ZeroOptimizer`, and ``tandem.fully_shard`` (each item of every
``nn.ModuleList`` a unit, then the root, as ``tandem plan`` assumes; with
``mp_policy`` where given, and the precision audit of its units in the report)."""

_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _dropout_off(model: nn.Module) -> tuple[str, ...]:
    """Note [dropout]: dropout modules to eval mode, attention dropout to 0."""
    names = []
    for name, m in model.named_modules():
        if isinstance(m, _DROPOUT) and m.p > 0:
            m.eval()
            names.append(f"{name} (p={m.p:g})")
        elif isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            names.append(f"{name} (attention dropout={m.dropout:g})")
            m.dropout = 0.0
    return tuple(names)


def _draws_random(model: nn.Module, inputs: Any) -> bool:
    """Whether a training-mode forward of a copy of ``model`` uses torch's generator."""
    probe = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]):
        before = torch.get_rng_state()
        with torch.no_grad():
            _call(probe, inputs)
        return not torch.equal(before, torch.get_rng_state())


def _record_outputs(model: nn.Module) -> tuple[list[tuple[str, torch.Tensor]], list[Any]]:
    records: list[tuple[str, torch.Tensor]] = []
    seen: collections.Counter[str] = collections.Counter()

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.dim():
                key = name if not seen[name] else f"{name}#{seen[name] + 1}"  # a module called twice
                seen[name] += 1
                records.append((key, output.detach().cpu().clone()))
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
    return records, handles


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full copies of the parameters and floating buffers (a fully-sharded one gathered: a collective)."""
    from tandem._compat import dtensor_api

    DTensor, _, _ = dtensor_api()
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not t.is_floating_point():
            continue
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = full.detach().cpu().clone()
    return out


_Run = tuple[list[float], list[dict[str, torch.Tensor]], list[tuple[str, torch.Tensor]], list[tuple[bytes, ...]]]


def _train(model: nn.Module, forward: nn.Module, optimizer: Any, batch_of: Callable[[int], Any],
           loss_fn: Callable[[Any, Any], torch.Tensor], steps: int,
           grad_max: list[dict[str, float]] | None = None) -> _Run:
    """``steps`` optimizer steps of ``forward`` (``model`` or its wrapper): the losses,
    the snapshots (0: initial), step 1's module outputs and each step's sample keys."""
    snapshots = [_snapshot(model)]
    losses, keys = [], []
    records, handles = _record_outputs(model)
    for step in range(steps):
        inputs, targets = batch = batch_of(step)
        keys.append(sample_keys(batch))
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(_call(forward, inputs), targets)
        if step == 0:
            for h in handles:
                h.remove()
        loss.backward()
        if grad_max is not None:
            grad_max.append({n: float(p.grad.detach().abs().max()) if p.numel() else 0.0
                             for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        losses.append(float(loss.detach()))
        snapshots.append(_snapshot(model))
    return losses, snapshots, records, keys


def _reference(spec: _Spec) -> tuple[ReferenceRun, bool]:
    from tandem.checkpoint.rng import capture_rng_state, restore_rng_state

    saved = capture_rng_state()  # library code leaves the caller's generators as they were
    try:
        batches = _Batches(spec.data, spec.batch_size)
        model = _build_model(spec)
        params = dict(model.named_parameters())
        buffers = tuple(n for n, b in model.named_buffers() if b.is_floating_point())
        first_inputs, first_targets = batches.global_batch(0)
        draws = _draws_random(model, first_inputs)
        layers = _dropout_off(model)
        draws_after = _draws_random(model, first_inputs) if draws else False
        optimizer = _optimizer_class(spec.optimizer)(model.parameters(), **spec.optimizer_kwargs)
        loss_fn = _loss_fn(spec.loss)
        grad_max: list[dict[str, float]] = []
        losses, snapshots, outputs, keys = _train(model, model, optimizer, batches.global_batch, loss_fn,
                                                  spec.steps, grad_max)
        run = ReferenceRun(snapshots=tuple(snapshots), buffers=buffers, losses=tuple(losses),
                           sample_keys=tuple(keys), outputs=tuple(outputs),
                           param_dtypes=tuple({p.dtype for p in params.values() if p.is_floating_point()}),
                           random_layers=layers, draws_random=draws, draws_random_without_dropout=draws_after,
                           module_types={n: type(m).__name__ for n, m in model.named_modules()},
                           loss_name=_loss_name(spec.loss, first_targets), grad_max=tuple(grad_max),
                           adaptive=spec.optimizer not in (torch.optim.SGD, torch.optim.ASGD))
        return run, batches.per_rank
    finally:
        restore_rng_state(saved)


def _wrap(strategy: str, model: nn.Module, spec: _Spec) -> tuple[nn.Module, Any]:
    # Note [one strategy vocabulary] in tandem/train/strategy.py: what prepare builds.
    chosen = Strategy.parse(strategy, who="tandem check")
    options = {"mp_policy": spec.mp_policy} if chosen is Strategy.FULLY_SHARD else {}
    trainable = [p for p in model.parameters() if p.requires_grad]  # a frozen one never steps
    optimizer = _optimizer_class(spec.optimizer)(trainable, **spec.optimizer_kwargs)
    return apply_strategy(model, optimizer, chosen, options=options, world_size=dist.get_world_size())


def _rank_main(rank: int, specs: tuple[_Spec, ...]) -> list[dict[str, RankRecord]]:
    """What each spawned rank runs: every check and strategy in turn, each from a freshly built model."""
    return [{strategy: _rank_run(rank, spec, strategy) for strategy in spec.strategies} for spec in specs]


def _rank_run(rank: int, spec: _Spec, strategy: str) -> RankRecord:
    world_size = dist.get_world_size()
    batches = _Batches(spec.data, spec.batch_size)
    model = _build_model(spec)
    rng = hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=16).digest()
    _dropout_off(model)
    wrapped, optimizer = _wrap(strategy, model, spec)
    precision = _precision(model) if strategy == "fsdp" else ()
    losses, snapshots, outputs, keys = _train(
        model, wrapped, optimizer, functools.partial(batches.rank_batch, rank=rank, world_size=world_size),
        _loss_fn(spec.loss), spec.steps)
    dist.barrier()
    return RankRecord(rank=rank, losses=tuple(losses), sample_keys=tuple(keys), rng_state=rng,
                      outputs=tuple(outputs), snapshots=tuple(snapshots) if rank == 0 else (),
                      precision=precision)


def _precision(model: nn.Module) -> tuple[PrecisionFinding, ...]:
    """The precision audit of every unit fully_shard built under ``model``
    (after tiny units merged: Note [tiny units] in tandem/fsdp/api.py)."""
    from tandem.fsdp.regroup import units_of

    return tuple(f for unit in units_of(model) for f in unit_findings(unit))
