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
tests check to 1e-6 (for models without batch statistics). After an elastic
world change in the middle of an epoch the rest is split without padding, and
the one global batch whose ranks' batches differ in size weighs each rank's
loss by n_r * R / N (Note [exact split] in tandem/data/split.py): still one
process on the global batch, each sample once.

The Trainer is one class (here: construction, ``fit``, epochs, evaluation, a
changing world) whose collaborators own their work: :class:`StepRunner`
(step_runner.py: one optimizer step), :class:`Loaders` (loaders.py: the
samplers and loaders of a world), :class:`RunCheckpoints`
(run_checkpoints.py: save, prune, resume, export) and, in an elastic job,
:class:`ElasticWorld` (tandem/elastic/world.py: membership, buddy copies, the state
a replacement gets). Its records are in records.py, what it finds out by
itself in probes.py.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sized
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tandem._tree import to_device
from tandem.control.elastic_group import elastic_membership
from tandem.comm.group import GroupComm
from tandem.comm.node_groups import node_mesh
from tandem.control.generation import Generation, MembershipError
from tandem.data import DistributedSampler, gather_samples
from tandem.diloco import DiLoCo, DiLoCoConfig
from tandem.data.batches import empty_batch, planned_batches
from tandem.data.split import RestSplit
from tandem.ddp.checks import NonFinite
from tandem.fsdp.regroup import check_regroupable
from tandem.train.config import CheckpointFormat, Precision, TrainerConfig
from tandem.elastic.epoch_end import agreed_place
from tandem.elastic.run import ElasticRun, Resumed, WorldChange, elastic_config, is_peer_failure
from tandem.elastic.sync_points import SyncPoints
from tandem.elastic.world import ElasticWorld, TrainingStatePoints
from tandem.train.history import History
from tandem.train.loaders import Loaders
from tandem.train.plot import plot_losses
from tandem.train.precision import ShardedGradients, autocast_for, scaler_for
from tandem.train.probes import device_of, is_ddp, rank_and_size
from tandem.train.progress import Progress
from tandem.train.records import Window, evaluation_of
from tandem.train.run_checkpoints import RunCheckpoints
from tandem.checkpoint.full_state import check_optimizer, is_fully_sharded
from tandem.checkpoint.state import TrainingState, unwrap_model
from tandem.train.step_runner import StepRunner
from tandem.train.stragglers import PhaseGather, StepPhases, StragglerWatch
from tandem.train.tensorboard import TensorBoardLog, require_tensorboard
from tandem.train.strategy import Strategy, apply_strategy
from tandem.comm.watched_call import watched
from tandem.comm.monitor import current_monitor_if_any
from tandem.comm.trace import StepSpan, write_trace
from tandem.comm.plain_data import all_gather_ints, all_gather_object

