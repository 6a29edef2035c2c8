"""Training on top of DDP: seeding (rng.py), atomic checkpoints (checkpoint.py),
the state an exact resume needs (state.py), and the Trainer (trainer.py) with its
configuration, precision, progress, history and plot."""

from tandem.train.checkpoint import atomic_save, latest_checkpoint, list_checkpoints, load_checkpoint, \
    save_checkpoint
from tandem.train.config import Precision, TrainerConfig
from tandem.train.rng import capture_rng_state, rank_seed, restore_rng_state, seed_everything
from tandem.train.state import TrainingState
from tandem.train.trainer import FitResult, Trainer

__all__ = ["FitResult", "Precision", "Trainer", "TrainerConfig", "TrainingState", "atomic_save",
           "capture_rng_state", "latest_checkpoint", "list_checkpoints", "load_checkpoint",
           "rank_seed", "restore_rng_state", "save_checkpoint", "seed_everything"]
