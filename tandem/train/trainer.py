"""tandem.Trainer: the data-parallel training loop users otherwise write again and again.

It puts tandem's pieces together, each of which works alone: DistributedDataParallel
(when the world has more than one rank; a ZeRO or fully-sharded model the user
built is taken as it is), DistributedSampler with set_epoch and mid-epoch resume,
gradient accumulation without gradient sync, autocast and a gradient scaler,
clipping, a guard against NaN/Inf gradients, evaluation with every sample counted
once, atomic checkpoints (sharded for sharded models) and exact resume at any
world size, a progress bar on rank 0, a JSONL record and a loss plot.

The contract with the data: a dataset item is ``(inputs, target)``; the loader
collates them into batches; ``loss_fn(model(inputs), targets)`` is the mean loss
of the batch. Batch sizes are per rank, as with DDP.

# Note [equal to one process]
With equal per-rank batches, averaging the ranks' mean losses' gradients (what
DDP does) is the gradient of the mean loss over the global batch. The sampler's
order interleaves ranks (rank r takes positions r, r+R, ...), so step i of R
ranks with batch B consumes positions [iRB, (i+1)RB) of the epoch's order: the
same samples as step i of one process with batch RB. Micro-batches accumulated
under no_sync divide their loss by their count, so accumulation adds nothing
either. Hence R ranks train like one process on the global batch, which the
tests check to 1e-6 (for models without batch statistics).

The Trainer is built in layers, one concept a file, each class on the one
before: ``TrainerBase`` (trainer_base.py: what it holds, the wrapped model,
samplers and loaders) <- ``TrainerStep`` (trainer_step.py: one optimizer step)
<- ``TrainerCheckpoints`` (trainer_checkpoints.py: save, prune, resume, export)
<- ``ElasticTrainer`` (trainer_elastic.py: a changing world) <- ``Trainer``
(here: construction, ``fit``, epochs, evaluation). Its records are in
records.py, what it finds out by itself in probes.py.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sized
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import Dataset

from tandem.data import gather_samples
from tandem._tree import to_device
from tandem.checkpoint.one_rank import latest_checkpoint
from tandem.train.buddy import BuddyCopies
from tandem.train.config import CheckpointFormat, TrainerConfig
from tandem.train.elastic import is_peer_failure
from tandem.train.history import History
from tandem.train.plot import plot_losses
from tandem.train.precision import ShardedGradients, autocast_for, scaler_for
from tandem.train.progress import Progress
from tandem.train.sharded import check_optimizer, is_fully_sharded
from tandem.train.state import TrainingState, unwrap_model
from tandem.train.probes import device_of, rank_and_size
from tandem.train.records import Window, evaluation_of
from tandem.train.trainer_base import Metric
from tandem.train.trainer_elastic import ElasticTrainer

__all__ = ["FitResult", "Trainer"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FitResult:
    """What :meth:`Trainer.fit` returns (the same on every rank)."""

    steps: int
    """Optimizer steps taken in total (including those before a resume)."""
    epochs_done: int
    """Epochs completed."""
    evaluation: dict[str, float] | None
    """The last evaluation: ``loss`` and each metric, over the whole evaluation set."""
    history: list[dict[str, Any]]
    """Every training and evaluation record, as in ``metrics.jsonl``."""
    checkpoint: Path | None
    """The last checkpoint written."""
    plot: Path | None
    """``loss.png``, or None without matplotlib."""


class Trainer(ElasticTrainer):
    """Train ``model`` with ``optimizer`` on ``train_data``, on every rank of the job.

    Args:
        model: the model, on this rank's device. Wrapped in
            tandem.DistributedDataParallel when the world has more than one rank,
            unless it already is a DDP model (pass your own wrapper for ZeRO) or
            went through tandem.fully_shard. Such sharded models are saved
            sharded by default (``TrainerConfig.checkpoint_format``), every rank
            its own shard; :meth:`export` writes the full state to one file.
        optimizer: built on the model's parameters (a torch optimizer, also over
            a fully-sharded model's, or a tandem.ZeroOptimizer over an already
            wrapped model).
        train_data: a map-style dataset of ``(inputs, target)`` pairs.
        loss_fn: ``loss_fn(outputs, targets)``, the mean loss of a batch.
        eval_data: evaluated after each epoch when given.
        metrics: name -> ``fn(outputs, targets)`` over the whole evaluation set
            (each sample once), e.g. accuracy.
        scheduler: stepped after every optimizer step.
        config: a :class:`TrainerConfig`.
        collate_fn: the DataLoader's collate function.

    Call :meth:`fit` on every rank, after ``tandem.init()``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 train_data: Dataset, loss_fn: Callable[[Any, Any], torch.Tensor], *,
                 eval_data: Dataset | None = None, metrics: Mapping[str, Metric] | None = None,
                 scheduler: Any = None, config: TrainerConfig | None = None,
                 collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
        self.config = config or TrainerConfig()
        self.rank, self.world_size = rank_and_size()
        self._elastic = self._elastic_run(model)
        self._in_step = False
        # Note [buddy copies]: under ZeRO and fully_shard each rank also holds the previous rank's shard.
        self._buddy = BuddyCopies() if self._elastic is not None and (
            hasattr(optimizer, "sharded_state_dict") or is_fully_sharded(model)) else None
        self.device = device_of(model)
        self.model = self._wrap(model)
        self.optimizer, self.scheduler, self.loss_fn = optimizer, scheduler, loss_fn
        self.metrics = dict(metrics or {})
        if is_fully_sharded(model):
            check_optimizer(model, optimizer)
        zero = hasattr(optimizer, "sharded_state_dict")  # a tandem.ZeroOptimizer
        # Sharded gradients: the ranks agree on found-inf (Note [agreed found-inf] in
        # precision.py), and a ZeroOptimizer's shards are what gets unscaled.
        self.scaler = scaler_for(self._precision, self.device,
                                 sharded=zero or is_fully_sharded(model),
                                 process_group=getattr(self.model, "process_group", None))
        self._scaled: Any = (ShardedGradients(optimizer, cast(Any, self.model).reducer.grad_shards)
                             if zero and self.scaler is not None else optimizer)
        self._guard = self._nonfinite_guard()
        self._autocast = autocast_for(self._precision, self.device)
        self.train_data, self.eval_data, self._collate_fn = train_data, eval_data, collate_fn
        self._build_loaders()
        self.state = TrainingState(model=self.model, optimizer=optimizer, scheduler=scheduler,
                                   scaler=self.scaler)
        self.checkpoint_dir = self._output_dir / "checkpoints"
        # Note [sharded trainer checkpoints] in sharded_checkpoint.py
        chosen = cast("CheckpointFormat | None", self.config.checkpoint_format)
        self.checkpoint_format = chosen or (CheckpointFormat.SHARDED if zero or is_fully_sharded(model)
                                            else CheckpointFormat.FULL)
    # ------------------------------------------------------------------ the run
    def fit(self) -> FitResult:
        """Train for ``config.epochs`` epochs (or up to ``config.max_steps``), resuming
        from the latest checkpoint in ``config.output_dir`` when ``config.resume``.
        A collective: call it on every rank."""
        cfg = self.config
        joining = self._elastic is not None and self._elastic.needs_state
        if not cfg.resume and not joining and (latest := latest_checkpoint(self.checkpoint_dir)) is not None:
            # Pruning keeps the highest steps: the old run's checkpoints would outlive ours.
            raise ValueError(f"rank {self.rank}: resume=False, but {self.checkpoint_dir} holds "
                             f"checkpoints of an earlier run (latest {latest.name}); resume it with "
                             "resume=True, or give this run an empty output_dir")
        if self._elastic is not None and self._elastic.needs_state:
            resumed_from = None  # a replacement: the state comes from a live peer
            if self._buddy is not None:
                self._restore_shards(None)
            self._share_state()
            self._elastic.needs_state = False
        else:
            resumed_from = self._resume() if cfg.resume else None
        history = History(self._output_dir / "metrics.jsonl" if self.rank == 0 else None,
                          self.state.extra.get("history"))
        total_steps = self._steps_per_epoch() * cfg.epochs
        if cfg.max_steps is not None:
            total_steps = min(total_steps, cfg.max_steps)
        progress = Progress(enabled=self.rank == 0, bar=cfg.progress, total=total_steps,
                            initial=min(self.state.step, total_steps))
        if resumed_from is not None:
            progress.say(f"resumed from {resumed_from} (epoch {self.state.epoch}, step {self.state.step})")
        progress.say(f"training on {self.world_size} rank(s): {self.sampler.dataset_size} samples, "
                     f"global batch {self.global_batch_size}, {cfg.epochs} epoch(s), "
                     f"precision {self._precision.value}")
        checkpoint = resumed_from
        self._refresh_buddy()
        try:
            while self.state.epoch < cfg.epochs and not self._reached_max_steps():
                try:
                    self._train_epoch(history, progress)
                    if self._elastic is not None and self._elastic.grow_pending:
                        self._change_world(None, history, progress)
                        continue
                    if self._epoch_done():
                        self.state.epoch += 1
                        self.state.consumed = 0
                        self._evaluate_into(history, progress)
                    checkpoint = self._save(history)
                except Exception as e:
                    if self._elastic is None or not is_peer_failure(e):
                        raise
                    self._change_world(e, history, progress)
            if self.state.epoch < cfg.epochs:
                progress.say(f"stopped at step {self.state.step} (max_steps {cfg.max_steps}); "
                             "run again with resume to continue")
        finally:
            progress.close()
        plot = None
        if cfg.plot and self.rank == 0:
            plot = plot_losses(history.of_kind("train"), history.of_kind("eval"),
                               self._output_dir / "loss.png")
            progress.say(f"loss plot: {plot}" if plot is not None else
                         "no loss plot: matplotlib is not installed (pip install matplotlib)")
        return FitResult(steps=self.state.step, epochs_done=self.state.epoch,
                         evaluation=evaluation_of(history.last("eval")), history=history.records,
                         checkpoint=checkpoint, plot=plot)

    def _samples_per_rank(self) -> int:
        """Samples of one whole epoch on each rank (the sampler pads or drops to equal shares)."""
        n, world = self.sampler.dataset_size, self.world_size
        return n // world if self.config.drop_last else math.ceil(n / world)

    def _steps_per_epoch(self) -> int:
        micro_batches = math.ceil(self._samples_per_rank() / self.config.batch_size)
        return math.ceil(micro_batches / self.config.grad_accum)

    def _reached_max_steps(self) -> bool:
        return self.config.max_steps is not None and self.state.step >= self.config.max_steps

    def _train_epoch(self, history: History, progress: Progress) -> None:
        """Train the rest of ``state.epoch``, or up to max_steps."""
        cfg, state = self.config, self.state
        self.sampler.set_epoch(state.epoch, start=state.consumed)
        self.model.train()
        window = Window()
        batches = iter(self.train_loader)
        while micro_batches := list(islice(batches, cfg.grad_accum)):
            started = time.perf_counter()
            samples, comm_wait, grad_norm, skipped = self._step(micro_batches, window.loss)
            window.add(samples * self.world_size, time.perf_counter() - started, comm_wait, grad_norm,
                       skipped if self._counts_skips else None)
            state.step += 1
            state.consumed += samples * self.world_size
            self._refresh_buddy()
            progress.advance()
            if state.step % cfg.log_every == 0:
                record = window.record(state, self._lr())
                history.append(record)
                progress.show(record)
                window = Window()
            if self._reached_max_steps():
                return
            if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and not self._epoch_done():
                self._save(history)
            if self._elastic is not None and self._elastic.grow_pending:
                return  # fit() admits the replacements before the next step

    def _epoch_done(self) -> bool:
        return self.state.consumed >= self._samples_per_rank() * self.world_size

    # ------------------------------------------------------------------ evaluation
    def _evaluate_into(self, history: History, progress: Progress) -> None:
        if self.eval_loader is None:
            return
        evaluation = self.evaluate()
        history.append({"kind": "eval", "epoch": self.state.epoch, "step": self.state.step,
                        **evaluation})
        progress.say(f"evaluation after epoch {self.state.epoch}: "
                     + ", ".join(f"{k} {v:.4f}" for k, v in evaluation.items()))

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The loss and metrics over the whole evaluation set, each sample counted
        once (the sampler's padding is dropped), the same on every rank. A collective."""
        if self.eval_loader is None:
            raise RuntimeError("the Trainer was built without eval_data")
        module = unwrap_model(self.model)  # no DDP collectives: ranks only meet in the gather
        was_training = module.training
        module.eval()
        outputs, targets = [], []
        for inputs, target in self.eval_loader:
            with self._autocast():
                out = module(to_device(inputs, self.device))
            outputs.append(out.float())
            targets.append(to_device(target, self.device))
        module.train(was_training)
        n = len(cast(Sized, self.eval_data))  # set whenever eval_loader is
        out = cast(torch.Tensor, gather_samples(torch.cat(outputs), n))  # a tensor in, a tensor out
        target = cast(torch.Tensor, gather_samples(torch.cat(targets), n))
        result = {"loss": float(self.loss_fn(out, target))}
        for name, fn in self.metrics.items():
            result[name] = float(fn(out, target))
        return result