__all__ = ["FitResult", "Metric", "Trainer"]

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
    world_sizes: tuple[int, ...]
    """The world sizes the run trained in, in order, the last the one it ended in:
    one for a run whose world never changed, more for an elastic run that lost or
    admitted ranks (its ``"elastic"`` records in the history)."""

    def describe(self) -> str:
        """The run in one line, as the examples end: ``trained 3 epoch(s), 36 steps,
        over 4 -> 2 rank(s)`` (the world sizes it went through)."""
        return (f"trained {self.epochs_done} epoch(s), {self.steps} steps, over "
                f"{' -> '.join(map(str, self.world_sizes))} rank(s)")


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
        self.rank, self.world_size = rank_and_size()
        run = _elastic_run(self.config, model, self.rank)
        if run is not None and self.config.async_checkpoint:
            raise ValueError(f"rank {self.rank}: async_checkpoint=True does not go with an elastic job, whose "
                             "world may change under a save in flight; pass async_checkpoint=False, or "
                             "elastic=False")
        if self.config.tensorboard:
            require_tensorboard()
        self.device = device_of(model)
        fsdp = is_fully_sharded(model)
        local_steps = self.config.diloco
        if local_steps is not None:
            _check_local_steps(model, local_steps, run is not None, self.rank)
        self.model = model if local_steps is not None else _wrap(model, self.config, self.world_size,
                                                                  elastic=run is not None)
        self.optimizer, self.scheduler, self.loss_fn = optimizer, scheduler, loss_fn
        self.metrics = dict(metrics or {})
        if fsdp:
            check_optimizer(model, optimizer)
        zero = hasattr(optimizer, "sharded_state_dict")  # a tandem.ZeroOptimizer
        # Sharded gradients: the ranks agree on found-inf (Note [agreed found-inf] in
        # precision.py), and a ZeroOptimizer's shards are what gets unscaled.
        self.scaler = scaler_for(self._precision, self.device, sharded=zero or fsdp,
                                 process_group=getattr(self.model, "process_group", None))
        self.train_data, self.eval_data, self._collate_fn = train_data, eval_data, collate_fn
        self._loaders = self._new_loaders()
        self.state = TrainingState(model=self.model, optimizer=optimizer, scheduler=scheduler,
                                   scaler=self.scaler)
        # Note [local steps and the outer step] in tandem/diloco/diloco.py: syncs in optimizer.step().
        # Note [DiLoCo across nodes, fully_shard inside] in tandem/diloco/diloco.py: a node is a worker.
        across = _across_nodes(model, self.rank) if local_steps is not None and fsdp else None
        self._diloco = None if local_steps is None else DiLoCo(model, optimizer, local_steps, comm=across)
        # Note [sharded trainer checkpoints] in sharded_checkpoint.py; with local steps, Note
        # [per-rank trainer checkpoints] in per_rank_checkpoint.py.
        chosen = cast("CheckpointFormat | None", self.config.checkpoint_format)
        if local_steps is not None:
            chosen = CheckpointFormat.PER_RANK
        self._checkpoints = RunCheckpoints(
            self.state, self._output_dir / "checkpoints",
            chosen or (CheckpointFormat.SHARDED if zero or fsdp else CheckpointFormat.FULL),
            self.config.keep_checkpoints, self.device, background=self.config.async_checkpoint,
            local=self._diloco)
        self._autocast = autocast_for(self._precision, self.device)
        self._elastic = None if run is None else ElasticWorld(
            run, self.model, optimizer, self.state, TrainingStatePoints(self.state), self._checkpoints,
            sharded=zero or fsdp)
        # Note [elastic local steps] in tandem/elastic/sync_points.py: back to the last sync.
        self._syncs = None if self._diloco is None or self._elastic is None else SyncPoints(
            self._diloco, optimizer, self.state, TrainingStatePoints(self.state))
        self._runner = StepRunner(self.model, optimizer, scheduler, loss_fn, self.config, self.state,
                                  device=self.device, rank=self.rank, scaler=self.scaler,
                                  scaled=self._scaled(), guard=self._nonfinite_guard(),
                                  autocast=self._autocast, elastic=self._elastic)
        # Note [naming a straggler] in stragglers.py: a small gather every few steps.
        every = self.config.straggler_every
        self._stragglers = (StragglerWatch(PhaseGather(self.world_size), every=every)
                            if every is not None and self.world_size > 1 and self._elastic is None else None)
        self._spans: deque[StepSpan] = deque(maxlen=_TRACED_STEPS)  # the last steps, for the trace
        # Note [exact split] in tandem/data/split.py: the world changed in this epoch, so a
        # rest past its start is split without padding; and the split being trained.
        self._exact_rest = False
        self._split: RestSplit | None = None

    def _new_loaders(self) -> Loaders:
        return Loaders(self.train_data, self.eval_data, self._collate_fn, self.config, self.device,
                       self.rank, self.world_size)

    def _scaled(self) -> Any:
        """What a GradScaler unscales and steps: a ZeroOptimizer's gradient shards, else the optimizer."""
        if self.scaler is not None and hasattr(self.optimizer, "sharded_state_dict"):
            return ShardedGradients(self.optimizer, cast(Any, self.model).reducer.grad_shards)
        return self.optimizer

    def _nonfinite_guard(self) -> NonFinite | None:
        """What a step with NaN/Inf gradients does, when the Trainer must look
        (the GradScaler looks itself under fp16). A DDP model checks, and agrees
        across ranks, by itself; a single process checks its own gradients."""
        wanted = self._nonfinite
        if self._precision is Precision.FP16:
            return None
        if is_ddp(self.model):
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

    # ------------------------------------------------------------------ what it holds
    @property
    def sampler(self) -> DistributedSampler:
        return self._loaders.sampler

    @property
    def train_loader(self) -> DataLoader:
        return self._loaders.train

    @property
    def eval_loader(self) -> DataLoader | None:
        return self._loaders.eval

    @property
    def checkpoint_dir(self) -> Path:
        return self._checkpoints.directory

    @property
    def checkpoint_format(self) -> CheckpointFormat:
        return self._checkpoints.format

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step, all ranks together (a full step)."""
        return self.config.batch_size * self.config.grad_accum * self.world_size

    @property
    def world_changes(self) -> list[WorldChange]:
        """Every change of an elastic job's world this Trainer went through (also
        in the history, as records of kind ``"elastic"``)."""
        return [] if self._elastic is None else list(self._elastic.run.changes)

    def waiting_replacements(self) -> list[str]:
        """The replacements that have asked to join this elastic job and are
        admitted at the next step boundary (their member ids, such as ``"j1"``);
        empty for a job that is not elastic. One read of the job's store."""
        return [] if self._elastic is None else self._elastic.run.membership.waiting_joiners()

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

    def _share_all(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, on every rank."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        watched("all_gather_object of every rank's part", all_gather_object, out, obj)
        return out

    # ------------------------------------------------------------------ the run
    def fit(self) -> FitResult:
        """Train for ``config.epochs`` epochs (or up to ``config.max_steps``), resuming
        from the latest checkpoint in ``config.output_dir`` when ``config.resume``.
        A collective: call it on every rank."""
        cfg = self.config
        joining = self._elastic is not None and self._elastic.run.needs_state
        if not cfg.resume and not joining and (latest := self._checkpoints.latest()) is not None:
            # Pruning keeps the highest steps: the old run's checkpoints would outlive ours.
            raise ValueError(f"rank {self.rank}: resume=False, but {self.checkpoint_dir} holds "
                             f"checkpoints of an earlier run (latest {latest.name}); resume it with "
                             "resume=True, or give this run an empty output_dir")
        if self._elastic is not None:
            self._elastic.post_model_digest()  # Note [a grow checked in the store]
        if self._elastic is not None and joining:
            resumed_from = None  # a replacement: the state comes from a live peer
            self._join()
        else:
            resumed_from = self._checkpoints.resume(self.rank, self._share_all) if cfg.resume else None
            self._refresh_buddy()
            if self._syncs is not None:
                self._syncs.capture()  # the start, or the checkpoint's step
        board = _LazyBoard(self._output_dir / "tensorboard") if cfg.tensorboard else None
        history = History(self._output_dir / "metrics.jsonl" if self.rank == 0 else None,
                          self.state.extra.get("history"), sink=board.write if board is not None else None)
        total_steps = self._loaders.steps_per_epoch * cfg.epochs
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
        try:
            while self.state.epoch < cfg.epochs and not self._reached_max_steps():
                try:
                    self._train_epoch(history, progress)
                    if self._elastic is not None and self._elastic.run.grow_pending:
                        self._change_world(None, history, progress)
                        continue
                    if self._epoch_done():
                        self.state.epoch += 1
                        self.state.consumed = 0
                        self._exact_rest = False
                        if self._syncs is not None:  # a window never crosses an epoch's end
                            self._syncs.epoch_end()
                        self._evaluate_into(history, progress)
                    checkpoint = self._save(history)
                except Exception as e:
                    if self._elastic is None or not is_peer_failure(e):
                        raise
                    self._change_world(e, history, progress)
            self._checkpoints.finish()  # the last save complete, or its error raised on every rank
            if self._stragglers is not None:
                self._stragglers.close()  # the last window's gather, started at the last step
            if self.state.epoch < cfg.epochs:
                progress.say(f"stopped at step {self.state.step} (max_steps {cfg.max_steps}); "
                             "run again with resume to continue")
        finally:
            self._checkpoints.abandon()  # an error above: the save in flight ends before fit does
            progress.close()
            if board is not None:
                board.close()
        self._write_trace()
        plot = None
        if cfg.plot and self.rank == 0:
            plot = plot_losses(history.of_kind("train"), history.of_kind("eval"),
                               self._output_dir / "loss.png")
            progress.say(f"loss plot: {plot}" if plot is not None else
                         "no loss plot: matplotlib is not installed (pip install matplotlib)")
        return FitResult(steps=self.state.step, epochs_done=self.state.epoch,
                         evaluation=evaluation_of(history.last("eval")), history=history.records,
                         checkpoint=checkpoint, plot=plot,
                         world_sizes=_world_sizes(history.of_kind("elastic"), self.world_size))

    def _write_trace(self) -> None:
        """This rank's last collectives and steps as a Chrome/Perfetto trace, for ``tandem report``."""
        monitor = current_monitor_if_any()
        if monitor is not None:
            write_trace(self._output_dir / "traces" / f"rank-{self.rank}.json", monitor.ledger.entries(),
                        self.rank, self._spans)

    def _reached_max_steps(self) -> bool:
        return self.config.max_steps is not None and self.state.step >= self.config.max_steps

    def _train_epoch(self, history: History, progress: Progress) -> None:
        """Train the rest of ``state.epoch``, or up to max_steps."""
        cfg, state = self.config, self.state
        if state.consumed >= self.sampler.dataset_size:
            return  # the world changed after the epoch's last step: nothing is left
        # Note [exact split] in tandem/data/split.py: after a world change, the rest without padding.
        self.sampler.set_epoch(state.epoch, start=state.consumed, exact=self._exact_rest and state.consumed > 0)
        split = self._split = self.sampler.split(cfg.batch_size)
        self.model.train()
        window = Window()
        batches = planned_batches(iter(self.train_loader), split, self.rank, self._empty_batch)
        done = 0  # global batches of the split trained
        fetched = time.perf_counter()
        wall = time.time() - fetched  # the trace's clock is the ledger's, wall-clock
        # The Trainer numbers the steps in the ledger, for every model (Note [step numbers] in
        # tandem/comm/ledger.py): hang reports, a peer's error and `tandem report` show them.
        monitor = current_monitor_if_any()
        if monitor is not None and monitor.ledger.capacity < _TRACED:
            monitor.ledger.resize(_TRACED)  # the trace written at the end holds whole steps
        while planned := list(islice(batches, cfg.grad_accum)):
            if monitor is not None:
                monitor.ledger.loop_step(state.step + 1)
            sent_before = 0 if monitor is None else monitor.ledger.bytes_issued
            started = time.perf_counter()
            step = self._runner.run([p.batch for p in planned], window.loss, [p.weight for p in planned])
            ended = time.perf_counter()
            sent = None if monitor is None else monitor.ledger.bytes_issued - sent_before
            self._spans.append(StepSpan(state.step + 1, wall + fetched, wall + started,
                                        wall + ended - step.optimizer_s, wall + ended))
            window.add(sum(split.size_of(p.index) for p in planned), ended - started,
                       step.comm_wait, step.grad_norm, step.skipped if self._runner.counts_skips else None, sent)
            if self._stragglers is not None:
                comm = step.comm_wait or 0.0
                named = self._stragglers.end_step(StepPhases(
                    data=started - fetched, compute=max(0.0, ended - started - comm - step.optimizer_s),
                    comm=comm, optimizer=step.optimizer_s))
                if named is not None:
                    window.stragglers = [s.describe() for s in named]
                    window.rank_phases = self._stragglers.last
            done += len(planned)
            state.step += 1
            state.consumed = split.consumed_after(done)
            self._refresh_buddy()
            if self._syncs is not None and not self._syncs.committed():
                assert self._elastic is not None
                self._elastic.run.grow_pending = False  # decided again at the next step: admitted at a sync
            progress.advance()
            if state.step % cfg.log_every == 0:
                record = window.record(state, self._runner.lr())
                history.append(record)
                progress.show(record)
                window = Window()
            if self._reached_max_steps():
                return
            if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and not self._epoch_done():
                self._save(history)
            if self._elastic is not None and self._elastic.run.grow_pending:
                return  # fit() admits the replacements before the next step
            fetched = time.perf_counter()

    def _epoch_done(self) -> bool:
        consumed = self.state.consumed
        return consumed >= self.sampler.dataset_size or (self._split is not None and consumed >= self._split.end)

    def _empty_batch(self) -> Any:
        """The batch of a rank with no sample left in a step (Note [exact split] in tandem/data/split.py)."""
        return empty_batch(self.train_loader.collate_fn, self.train_data)

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
        return self._checkpoints.save(history, self.rank)

    def export(self, path: str | Path) -> Path:
        """Write the whole training state to one file at ``path``, in the format of
        ``checkpoint_format="full"``: the full model and optimizer state in torch's
        own format (``torch.load(path)["model"]`` loads into the plain model with
        ``load_state_dict``), whatever the sharding. A collective: a sharded
        model's state is gathered onto rank 0, which writes the file.

        Returns:
            The path written.
        """
        return self._checkpoints.export(path)

    # ------------------------------------------------------------------ a changing world
    def _change_world(self, cause: BaseException | None, history: History | None,
                      progress: Progress | None) -> None:
        """Note [elastic trainer] in tandem/elastic/run.py: regroup, rebuild what depends on the world, go on."""
        elastic = self._elastic
        assert elastic is not None
        in_step, self._runner.in_step = self._runner.in_step, False
        elastic.run.regroup(cause, self.state.step, in_step=in_step, rebuild=self._rebuild,
                            report=lambda change: self._report(change, history, progress))

    def _rebuild(self, before: Generation, after: Generation) -> Resumed | None:
        """What depends on the world, for the new one: on the members, and on a
        replacement as it joins (Note [a replacement builds first] in
        tandem/control/elastic_group.py). Returns where the state went back to, if it did."""
        elastic = self._elastic
        assert elastic is not None
        own = elastic.own_shard()  # None on a replacement: it has no state yet
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._runner.rank = self.rank
        self.optimizer.zero_grad(set_to_none=True)
        # Note [one gather for a world change's numbers]: DDP's model check rides on the
        # change's first gather: the shards' headers where they are gathered, else the place.
        elastic.reset_model(check=False)
        resumed, wants = None, None
        if elastic.buddy is not None:
            if not is_fully_sharded(self.model):
                self.optimizer.reset_process_group()  # type: ignore[attr-defined]
            # Note [a grow located without a gather] in tandem/elastic/world.py (local steps go
            # back to their last sync, a place known only after it)
            grown_from = elastic.run.grown_from(after) if self._syncs is None else None
            resumed, wants = self._restore_shards(own, grown_from)
        if self._syncs is not None:  # Note [elastic local steps] in tandem/elastic/sync_points.py
            resumed = self._syncs.regroup(has_state=not elastic.run.needs_state)
        elif elastic.buddy is None:
            wants = self._grown_without_a_gather(after)
        if wants is None:
            wants = self._agree_on_the_place(check_model=elastic.buddy is None)
        self._loaders = self._new_loaders()
        self._exact_rest = True  # Note [exact split] in tandem/data/split.py
        self._share_state_if_wanted(wants)
        elastic.changed(self.rank)  # the new world's copies, unless it only grew
        if self._syncs is not None:
            self._syncs.capture()  # every rank at the sync: the new world's first point
        elastic.run.needs_state = False  # only now: Note [a join cut short] in tandem/elastic/run.py
        return resumed

    def _agree_on_the_place(self, *, check_model: bool) -> list[bool]:
        """Every member goes on from the same epoch and sample (Note [an epoch's end
        seen apart] in tandem/elastic/epoch_end.py). A collective of the new world;
        returns which ranks have no place, and so no state (a replacement). With
        ``check_model``, DDP's model check too, in the same gather.

        # Note [one gather for a world change's numbers]
        A world change stops every member until its last collective, and each
        small agreement in it is a round that waits for the slowest member. So
        DDP's model check (every rank wraps the same model: a replacement built
        another one raises the same error on every rank, naming the difference)
        is no round of its own: the model is reset without it
        (``reset_model(check=False)``) and the digest it compares rides on the
        change's first collective (``check_model`` on its return): the shards'
        headers where they are gathered (``BuddyCopies.locate``'s rider), before
        any shard moves; in a grow, which locates them without a gather (Note
        [a grow located without a gather] in tandem/elastic/world.py), their
        exchange, with each rank's place in the data, which a grow cannot
        change; without shards, a grow has no gather at all (Note [a grow checked
        in the store]); else the gather of each rank's place, here. Each member's
        host is known without a collective after the first change (``Membership.hosts_of``)."""
        elastic = self._elastic
        assert elastic is not None
        digest = elastic.model_digest() if check_model else []
        gathered = watched("all_gather of each rank's place in the data", all_gather_ints, self._place() + digest)
        if check_model:
            elastic.check_model([row[3:] for row in gathered])
        return self._take_places([row[:3] for row in gathered])

    def _grown_without_a_gather(self, after: Generation) -> list[bool] | None:
        """In a grow, which ranks want the state, with DDP's model checked, and no
        collective; None where the change is no grow, or a digest cannot be read
        (the caller gathers then).

        # Note [a grow checked in the store]
        Admitting a replacement stops the members, and after its group (built
        ahead: Note [a group built ahead] in tandem/control/elastic_group.py) the
        change's first gather was its longest part: a round of the new world
        that waits for the replacement, the last to be ready, and then for each
        rank's turn on a loaded host. In a grow it carries nothing a member does
        not know: the members committed the same steps and hold one place in the
        data, which the replacement receives with the state; the replacements
        are the ranks past the old world's; and the model check needs only each
        replacement's digest against the members'. So every rank of the new
        world posts its digest as it starts training (``Membership.post_model_digest``,
        each member once: the model is fixed), and a grow reads the old world's
        rank 0's and each replacement's at once (``ElasticWorld.grown_digests``).
        Every rank reads the same keys, so all check alike: where the digests
        differ, DDP's check gathers the models to name the difference and
        raises on every rank, as the gather's check did; where one is missing or
        junk, every rank gathers as before. A change that lost a member, and
        local steps (which go back to their last sync), gather the place."""
        elastic = self._elastic
        assert elastic is not None
        before = elastic.run.grown_from(after)
        if before is None:
            return None
        digests = elastic.grown_digests(before, after)
        if digests is None:
            return None
        elastic.check_model(digests)
        return [rank >= before.world_size for rank in range(after.world_size)]

    def _place(self) -> list[int]:
        """This rank's place in the data, as a world change agrees on it: whether it
        holds one (a replacement does not), the epoch, the samples consumed."""
        assert self._elastic is not None
        return [0, 0, 0] if self._elastic.run.needs_state else [1, self.state.epoch, self.state.consumed]

    def _take_places(self, gathered: list[list[int]]) -> list[bool]:
        """Go on from the place agreed from every rank's :meth:`_place`; returns which
        ranks have none."""
        places = [(row[1], row[2]) if row[0] else None for row in gathered]  # held, epoch, consumed
        end = self._split.end if self._split is not None else self.sampler.dataset_size
        try:
            self.state.epoch, self.state.consumed = agreed_place(places, end)
        except RuntimeError as e:
            raise MembershipError(f"rank {self.rank}: {e}") from None
        return [place is None for place in places]

    def _join(self) -> None:
        """A replacement's start, in its world of one: join the job, and rebuild
        for its world as the members do (Note [a replacement builds first] in
        tandem/control/elastic_group.py)."""
        assert self._elastic is not None
        self._elastic.run.join(self._rebuild, report=lambda change: self._report(change, None, None))

    def _share_state_if_wanted(self, wants: list[bool]) -> None:
        """Rank 0's state on the ranks that have none (``wants``: a replacement)."""
        assert self._elastic is not None
        wanting = self._elastic.run.ranks_wanting_state(wants)
        if wanting:
            receiving = self._elastic.run.needs_state
            if self._diloco is not None:  # the synced parameters and the outer optimizer with it
                self.state.extra["diloco"] = self._diloco.state_dict()
            self._elastic.share_state(wanting)
            diloco = self.state.extra.pop("diloco", None)
            if self._diloco is not None and receiving:
                self._diloco.load_state_dict(diloco)

    def _report(self, change: WorldChange, history: History | None, progress: Progress | None) -> None:
        logger.warning("rank %d: %s", self.rank, change.describe())
        # The new world's rank 0 prints and writes the metrics, whichever process it is.
        if progress is not None:
            progress.set_enabled(self.rank == 0)
            progress.say(change.describe())
        if history is not None:
            history.path = self._output_dir / "metrics.jsonl" if self.rank == 0 else None
            history.append(change.record())

    def _restore_shards(self, own: list[tuple[int, dict[str, Any]]] | None,
                        grown_from: Generation | None) -> tuple[Resumed | None, list[bool] | None]:
        """The shards laid out for the new world, DDP's model checked on the way
        (Note [one gather for a world change's numbers]); in a grow (``grown_from``)
        the place agreed on the way too: returns where the state went back to, if
        it did, and then which ranks want the state (else None: the place is agreed after)."""
        elastic = self._elastic
        assert elastic is not None
        digest = elastic.model_digest()
        wants: list[list[bool]] = []

        def check(riders: list[list[int]]) -> None:
            elastic.check_model([row[:len(digest)] for row in riders])
            if grown_from is not None:
                wants.append(self._take_places([row[len(digest):] for row in riders]))

        rider = digest + (self._place() if grown_from is not None else [])
        resumed = elastic.restore_shards(own, self.rank, self._share_all, grown_from=grown_from, rider=rider,
                                         check_riders=check)
        self._runner.scaled = self._scaled()  # a ZeroOptimizer laid out again: its new shards
        return resumed, wants[0] if wants else None

    def _refresh_buddy(self) -> None:
        if self._elastic is not None:
            self._elastic.refresh_buddy(self.rank)


def _world_sizes(changes: list[dict[str, Any]], final: int) -> tuple[int, ...]:
    """The world sizes a run went through, from its history's world changes, ending at ``final``."""
    sizes = [changes[0]["previous_world_size"], *(c["world_size"] for c in changes)] if changes else [final]
    if sizes[-1] != final:  # resumed at another size than the last change left
        sizes.append(final)
    return tuple(sizes)


def _elastic_run(config: TrainerConfig, model: nn.Module, rank: int) -> ElasticRun | None:
    elastic = elastic_config(config.elastic, "TrainerConfig")
    if elastic is None:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("TrainerConfig(elastic=...) needs a process group: call tandem.init() first")
    if is_fully_sharded(model):
        check_regroupable(model, rank)  # Note [regrouped units] in tandem/fsdp/regroup.py
    return ElasticRun(elastic_membership(elastic))


def _check_local_steps(model: nn.Module, local_steps: DiLoCoConfig, elastic: bool, rank: int) -> None:
    """``TrainerConfig.diloco`` trains the bare model of each rank; in an elastic
    job, with syncs of the whole model (Note [elastic local steps] in tandem/elastic/sync_points.py)."""
    if is_ddp(model):
        raise ValueError(f"rank {rank}: TrainerConfig.diloco trains each rank's own copy of the model between "
                         "syncs: pass the plain module, not a DistributedDataParallel (or a fully_shard model "
                         "sharded over each node's ranks: tandem.node_mesh)")
    if elastic:
        local_steps.check_elastic(f"rank {rank}: TrainerConfig")
        if is_fully_sharded(model):
            raise ValueError(f"rank {rank}: TrainerConfig.diloco with a fully_shard model does not go with an "
                             "elastic job yet: pass the plain module, or run without --elastic")
    if not dist.is_initialized():
        raise ValueError(f"rank {rank}: TrainerConfig.diloco needs torch.distributed: call tandem.init() first")


def _across_nodes(model: nn.Module, rank: int) -> GroupComm:
    """The ranks that sync this rank's shards: those at its place on every node
    (a collective). The model must be sharded over this rank's node alone.

    Raises:
        ValueError: the model is sharded over other ranks, naming both and the fix.
    """
    from tandem.dtensor import is_distributed

    mesh = next(p for p in model.parameters() if is_distributed(p)).device_mesh  # type: ignore[attr-defined]
    nodes = node_mesh(mesh.device_type, who="TrainerConfig.diloco with a fully_shard model")
    mine, node = mesh.mesh.flatten().tolist(), nodes["local"].mesh.flatten().tolist()
    if mine != node:
        raise ValueError(f"rank {rank}: TrainerConfig.diloco with a fully_shard model syncs each node's shards "
                         f"across the nodes, so the model must be sharded over its node's ranks {node}, not "
                         f"{mine}: fully_shard(..., mesh=tandem.node_mesh({mesh.device_type!r})['local'])")
    return GroupComm(nodes["node"].get_group())


def _wrap(model: nn.Module, config: TrainerConfig, world_size: int, *, elastic: bool) -> nn.Module:
    """The model as the Trainer trains it: in DistributedDataParallel when the world
    has more than one rank (an elastic world may grow), unless it is wrapped or sharded."""
    if (world_size == 1 and not elastic) or is_ddp(model) or is_fully_sharded(model):
        return model
    options = dict(config.ddp_options)
    if config.nonfinite is not None and config.precision is not Precision.FP16:
        options["check_finite"] = config.nonfinite  # DDP's own check: Note [check_finite] in ddp/finite.py
    wrapped, _ = apply_strategy(model, None, Strategy.DDP, options=options, world_size=world_size)
    return wrapped


_TRACED = 1024
"""Collectives a Trainer's ledger keeps, so that the trace it writes at the end of
``fit()`` holds the last steps whole, evaluation and saves after them included."""
_TRACED_STEPS = 64
"""Steps whose spans the trace written at the end of ``fit()`` holds."""


class _LazyBoard:
    """A :class:`TensorBoardLog` made at the first record this rank writes (rank
    0's, or the rank that becomes 0 in an elastic job): no event file elsewhere."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._log: TensorBoardLog | None = None

    def write(self, record: dict[str, Any]) -> None:
        if self._log is None:
            self._log = TensorBoardLog(self.directory)
        self._log.write(record)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
