"""The Trainer's checkpoints: saved after each epoch (and every
``checkpoint_every`` steps), pruned, resumed from, exported; whole files on
one rank, or every rank's shard for sharded models (Note [sharded trainer
checkpoints] in sharded_checkpoint.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tandem.checkpoint.one_rank import checkpoint_name, latest_checkpoint, list_checkpoints, load_checkpoint, \
    remove_checkpoint, save_checkpoint
from tandem.train.config import CheckpointFormat
from tandem.train.history import History
from tandem.train.sharded_checkpoint import load_sharded_state, save_sharded_state
from tandem.checkpoint.state import TrainingState

__all__ = ["RunCheckpoints"]


class RunCheckpoints:
    """The checkpoints of one run's ``state`` in ``directory``.

    Args:
        state: what a checkpoint holds.
        directory: ``output_dir/checkpoints``.
        fmt: whole files, or every rank's shard.
        keep: how many to keep (the newest).
        device: where a resume loads tensors.
    """

    def __init__(self, state: TrainingState, directory: Path, fmt: CheckpointFormat, keep: int,
                 device: torch.device) -> None:
        self.state, self.directory, self.format, self._keep, self._device = state, directory, fmt, keep, device

    def latest(self) -> Path | None:
        return latest_checkpoint(self.directory)

    def save(self, history: History, rank: int) -> Path:
        """Save now (a collective), then prune the oldest on rank 0."""
        self.state.extra = {"history": history.records}
        if self.format is CheckpointFormat.SHARDED:
            path = save_sharded_state(self.state, self.directory)
        else:
            path = save_checkpoint(self.state.state_dict(), self.directory / checkpoint_name(self.state.step))
        if rank == 0:
            for old in list_checkpoints(self.directory)[:-self._keep]:
                if old != path:  # the step just saved stays, even below newer ones
                    remove_checkpoint(old)
        return path

    def export(self, path: str | Path) -> Path:
        """The whole state in one file (see :meth:`tandem.Trainer.export`)."""
        return save_checkpoint(self.state.state_dict(), path)

    def resume(self, rank: int, share_all: Callable[[Any], list[Any]]) -> Path | None:
        """Load the latest checkpoint, which every rank must see (``share_all``:
        every rank's value, on every rank); None when there is none."""
        latest = self.latest()
        seen = share_all(None if latest is None else latest.name)
        if len(set(seen)) > 1:
            raise RuntimeError(
                f"rank {rank}: ranks see different latest checkpoints in {self.directory} "
                f"({dict(enumerate(seen))}); output_dir must be one shared directory, or pass "
                "resume=False")
        if latest is None:
            return None
        if latest.is_dir():
            load_sharded_state(self.state, latest, map_location=self._device)
        else:
            self.state.load_state_dict(load_checkpoint(latest, map_location=self._device))
        return latest
