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
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sized
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tandem._compat import dtensor_api
from tandem.data import DistributedSampler, RunningMean, gather_samples
from tandem._tree import to_device
from tandem.ddp.checks import NonFinite, NonFiniteReport, nonfinite_names
from tandem.train.checkpoint import checkpoint_name, latest_checkpoint, list_checkpoints, \
    load_checkpoint, remove_checkpoint, save_checkpoint
from tandem.comm.bootstrap import elastic_membership
from tandem.comm.membership import ElasticConfig, Generation, MembershipError
from tandem.train.buddy import BuddyCopies, ShardsLost
from tandem.train.config import CheckpointFormat, Precision, TrainerConfig
from tandem.train.elastic import ElasticRun, WorldChange, is_peer_failure
from tandem.train.history import History
from tandem.train.plot import plot_losses
from tandem.train.precision import ShardedGradients, autocast_for, scaler_for
from tandem.train.progress import Progress
from tandem.train.rng import rank_seed
from tandem.train.sharded import check_optimizer, is_fully_sharded
from tandem.train.sharded_checkpoint import load_sharded_state, save_sharded_state
from tandem.train.state import TrainingState, unwrap_model

__all__ = ["FitResult", "Trainer"]

logger = logging.getLogger(__name__)

Metric = Callable[[torch.Tensor, torch.Tensor], Any]


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


