"""Training on top of DDP, ZeRO and fully_shard: the :class:`Trainer` with its
configuration (:class:`TrainerConfig`), precision, progress, history, plot,
checkpoints and elastic runs; and :func:`prepare` for users who keep their own
loop, with the strategies both use (:class:`Strategy`)."""

# The package's files: the Trainer (trainer.py) with its configuration, precision,
# progress, history and plot; its checkpoints (run_checkpoints.py,
# sharded_checkpoint.py; what they hold is tandem/checkpoint/state.py) and its
# elastic side (tandem/elastic/world.py); and prepare (prepare.py) for users who
# keep their own loop, with the strategies both use (strategy.py).

from tandem.checkpoint.one_rank import atomic_save, latest_checkpoint, list_checkpoints, load_checkpoint, \
    save_checkpoint
from tandem.train.config import CheckpointFormat, Precision, TrainerConfig
from tandem.data.loader import DistributedLoader, gather_for_metrics
from tandem.train.prepare import Strategy, no_sync, prepare, unwrap
from tandem.checkpoint.rng import capture_rng_state, rank_seed, restore_rng_state, seed_everything
from tandem.checkpoint.state import TrainingState
from tandem.train.trainer import FitResult, Trainer

__all__ = ["CheckpointFormat", "DistributedLoader", "FitResult", "Precision", "Strategy", "Trainer", "TrainerConfig",
           "TrainingState",
           "atomic_save", "capture_rng_state", "gather_for_metrics", "latest_checkpoint", "list_checkpoints",
           "load_checkpoint", "no_sync", "prepare", "rank_seed", "restore_rng_state", "save_checkpoint",
           "seed_everything", "unwrap"]
