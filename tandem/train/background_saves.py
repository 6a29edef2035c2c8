"""The Trainer's checkpoints saved in the background
(``TrainerConfig(async_checkpoint=True)``): training stops for a copy of the
state in memory, not for the write.

# Note [saves in the background]
What runs where, at a save after step N:

training thread   1. finish the previous save: join its writer thread, and
                     agree on its outcome on the training's group (an
                     all-reduce of a flag; the messages are gathered when it is
                     set): a failure on any rank raises on every rank, here,
                     naming the path, the rank and the error;
                  2. capture the state with the collectives of a synchronous
                     save (every rank's RNG state; the full format also
                     gathers a sharded model or ZeRO's shards onto rank 0);
                  3. stage it: copy every tensor into CPU buffers kept from one
                     save to the next (Note [staging buffers] in
                     tandem/checkpoint/staging.py), so that step N+1 cannot
                     change what is written;
                  4. launch the writer thread, and go on training.
writer thread     full format: rank 0 writes ``step-N.pt`` as any save does
                  (Note [atomic save] in tandem/checkpoint/atomic.py); the
                  other ranks write nothing. Sharded: every rank writes its
                  shard into the committed step directory (Note [committed
                  step directories] in tandem/checkpoint/commit.py). Then rank
                  0 prunes the oldest checkpoints.

Atomicity is the synchronous save's: a checkpoint becomes visible by the last
act of its write (the rename of the file, the commit marker), so a process
killed during the background write leaves the previous checkpoint the latest
one, and the unfinished file or directory is never listed (the next save
removes it). Pruning runs on the writer thread after that last act, so the
previous checkpoint is never removed before the new one is complete.

At most one save is in flight: a save finishes the previous one first (step
1), and so do the end of ``fit`` (whose last save is therefore complete when
``fit`` returns), a resume, an export and ``latest()``. The staging buffers are
reused only then, after the write that read them has ended.

Collectives: the writer thread never issues one on the training's process
group, where it could pair with a training collective of another rank (gloo
matches collectives by their order on a group; two threads issuing on one
group interleave differently on each rank). The full format's writer issues
none: its outcome is agreed on the training thread at step 1. The sharded
format's writer must talk (DCP plans the files across ranks; the commit
gathers every rank's files before rank 0 writes the marker), so it does so on
a gloo group of its own, made once, on the training thread of every rank, when
the Trainer is built. A gloo group has its own connections and its own
queue of work, so its gathers neither pair with nor delay the training's; and
on it the collectives come in the same order on every rank, because only the
writer thread uses it and only one save is in flight.

The price: a second copy of the state in host memory, held between saves;
and the writer's CPU time (pickling, checksums, DCP's planning, which also
holds the GIL) taken beside training's. An elastic job's world changes under
a save in flight, with the checkpoint group's ranks; the Trainer refuses
``async_checkpoint`` there.
"""

from __future__ import annotations

import logging
from pathlib import Path
import torch.distributed as dist

from tandem.checkpoint.atomic import atomic_save
from tandem.checkpoint.background import BackgroundWrite
from tandem.checkpoint.one_rank import checkpoint_name, prune_checkpoints
from tandem.checkpoint.staging import Stager
from tandem.checkpoint.state import TrainingState
from tandem.checkpoint.steps import step_directory
from tandem.train.config import CheckpointFormat

__all__ = ["BackgroundSaves"]

logger = logging.getLogger(__name__)


class BackgroundSaves:
    """A run's saves, staged on the training thread and written on a writer
    thread (Note [saves in the background]).

    Args:
        state: what a checkpoint holds.
        directory: the run's checkpoint directory.
        fmt: whole files on rank 0, or every rank's shard.
        keep: how many checkpoints to keep (the newest).
    """

    def __init__(self, state: TrainingState, directory: Path, fmt: CheckpointFormat, keep: int) -> None:
        self.state, self.directory, self.format, self._keep = state, directory, fmt, keep
        self._stager = Stager()
        self._write = BackgroundWrite(rank=0)
        # The sharded writer's own group, made now: every rank builds its Trainer, and the
        # first save does not pay for the group's rendezvous.
        self._group = _checkpoint_group() if fmt is CheckpointFormat.SHARDED else None

    def save(self, rank: int) -> Path:
        """Finish the previous save, stage this one and launch its write (a
        collective). Returns the path the write commits."""
        self._write.rank = rank
        self._write.finish()
        step = self.state.step
        if self.format is CheckpointFormat.SHARDED:
            # Imported here: it loads torch.distributed.checkpoint, which unsharded runs never need.
            from tandem.train.sharded_checkpoint import capture_sharded_state, write_sharded_state

            loop, shards = capture_sharded_state(self.state)
            staged_loop, staged_shards = self._stager.stage((loop, shards))
            group = self._group
            path = step_directory(self.directory, step)

            def write() -> None:
                write_sharded_state(staged_loop, staged_shards, self.directory, step, group=group)
                if rank == 0:
                    prune_checkpoints(self.directory, self._keep, keeping=path)
            self._write.launch(path, write)
        else:
            path = self.directory / checkpoint_name(step)
            whole = self.state.state_dict()  # on rank 0; None elsewhere
            if whole is None:
                self._write.launch(path, None)  # rank 0 writes; this rank agrees on the outcome
            else:
                staged = self._stager.stage(whole)

                def write() -> None:
                    atomic_save(staged, path)
                    prune_checkpoints(self.directory, self._keep, keeping=path)
                self._write.launch(path, write)
        logger.debug("rank %d: staged step %d (%.1f MiB of buffers)", rank, step, self._stager.nbytes / 2**20)
        return path

    def finish(self) -> Path | None:
        """Wait for the save in flight and raise its error on every rank (a
        collective when one was launched)."""
        return self._write.finish()

    def join(self) -> None:
        """Wait for the save in flight, reporting nothing (no communication)."""
        self._write.join()

    def abandon(self) -> None:
        """On an error path: wait for the save in flight, log its error."""
        self._write.abandon()


def _checkpoint_group() -> dist.ProcessGroup | None:
    """A gloo group of every rank for the sharded writer's collectives (None
    without torch.distributed). A collective."""
    if dist.is_available() and dist.is_initialized():
        return dist.new_group(backend="gloo")
    return None
