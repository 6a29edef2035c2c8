"""What a :class:`tandem.Trainer` run does: a frozen, validated configuration."""

from __future__ import annotations

import inspect

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from tandem.control.generation import ElasticConfig
from tandem.diloco.config import DiLoCoConfig
from tandem.ddp.checks import NonFinite

__all__ = ["CheckpointFormat", "Precision", "TrainerConfig"]


class Precision(str, Enum):
    """The dtype forward and loss run in (parameters and optimizer stay fp32)."""

    FP32 = "fp32"
    BF16 = "bf16"    # autocast to bfloat16: CPU and CUDA, no scaler needed
    FP16 = "fp16"    # autocast to float16 with a GradScaler against underflow

    @classmethod
    def parse(cls, value: str | Precision) -> Precision:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"precision must be one of {[p.value for p in cls]}, got {value!r}") from None


class CheckpointFormat(str, Enum):
    """How the Trainer writes checkpoints (it resumes from either)."""

    FULL = "full"          # one file, the whole state gathered onto rank 0, in torch's format
    SHARDED = "sharded"    # every rank writes its shard with torch.distributed.checkpoint
    PER_RANK = "per_rank"  # every rank writes its whole state: the ranks' models differ (DiLoCo)

    @classmethod
    def parse(cls, value: str | CheckpointFormat | None) -> CheckpointFormat | None:
        if value is None:
            return None
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"checkpoint_format must be one of {[f.value for f in cls]} or None, "
                             f"got {value!r}") from None


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Options of :class:`tandem.Trainer`. Batch sizes are per rank, as with DDP:
    the global batch of one optimizer step is ``batch_size * grad_accum * world_size``."""

    epochs: int = 1
    """Passes over the training data."""
    batch_size: int = 32
    """Samples per rank per micro-batch."""
    eval_batch_size: int | None = None
    """Samples per rank per evaluation batch (default: ``batch_size``)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; all but the last run without gradient sync
    (DDP's ``no_sync()``, a fully-sharded model's ``set_requires_gradient_sync(False)``)."""
    precision: Precision | str = Precision.FP32
    """fp32, bf16 (autocast) or fp16 (autocast and a gradient scaler)."""
    max_grad_norm: float | None = None
    """Clip the global gradient norm to this before each step (None: no clipping)."""
    shuffle: bool = True
    """Shuffle the training data, with a new order each epoch."""
    drop_last: bool = False
    """Drop the tail of the training data that does not fill every rank equally
    (False: pad it by repetition, as DistributedSampler does)."""
    seed: int = 0
    """Seed of the data order (the model's initialisation is the caller's)."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    output_dir: str | Path = "tandem-run"
    """Where checkpoints, ``metrics.jsonl`` and ``loss.png`` go."""
    checkpoint_every: int = 0
    """Also save a checkpoint every this many optimizer steps (0: only at the end
    of each epoch and of the run)."""
    keep_checkpoints: int = 2
    """Checkpoints kept in ``output_dir/checkpoints``; older ones are deleted."""
    checkpoint_format: CheckpointFormat | str | None = None
    """"sharded": each rank writes its shard of the model and optimizer in parallel
    (torch.distributed.checkpoint, in a committed step directory); "full": rank 0
    writes one file holding the whole state in torch's format; "per_rank": each
    rank writes its whole state (with ``diloco``, whose ranks' models differ
    between syncs). None: "per_rank" with ``diloco``, "sharded" for a
    fully-sharded model or a ZeroOptimizer, "full" otherwise. Resuming reads
    each; ``Trainer.export`` writes the full format on demand."""
    async_checkpoint: bool = False  # Note [saves in the background] in tandem/train/background_saves.py
    """Save checkpoints without stopping training for the write: each is copied
    into host memory (kept between saves: a second copy of the state) and
    written on a background thread, at most one at a time, as atomically as a
    synchronous save; a failed write raises at the next save or at the end of
    ``fit``. Not with ``elastic``."""
    resume: bool = True
    """Continue from the latest checkpoint in ``output_dir`` when there is one."""
    max_steps: int | None = None
    """Stop after this many optimizer steps in total (saving a checkpoint), even
    mid-epoch; a later run with ``resume`` continues from there."""
    log_every: int = 10
    """Optimizer steps between training-loss records (and their all-reduce)."""
    progress: bool = True
    """Show a progress bar on rank 0 (tqdm when installed, else a line per record)."""
    plot: bool = True
    """Write ``loss.png`` at the end (needs matplotlib; without it, one line says so)."""
    ddp_options: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments for tandem.DistributedDataParallel when the Trainer wraps
    the model (bucket_cap_mb, find_unused_parameters, ...); a key it does not
    take is refused when the config is made, naming the ones it takes."""
    nonfinite: NonFinite | str | None = None
    """NaN/Inf in a step's gradients: "raise" on every rank, naming the ranks and
    parameters, or "skip" the optimizer step on every rank (DDP's ``check_finite``,
    agreed across ranks; records count skipped steps). None: no check. With fp16
    the GradScaler already skips such steps: only "skip" applies, and counts them."""
    elastic: bool | ElasticConfig | None = None  # Note [elastic trainer] in tandem/elastic/run.py
    """Keep training when a rank dies (DDP): the survivors drop the step in flight,
    agree on who is left, and go on as a smaller world, with nothing read from
    disk; the rest of the epoch is split over the new world so that no sample is
    lost or seen twice. A replacement started with ``TANDEM_ELASTIC_JOIN=1``
    builds its model in a world of one, asks to join in ``fit()``, joins at the
    next step boundary and gets the state from live peers. True uses
    :class:`~tandem.control.generation.ElasticConfig`'s defaults; None: on when the
    job runs under ``tandem run --elastic`` (``TANDEM_ELASTIC=1``)."""

    tensorboard: bool = False
    """Also write every record as TensorBoard scalars (``train/loss``,
    ``train/lr``, ``eval/loss``, ...) to ``output_dir/tensorboard``, on rank 0;
    needs the ``tensorboard`` package."""
    diloco: DiLoCoConfig | None = None  # Note [local steps and the outer step] in tandem/diloco/diloco.py
    """Train with local steps (DiLoCo, LocalSGD, Streaming DiLoCo): the model is
    not wrapped in DDP, each rank steps its own copy with the optimizer, and the
    ranks sync every ``diloco.sync_every`` steps (:class:`tandem.DiLoCo`). A
    model sharded with ``fully_shard`` over each node alone
    (``mesh=tandem.node_mesh()["local"]``) makes each node one worker: every
    step's collectives stay inside it, and each rank's shards sync with the
    ranks at its place on the other nodes. Checkpoints are then per rank. With ``elastic``, a change of world takes
    every rank back to the last sync, the new world trains the steps since
    again, and every epoch's end is a sync; that needs syncs of the whole model
    (one fragment, no overlap, no mix). Not with ``async_checkpoint`` yet;
    evaluation runs each rank's model on its share of the data (between syncs
    the ranks' models differ)."""
    straggler_every: int | None = 4  # Note [naming a straggler] in tandem/train/stragglers.py
    """Every this many steps (more where steps are short: a window lasts at
    least 0.1 s) the ranks share how long each phase of their steps took
    (waiting for data, compute, waiting on communication, the optimizer),
    and a rank consistently slower than the others in a phase is named in the
    records (``"stragglers"``) and the progress line: ``rank 2 slow: data 3.1x
    the median``. One small all-gather each time; None turns it off. Not yet
    with ``elastic``."""

    def __post_init__(self) -> None:
        precision = Precision.parse(self.precision)
        nonfinite = NonFinite.parse(self.nonfinite, "nonfinite")
        object.__setattr__(self, "precision", precision)
        object.__setattr__(self, "nonfinite", nonfinite)
        object.__setattr__(self, "checkpoint_format", CheckpointFormat.parse(self.checkpoint_format))
        if nonfinite is NonFinite.RAISE and precision is Precision.FP16:
            raise ValueError("nonfinite='raise' does not go with precision='fp16', whose GradScaler "
                             "expects occasional overflow and skips those steps itself; use "
                             "nonfinite='skip' (which counts them), or precision='bf16'")
        _check_ddp_options(self.ddp_options)
        ddp_check = NonFinite.parse(self.ddp_options.get("check_finite", False))
        if ddp_check is not None and precision is Precision.FP16:
            raise ValueError("ddp_options check_finite does not go with precision='fp16': the "
                             "GradScaler must see the overflows it backs off from; use "
                             "nonfinite='skip' instead")
        if nonfinite is not None and ddp_check not in (None, nonfinite):
            raise ValueError(f"nonfinite={nonfinite.value!r} but ddp_options has "
                             f"check_finite={self.ddp_options['check_finite']!r}; set one of them")
        if self.elastic is True:
            object.__setattr__(self, "elastic", ElasticConfig())
        elif self.elastic is not None and not isinstance(self.elastic, (bool, ElasticConfig)):
            raise TypeError(f"elastic must be a bool or an ElasticConfig, got {self.elastic!r}")
        if not isinstance(self.tensorboard, bool):
            raise ValueError(f"tensorboard must be a bool, got {self.tensorboard!r}")
        if not isinstance(self.async_checkpoint, bool):
            raise ValueError(f"async_checkpoint must be a bool, got {self.async_checkpoint!r}")
        if self.diloco is not None:
            if not isinstance(self.diloco, DiLoCoConfig):
                raise TypeError(f"diloco must be a tandem.DiLoCoConfig or None, got {self.diloco!r}")
            if self.async_checkpoint:
                raise ValueError("diloco does not go with async_checkpoint yet; pass async_checkpoint=False")
            if self.elastic:
                self.diloco.check_elastic("TrainerConfig")
            if self.checkpoint_format not in (None, CheckpointFormat.PER_RANK):
                raise ValueError(f"diloco needs checkpoint_format='per_rank' (the ranks' models differ between "
                                 f"syncs), got {self.checkpoint_format!r}")
        object.__setattr__(self, "output_dir", Path(self.output_dir))
        for name in ("epochs", "batch_size", "grad_accum", "log_every", "keep_checkpoints"):
            _check_positive(name, getattr(self, name))
        for name in ("eval_batch_size", "max_steps", "straggler_every"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        for name in ("checkpoint_every", "num_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {self.max_grad_norm!r}")


def _check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _check_ddp_options(options: Mapping[str, Any]) -> None:
    """Every key of ``ddp_options`` is a keyword argument of tandem.DistributedDataParallel:
    a misspelt one fails when the config is made, not when the Trainer wraps the model."""
    if not isinstance(options, Mapping):
        raise TypeError(f"ddp_options must be a mapping of DistributedDataParallel's keyword arguments, "
                        f"got {options!r}")
    from tandem.ddp import DistributedDataParallel

    accepted = [name for name in inspect.signature(DistributedDataParallel.__init__).parameters
                if name not in ("self", "module")]
    unknown = [key for key in options if key not in accepted]
    if unknown:
        raise ValueError(f"ddp_options has {', '.join(map(repr, unknown))}, which tandem.DistributedDataParallel "
                         f"does not take; it takes {', '.join(accepted)}")

