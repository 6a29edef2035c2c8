"""Checkpoints that are complete or absent: single files written atomically
(atomic.py), by one rank for all (one_rank.py: Note [save on one rank]), and
checkpoints of several files, written by several ranks, in step directories
(steps.py) committed by a marker written last (commit.py; agree.py makes a
failure on one rank an error on all). dcp.py puts torch.distributed.checkpoint's
sharded state of fully_shard models into the same directories; flat.py lets DCP
save and reshard tensors that ranks hold as flat ranges (ZeRO's shards).

Below zero/ and train/: it uses only comm/.
"""

from tandem.checkpoint.atomic import atomic_save, atomic_write_bytes
from tandem.checkpoint.commit import load_committed, save_committed
from tandem.checkpoint.dcp import load_sharded_checkpoint, save_sharded_checkpoint
from tandem.checkpoint.steps import MARKER, CheckpointError, CommittedCheckpoint, FileRecord, committed_steps, \
    step_directory

__all__ = ["MARKER", "CheckpointError", "CommittedCheckpoint", "FileRecord", "atomic_save", "atomic_write_bytes",
           "committed_steps", "load_committed", "load_sharded_checkpoint", "save_committed",
           "save_sharded_checkpoint", "step_directory"]
