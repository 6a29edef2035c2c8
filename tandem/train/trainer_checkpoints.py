"""The Trainer's checkpoints: saved after each epoch (and every
``checkpoint_every`` steps), pruned, resumed from, exported; the third of the
Trainer's layers (trainer.py lists them)."""

from __future__ import annotations

from pathlib import Path

from tandem.checkpoint.one_rank import checkpoint_name, latest_checkpoint, list_checkpoints, \
    load_checkpoint, remove_checkpoint, save_checkpoint
from tandem.train.config import CheckpointFormat
from tandem.train.history import History
from tandem.train.sharded_checkpoint import load_sharded_state, save_sharded_state
from tandem.train.trainer_step import TrainerStep

__all__ = ["TrainerCheckpoints"]


class TrainerCheckpoints(TrainerStep):
    """The Trainer's third layer: ``_save``, ``export`` and ``_resume``."""

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