class Trainer:
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
        self.rank, self.world_size = _rank_and_size()
        self._elastic = self._elastic_run(model)
        self._in_step = False
        # Note [buddy copies]: under ZeRO each rank also holds the previous rank's shard.
        self._buddy = BuddyCopies() if self._elastic is not None and hasattr(
            optimizer, "sharded_state_dict") else None
        self.device = _device_of(model)
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

    # ------------------------------------------------------------------ set-up
    def _elastic_run(self, model: nn.Module) -> ElasticRun | None:
        elastic = self.config.elastic
        if elastic is None:  # `tandem run --elastic` asks for it
            elastic = ElasticConfig() if os.environ.get("TANDEM_ELASTIC") == "1" else False
        if not isinstance(elastic, ElasticConfig):
            return None
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("TrainerConfig(elastic=...) needs a process group: call tandem.init() first")
        if is_fully_sharded(model):
            raise ValueError(f"rank {self.rank}: elastic training supports DistributedDataParallel "
                             "models, also under ZeRO-1/2, but not fully_shard yet (a dead rank takes "
                             "its parameter shard with it); leave elastic unset for a fully-sharded model")
        return ElasticRun(elastic_membership(elastic))

    def _build_loaders(self) -> None:
        """The samplers and loaders of this world (built again when an elastic world changes)."""
        self.sampler = DistributedSampler(cast(Sized, self.train_data), num_replicas=self.world_size,
                                          rank=self.rank, shuffle=self.config.shuffle, seed=self.config.seed,
                                          drop_last=self.config.drop_last)
        self.train_loader = self._loader(self.train_data, self.sampler, self.config.batch_size,
                                         self._collate_fn)
        self.eval_loader = None
        if self.eval_data is not None:
            eval_sampler = DistributedSampler(cast(Sized, self.eval_data), num_replicas=self.world_size,
                                              rank=self.rank, shuffle=False)
            self.eval_loader = self._loader(self.eval_data, eval_sampler,
                                            self.config.eval_batch_size or self.config.batch_size,
                                            self._collate_fn)

    def _wrap(self, model: nn.Module) -> nn.Module:
        alone = self.world_size == 1 and self._elastic is None  # an elastic world may grow
        if alone or _is_ddp(model) or is_fully_sharded(model):
            return model
        from tandem.ddp import DistributedDataParallel
        options = dict(self.config.ddp_options)
        if self.config.nonfinite is not None and self._precision is not Precision.FP16:
            options["check_finite"] = self.config.nonfinite
        return DistributedDataParallel(model, **options)

    def _nonfinite_guard(self) -> NonFinite | None:
        """What a step with NaN/Inf gradients does, when the Trainer must look
        (the GradScaler looks itself under fp16). A DDP model checks, and agrees
        across ranks, by itself; a single process checks its own gradients."""
        wanted = self._nonfinite
        if self._precision is Precision.FP16:
            return None
        if _is_ddp(self.model):
            has = getattr(self.model, "check_finite", None)
            if wanted is not None and has is not wanted:
                raise ValueError(
                    f"rank {self.rank}: nonfinite={wanted.value!r}, but the model is a "
                    f"DistributedDataParallel built with check_finite="
                    f"{None if has is None else has.value!r}; pass check_finite={wanted.value!r} "
                    "when wrapping it, or leave nonfinite unset")
            return has
        if wanted is not None and self.world_size > 1:
            raise ValueError(f"nonfinite={wanted.value!r} is not supported with a fully-sharded model "
                             "yet; with precision='fp16' its GradScaler skips non-finite steps on "
                             "every rank together")
        return wanted

    def _loader(self, data: Dataset, sampler: DistributedSampler, batch_size: int,
                collate_fn: Callable[[list[Any]], Any] | None) -> DataLoader:
        # A generator of its own: otherwise each iter() draws the workers' base seed from
        # the global torch RNG, and a run resumed mid-epoch (one extra iter()) would
        # continue with dropout masks shifted by one draw. Note [exact resume] in state.py.
        generator = torch.Generator().manual_seed(rank_seed(self.config.seed, self.rank))
        return DataLoader(data, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                          num_workers=self.config.num_workers, generator=generator,
                          pin_memory=self.device.type == "cuda")

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step, all ranks together (a full step)."""
        return self.config.batch_size * self.config.grad_accum * self.world_size

    # TrainerConfig.__post_init__ normalises these fields; they are typed for what a caller passes.
    @property
    def _precision(self) -> Precision:
        return cast(Precision, self.config.precision)

    @property
    def _nonfinite(self) -> NonFinite | None:
        return cast("NonFinite | None", self.config.nonfinite)

    @property
    def _output_dir(self) -> Path:
        return cast(Path, self.config.output_dir)

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
                         evaluation=_evaluation_of(history.last("eval")), history=history.records,
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
        window = _Window()
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
                window = _Window()
            if self._reached_max_steps():
                return
            if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and not self._epoch_done():
                self._save(history)
            if self._elastic is not None and self._elastic.grow_pending:
                return  # fit() admits the replacements before the next step

    def _epoch_done(self) -> bool:
        return self.state.consumed >= self._samples_per_rank() * self.world_size

    @property
    def _counts_skips(self) -> bool:
        """Whether records count the steps skipped for NaN/Inf gradients."""
        return self._guard is not None or self.config.nonfinite is not None

    def _step(self, micro_batches: list[Any], loss_mean: RunningMean
              ) -> tuple[int, float | None, torch.Tensor | None, bool]:
        """One optimizer step over ``micro_batches``. Returns this rank's sample count,
        the seconds the synchronised backward waited on communication, the
        global gradient norm before clipping (None without clipping), and whether
        the step was skipped for non-finite gradients (the same on every rank)."""
        samples = 0
        self._in_step = True
        if self._elastic is not None:
            self._elastic.step_started()
        for i, (inputs, targets) in enumerate(micro_batches):
            inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
            with self._grad_sync(enabled=i == len(micro_batches) - 1):
                with self._autocast():
                    loss = self.loss_fn(self.model(inputs), targets)
                n = _batch_len(targets)
                loss_mean.update(loss, weight=n)
                # Note [equal to one process]: micro-batches weigh by their count.
                scaled = loss / len(micro_batches)
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            samples += n
        if self._elastic is not None:
            self._elastic.decide(self.state.step)  # every rank steps, or none (Note [elastic trainer])
        self._in_step = False
        stats = getattr(self.model, "comm_stats", None)
        comm_wait = None if stats is None else stats.wait_s
        if self._guard is not None and self._found_nonfinite():
            # The gradients are dropped already: no optimizer or scheduler step.
            self.optimizer.zero_grad(set_to_none=True)
            return samples, comm_wait, None, True
        grad_norm, skipped = self._optimizer_step()
        return samples, comm_wait, grad_norm, skipped

    def _found_nonfinite(self) -> bool:
        """Whether this step's gradients hold NaN/Inf, the same on every rank; in
        "raise" mode that raises instead (DDP raised already, during backward)."""
        if _is_ddp(self.model):
            return bool(getattr(self.model, "found_nonfinite", False))
        # One process (Note [check_finite] in ddp/finite.py needs no agreement here).
        names = nonfinite_names([(n, p.grad) for n, p in self.model.named_parameters()
                                 if p.grad is not None])
        if not names:
            return False
        report = NonFiniteReport(step=self.state.step, before=(tuple(names),), after=tuple(names))
        if self._guard is NonFinite.RAISE:
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
        if enabled or not _is_ddp(self.model):
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
                self.scaler.unscale_(self._scaled)
            clip = getattr(self.optimizer, "clip_grad_norm_", None)  # ZeroOptimizer: across shards
            if clip is not None:
                grad_norm = clip(cfg.max_grad_norm)
            else:  # a fully-sharded model's DTensor gradients: across shards too
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
            grad_norm = _plain_tensor(grad_norm).detach()
        if self.scaler is not None:
            scale = self.scaler.get_scale() if self._counts_skips else None
            self.scaler.step(self._scaled)  # skipped on every rank together (Note [agreed found-inf])
            self.scaler.update()
            skipped = scale is not None and self.scaler.get_scale() < scale
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        return grad_norm, skipped

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

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

    # ------------------------------------------------------------------ checkpoints
    def _save(self, history: History) -> Path:
        self.state.extra = {"history": history.records}
        if self.checkpoint_format is CheckpointFormat.SHARDED:
            path = save_sharded_state(self.state, self.checkpoint_dir)
        else:
            path = save_checkpoint(self.state.state_dict(), self.checkpoint_dir / checkpoint_name(self.state.step))
        if self.rank == 0:
            for old in list_checkpoints(self.checkpoint_dir)[:-self.config.keep_checkpoints]:
                if old != path:  # the step just saved stays, even below newer ones
                    remove_checkpoint(old)
        return path

    def export(self, path: str | Path) -> Path:
        """Write the whole training state to one file at ``path``, in the format of
        ``checkpoint_format="full"``: the full model and optimizer state in torch's
        own format (``torch.load(path)["model"]`` loads into the plain model with
        ``load_state_dict``), whatever the sharding. A collective: a sharded
        model's state is gathered onto rank 0, which writes the file.

        Returns:
            The path written.
        """
        return save_checkpoint(self.state.state_dict(), path)

    def _resume(self) -> Path | None:
        latest = latest_checkpoint(self.checkpoint_dir)
        seen = self._share_all(None if latest is None else latest.name)
        if len(set(seen)) > 1:
            raise RuntimeError(
                f"rank {self.rank}: ranks see different latest checkpoints in {self.checkpoint_dir} "
                f"({dict(enumerate(seen))}); output_dir must be one shared directory, or pass "
                "resume=False")
        if latest is None:
            return None
        if latest.is_dir():
            load_sharded_state(self.state, latest, map_location=self.device)
        else:
            self.state.load_state_dict(load_checkpoint(latest, map_location=self.device))
        return latest

    # ------------------------------------------------------------------ elastic
    @property
    def world_changes(self) -> list[WorldChange]:
        """Every change of an elastic job's world this Trainer went through (also
        in the history, as records of kind ``"elastic"``)."""
        return [] if self._elastic is None else list(self._elastic.changes)

    def _change_world(self, cause: BaseException | None, history: History, progress: Progress) -> None:
        """Note [elastic trainer]: regroup, rebuild what depends on the world, go on."""
        assert self._elastic is not None
        in_step, self._in_step = self._in_step, False

        def rebuild(before: Generation, after: Generation) -> None:
            own = (self._buddy.own_shard(self.optimizer.sharded_state_dict)  # type: ignore[attr-defined]
                   if self._buddy is not None else None)
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.optimizer.zero_grad(set_to_none=True)
            self.model.reset_process_group()  # type: ignore[operator]
            if self._buddy is not None:
                self.optimizer.reset_process_group()  # type: ignore[attr-defined]
                self._restore_shards(own)
            self._build_loaders()
            if after.joined_since(before):
                self._share_state()
            self._refresh_buddy()  # copies for the new world, before its first step

        while True:
            try:
                change = self._elastic.change_world(cause, self.state.step, in_step=in_step,
                                                    rebuild=rebuild)
            except Exception as e:
                if not is_peer_failure(e):
                    raise
                # Lost another member while rebuilding (a replacement that died as it
                # joined, say): the change happened, and the next one starts now.
                self._report(self._elastic.changes[-1], history, progress)
                cause = e
                continue
            self._report(change, history, progress)
            return

    def _report(self, change: WorldChange, history: History, progress: Progress) -> None:
        logger.warning("rank %d: %s", self.rank, change.describe())
        progress.say(change.describe())
        history.append(change.record())

    def _refresh_buddy(self) -> None:
        """Note [buddy copies]: send this rank's shard to the next rank after a step."""
        if self._buddy is not None and self._elastic is not None:
            generation = self._elastic.membership.generation
            self._buddy.refresh(self.optimizer.sharded_state_dict(), self.state.step,  # type: ignore[attr-defined]
                                generation.members, self.rank)

    def _restore_shards(self, own: dict[str, Any] | None) -> None:
        """Every rank's shard of a ZeRO optimizer's state, laid out for the new world:
        from the survivors and their buddy copies, else from the last checkpoint."""
        assert self._buddy is not None and self._elastic is not None
        try:
            shards = self._buddy.recover(own, self.state.step, self._elastic.membership.generation.members)
        except ShardsLost as e:
            if latest_checkpoint(self.checkpoint_dir) is None:
                raise MembershipError(f"rank {self.rank}: {e}, and {self.checkpoint_dir} holds no "
                                      "checkpoint to fall back to; the job cannot go on") from e
            logger.warning("rank %d: %s; falling back to the last checkpoint", self.rank, e)
            self._resume()
            return
        self.optimizer.load_sharded_state_dicts(shards)  # type: ignore[attr-defined]
        if self.scaler is not None:
            self._scaled = ShardedGradients(self.optimizer, cast(Any, self.model).reducer.grad_shards)

    def _share_state(self) -> None:
        """Rank 0's whole training state, on every rank (a replacement joined)."""
        box: list[Any] = [self.state.state_dict()]  # a collective: every rank's RNG state is gathered
        dist.broadcast_object_list(box, src=0)
        self.state.load_state_dict(box[0])

    # ------------------------------------------------------------------ small collectives
    def _share_all(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, on every rank."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


class _Window:
    """Training records accumulate over ``log_every`` steps: loss (reduced across
    ranks when recorded), throughput, the share of time waiting on communication,
    the mean gradient norm before clipping (the same on every rank), and the steps
    skipped for NaN/Inf gradients (None when they are not counted)."""

    def __init__(self) -> None:
        self.loss = RunningMean()
        self.samples = 0
        self.seconds = 0.0
        self.comm_wait: float | None = None
        self.grad_norms: list[torch.Tensor] = []
        self.skipped: int | None = None

    def add(self, samples: int, seconds: float, comm_wait: float | None,
            grad_norm: torch.Tensor | None, skipped: bool | None) -> None:
        if skipped is not None:
            self.skipped = (self.skipped or 0) + int(skipped)
        self.samples += samples
        self.seconds += seconds
        if comm_wait is not None:
            self.comm_wait = (self.comm_wait or 0.0) + comm_wait
        if grad_norm is not None:
            self.grad_norms.append(grad_norm)

    def record(self, state: TrainingState, lr: float) -> dict[str, Any]:
        return {"kind": "train", "epoch": state.epoch + 1, "step": state.step,
                "loss": self.loss.compute(), "lr": lr,
                "samples_per_s": self.samples / max(self.seconds, 1e-9),
                "comm_wait_share": None if self.comm_wait is None else
                self.comm_wait / max(self.seconds, 1e-9),
                # One device sync per record, not per step.
                "grad_norm": float(torch.stack(self.grad_norms).float().mean()) if self.grad_norms else None,
                "skipped_steps": self.skipped}


def _rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _is_ddp(model: nn.Module) -> bool:
    return hasattr(model, "no_sync") and isinstance(getattr(model, "module", None), nn.Module)


def _plain_tensor(norm: torch.Tensor) -> torch.Tensor:
    """``norm`` as a plain tensor: clip_grad_norm_ over DTensor gradients returns a
    replicated DTensor (so ``full_tensor()`` communicates nothing)."""
    DTensor, _, _ = dtensor_api()
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _batch_len(targets: Any) -> int:
    if isinstance(targets, torch.Tensor):
        return targets.shape[0]
    if isinstance(targets, (list, tuple)) and targets:
        return _batch_len(targets[0])
    if isinstance(targets, Mapping) and targets:
        return _batch_len(next(iter(targets.values())))
    raise TypeError(f"cannot tell the batch size of targets of type {type(targets).__name__}")


def _evaluation_of(record: dict[str, Any] | None) -> dict[str, float] | None:
    """An eval record's loss and metrics, without its bookkeeping."""
    if record is None:
        return None
    return {k: v for k, v in record.items() if k not in ("kind", "epoch", "step")}
