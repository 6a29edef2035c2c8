"""Training on top of DDP: seeding (rng.py), atomic checkpoints (tandem/checkpoint/one_rank.py),
the state an exact resume needs (state.py), sharded checkpoints of it
(sharded_checkpoint.py), the Trainer (trainer.py) with its
configuration, precision, progress, history and plot, and prepare (prepare.py)
for users who keep their own loop, elastic with ``prepare(elastic=...)``
(prepare_elastic.py; the Trainer's side is elastic.py and elastic_world.py)."""

from tandem.checkpoint.one_rank import atomic_save, latest_checkpoint, list_checkpoints, load_checkpoint, \
    save_checkpoint
from tandem.train.config import CheckpointFormat, Precision, TrainerConfig
from tandem.data.loader import DistributedLoader, gather_for_metrics
from tandem.train.prepare import Strategy, no_sync, prepare, unwrap
from tandem.train.rng import capture_rng_state, rank_seed, restore_rng_state, seed_everything
from tandem.train.state import TrainingState
from tandem.train.trainer import FitResult, Trainer

__all__ = ["CheckpointFormat", "DistributedLoader", "FitResult", "Precision", "Strategy", "Trainer", "TrainerConfig",
           "TrainingState",
           "atomic_save", "capture_rng_state", "gather_for_metrics", "latest_checkpoint", "list_checkpoints",
           "load_checkpoint", "no_sync", "prepare", "rank_seed", "restore_rng_state", "save_checkpoint",
           "seed_everything", "unwrap"]
