"""The Trainer's checkpoints: saved after each epoch (and every
``checkpoint_every`` steps), pruned, resumed from, exported; whole files on
one rank, or every rank's shard for sharded models (Note [sharded trainer
checkpoints] in sharded_checkpoint.py); written while training waits, or in
the background (Note [saves in the background] in background_saves.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from tandem.checkpoint.one_rank import checkpoint_name, latest_checkpoint, load_checkpoint, prune_checkpoints, \
    save_checkpoint
from tandem.train.background_saves import BackgroundSaves
from tandem.train.config import CheckpointFormat
from tandem.train.history import History
from tandem.train.per_rank_checkpoint import load_per_rank_state, save_per_rank_state
from tandem.checkpoint.state import TrainingState

__all__ = ["RunCheckpoints"]


class Saves(Protocol):
    """How a run's checkpoints are written: while training waits, or in the background."""

    def save(self, rank: int) -> Path: ...
    def finish(self) -> Path | None: ...
    def join(self) -> None: ...
    def abandon(self) -> None: ...


class LocalState(Protocol):
    """A rank's own state beside the model and optimizer (a per-rank checkpoint's)."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class WaitedSaves:
    """Saves that training waits for: written, committed and pruned before
    :meth:`save` returns."""

    def __init__(self, state: TrainingState, directory: Path, fmt: CheckpointFormat, keep: int,
                 local: LocalState | None = None) -> None:
        self.state, self.directory, self.format, self._keep, self._local = state, directory, fmt, keep, local

    def save(self, rank: int) -> Path:
        """Save now (a collective), then prune the oldest on rank 0."""
        if self.format is CheckpointFormat.PER_RANK:
            local = self._local
            path = save_per_rank_state(self.state, self.directory, lambda: {} if local is None else local.state_dict())
        elif self.format is CheckpointFormat.SHARDED:
            from tandem.train.sharded_checkpoint import save_sharded_state  # loads torch.distributed.checkpoint

            path = save_sharded_state(self.state, self.directory)
        else:
            path = save_checkpoint(self.state.state_dict(), self.directory / checkpoint_name(self.state.step))
        if rank == 0:
            prune_checkpoints(self.directory, self._keep, keeping=path)
        return path

    def finish(self) -> Path | None:
        return None

    def join(self) -> None:
        pass

    def abandon(self) -> None:
        pass


class RunCheckpoints:
    """The checkpoints of one run's ``state`` in ``directory``.

    Args:
        state: what a checkpoint holds.
        directory: ``output_dir/checkpoints``.
        fmt: whole files, or every rank's shard.
        keep: how many to keep (the newest).
        device: where a resume loads tensors.
        background: stage each save in memory and write it on a thread (Note
            [saves in the background] in background_saves.py).
        local: this rank's own state, saved with a per-rank checkpoint (Note
            [per-rank trainer checkpoints] in per_rank_checkpoint.py).
    """

    def __init__(self, state: TrainingState, directory: Path, fmt: CheckpointFormat, keep: int,
                 device: torch.device, *, background: bool = False, local: LocalState | None = None) -> None:
        self.state, self.directory, self.format, self._device = state, directory, fmt, device
        self._local = local
        self._saves: Saves = (BackgroundSaves(state, directory, fmt, keep) if background
                              else WaitedSaves(state, directory, fmt, keep, local))

    def latest(self) -> Path | None:
        self._saves.join()  # a save in flight is listed once it is complete
        return latest_checkpoint(self.directory)

    def save(self, history: History, rank: int) -> Path:
        """Save now, or launch the save (a collective); prune the oldest on rank 0."""
        self.state.extra = {"history": history.records}
        return self._saves.save(rank)

    def finish(self) -> Path | None:
        """Wait for the save in flight, raising its error on every rank (a
        collective); the path it committed, or None."""
        return self._saves.finish()

    def abandon(self) -> None:
        """On an error path: wait for the save in flight without communicating."""
        self._saves.abandon()

    def export(self, path: str | Path) -> Path:
        """The whole state in one file (see :meth:`tandem.Trainer.export`)."""
        self.finish()
        return save_checkpoint(self.state.state_dict(), path)

    def resume(self, rank: int, share_all: Callable[[Any], list[Any]]) -> Path | None:
        """Load the latest checkpoint, which every rank must see (``share_all``:
        every rank's value, on every rank); None when there is none."""
        self.finish()
        latest = self.latest()
        seen = share_all(None if latest is None else latest.name)
        if len(set(seen)) > 1:
            raise RuntimeError(
                f"rank {rank}: ranks see different latest checkpoints in {self.directory} "
                f"({dict(enumerate(seen))}); output_dir must be one shared directory, or pass "
                "resume=False")
        if latest is None:
            return None
        if latest.is_dir() and self.format is CheckpointFormat.PER_RANK:
            local = self._local
            load_per_rank_state(self.state, latest,
                                lambda saved: None if local is None else local.load_state_dict(saved),
                                map_location=self._device)
        elif latest.is_dir():
            from tandem.train.sharded_checkpoint import load_sharded_state  # loads torch.distributed.checkpoint

            load_sharded_state(self.state, latest, map_location=self._device)
        else:
            self.state.load_state_dict(load_checkpoint(latest, map_location=self._device))
        return latest
