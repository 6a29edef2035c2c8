"""One optimizer step of the Trainer: micro-batches under gradient accumulation,
autocast and the scaler, the non-finite guard, clipping, the optimizer and the
scheduler."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from tandem._tree import to_device
from tandem.data import RunningMean
from tandem.ddp.checks import NonFinite, NonFiniteReport, nonfinite_names
from tandem.train.config import TrainerConfig
from tandem.train.probes import batch_len, is_ddp, plain_tensor
from tandem.checkpoint.full_state import is_fully_sharded
from tandem.checkpoint.state import TrainingState

__all__ = ["StepDecider", "StepResult", "StepRunner"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    samples: int
    """This rank's samples in the step."""
    comm_wait: float | None
    """Seconds the synchronised backward waited on communication (None: not measured)."""
    grad_norm: torch.Tensor | None
    """The global gradient norm before clipping (None without clipping)."""
    skipped: bool
    """Whether the step was skipped for non-finite gradients (the same on every rank)."""
    optimizer_s: float = 0.0
    """Seconds in the optimizer's (and scheduler's) step."""


class StepDecider(Protocol):
    """What decides each step of an elastic world with the other members
    (:class:`~tandem.elastic.world.ElasticWorld`)."""

    def step_started(self) -> None: ...
    def decide(self, step: int) -> None: ...


class StepRunner:
    """Runs the Trainer's optimizer steps.

    Args:
        model: the (wrapped) model.
        optimizer: its optimizer; ``scaled``: what a GradScaler unscales and steps
            (the optimizer, or a ZeroOptimizer's gradient shards).
        guard: what a step with NaN/Inf gradients does, when the Trainer must look.
        elastic: the elastic world, which decides each step with the other members
            (Note [elastic trainer] in tandem/elastic/run.py).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 loss_fn: Callable[[Any, Any], torch.Tensor], config: TrainerConfig, state: TrainingState, *,
                 device: torch.device, rank: int, scaler: Any, scaled: Any, guard: NonFinite | None,
                 autocast: Callable[[], Any], elastic: StepDecider | None) -> None:
        self.model, self.optimizer, self.scheduler, self.loss_fn = model, optimizer, scheduler, loss_fn
        self.config, self.state, self.device, self.rank = config, state, device, rank
        self.scaler, self.scaled, self.guard, self.autocast = scaler, scaled, guard, autocast
        self._elastic = elastic
        self.in_step = False  # between a step's first forward and its commit (an elastic world)

    @property
    def counts_skips(self) -> bool:
        """Whether records count the steps skipped for NaN/Inf gradients."""
        return self.guard is not None or self.config.nonfinite is not None

    def run(self, micro_batches: list[Any], loss_mean: RunningMean,
            weights: list[float] | None = None) -> StepResult:
        """One optimizer step over ``micro_batches`` (their losses go into ``loss_mean``),
        each counting ``weights[i]`` times in the mean over the ranks (default 1:
        Note [exact split] in tandem/data/split.py)."""
        samples = 0
        self.in_step = True
        if self._elastic is not None:
            self._elastic.step_started()
        for i, (inputs, targets) in enumerate(micro_batches):
            inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
            with self._grad_sync(enabled=i == len(micro_batches) - 1):
                with self.autocast():
                    loss = self.loss_fn(self.model(inputs), targets)
                n = batch_len(targets)
                if n:  # an empty batch (Note [exact split]) has a loss of 0/0
                    loss_mean.update(loss, weight=n)
                # Note [equal to one process] in trainer.py: micro-batches weigh by their count.
                scaled = loss / len(micro_batches)
                weight = 1.0 if weights is None else weights[i]
                if weight != 1.0:
                    # Note [exact split]: ranks' batches of unequal sizes; every strategy
                    # averages over the ranks, so weighing the loss covers DDP, ZeRO and fully_shard.
                    scaled = scaled * weight
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            samples += n
        if self._elastic is not None:
            # every rank steps, or none (Note [elastic trainer] in tandem/elastic/run.py)
            self._elastic.decide(self.state.step)
        stats = getattr(self.model, "comm_stats", None)
        comm_wait = None if stats is None else stats.wait_s
        if self.guard is not None and self._found_nonfinite():
            # The gradients are dropped already: no optimizer or scheduler step.
            self.optimizer.zero_grad(set_to_none=True)
            self.in_step = False
            return StepResult(samples, comm_wait, None, True)
        started = time.perf_counter()
        grad_norm, skipped = self._optimizer_step()
        optimizer_s = time.perf_counter() - started
        self.in_step = False
        return StepResult(samples, comm_wait, grad_norm, skipped, optimizer_s)

    def _found_nonfinite(self) -> bool:
        """Whether this step's gradients hold NaN/Inf, the same on every rank; in
        "raise" mode that raises instead (DDP raised already, during backward)."""
        if is_ddp(self.model):
            return bool(getattr(self.model, "found_nonfinite", False))
        # One process (Note [check_finite] in ddp/finite.py needs no agreement here).
        names = nonfinite_names([(n, p.grad) for n, p in self.model.named_parameters()
                                 if p.grad is not None])
        if not names:
            return False
        report = NonFiniteReport(step=self.state.step, before=(tuple(names),), after=tuple(names))
        if self.guard is NonFinite.RAISE:
            raise RuntimeError(f"rank {self.rank}: Trainer(nonfinite='raise'): {report.describe()}. "
                               "Find where the NaN/Inf comes from, or pass nonfinite='skip'")
        logger.warning("Trainer: nonfinite='skip' skipped this step: %s", report.describe())
        return True

    def _grad_sync(self, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        """The context of one micro-batch: its backward reduces gradients only when
        ``enabled`` (the last micro-batch), else accumulates them locally."""
        if is_fully_sharded(self.model):
            self.model.set_requires_gradient_sync(enabled)  # type: ignore[operator]
            return contextlib.nullcontext()
        if enabled or not is_ddp(self.model):
            return contextlib.nullcontext()
        return self.model.no_sync()  # type: ignore[operator]

    def _optimizer_step(self) -> tuple[torch.Tensor | None, bool]:
        """Clip, step and zero the gradients; returns the gradient norm before
        clipping, and whether the GradScaler skipped the step (counted only when
        ``nonfinite`` asks: finding out waits for the device)."""
        cfg = self.config
        grad_norm = None
        skipped = False
        if cfg.max_grad_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.scaled)
            clip = getattr(self.optimizer, "clip_grad_norm_", None)  # ZeroOptimizer: across shards
            if clip is not None:
                grad_norm = clip(cfg.max_grad_norm)
            else:  # a fully-sharded model's DTensor gradients: across shards too
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
            grad_norm = plain_tensor(grad_norm).detach()
        if self.scaler is not None:
            scale = self.scaler.get_scale() if self.counts_skips else None
            self.scaler.step(self.scaled)  # skipped on every rank together (Note [agreed found-inf] in precision.py)
            self.scaler.update()
            skipped = scale is not None and self.scaler.get_scale() < scale
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        return grad_norm, skipped

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
