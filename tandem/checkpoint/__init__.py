"""Checkpoints that are complete or absent.

A single file is saved atomically (:func:`atomic_save`): a save killed midway
leaves the previous file intact. A checkpoint of several files, written by
several ranks, goes into a step directory ``root/step-{step:08d}/`` that a
marker written last commits (:func:`save_committed`, :func:`load_committed`):
a save killed midway is never loaded, and the step before it stays the newest.
Sharded state (a fully_shard model's DTensors, a ZeroOptimizer's shards) is
saved the same way through torch.distributed.checkpoint, and loads at any world
size (:func:`save_sharded_checkpoint`, :func:`load_sharded_checkpoint`).

What a training run's checkpoint holds is :class:`tandem.TrainingState`, saved
and loaded with :func:`tandem.save_checkpoint` and :func:`tandem.load_checkpoint`.
"""

# The package's files, for developers:
#
# What it holds: state.py's TrainingState (Note [exact resume]) is the one
# protocol for a run's state: every object in it (model, optimizer, scheduler,
# scaler) is saved and loaded through its state_dict and load_state_dict,
# torch's Stateful; rng.py adds every rank's random generators, and
# full_state.py a fully-sharded model's state gathered to the full format.
# Sharded state (a fully_shard model's DTensors, a ZeroOptimizer's shards) goes
# through torch.distributed.checkpoint instead: dcp.py, with flat.py for tensors
# that ranks hold as flat ranges (ZeRO's shards, whose layout
# tandem/zero/dcp_state.py describes).
#
# How it is written: single files atomically (atomic.py), by one rank for all
# (one_rank.py: Note [save on one rank]), and checkpoints of several files,
# written by several ranks, in step directories (steps.py) committed by a marker
# written last (commit.py; agree.py makes a failure on one rank an error on all).
#
# The Trainer's use of them (when to save, prune, resume, export) is
# tandem/train/run_checkpoints.py and sharded_checkpoint.py.
#
# Above ddp/ and fsdp/ (full_state.py reads fully_shard models); below zero/,
# elastic/ and train/.

from typing import TYPE_CHECKING

from tandem.checkpoint.atomic import atomic_save, atomic_write_bytes
from tandem.checkpoint.commit import load_committed, save_committed
from tandem.checkpoint.steps import MARKER, CheckpointError, CommittedCheckpoint, FileRecord, committed_steps, \
    step_directory

# The sharded checkpoints are imported on first use (PEP 562): they load
# torch.distributed.checkpoint and DTensor (0.9 s of CPU), which a process that
# saves on one rank, or none, never needs.
if TYPE_CHECKING:
    from tandem.checkpoint.dcp import load_sharded_checkpoint, save_sharded_checkpoint


def __getattr__(name: str) -> object:
    if name in ("load_sharded_checkpoint", "save_sharded_checkpoint"):
        from tandem.checkpoint import dcp

        value: object = getattr(dcp, name)
        globals()[name] = value  # the next lookup is a plain attribute
        return value
    raise AttributeError(f"module 'tandem.checkpoint' has no attribute {name!r}")

__all__ = ["MARKER", "CheckpointError", "CommittedCheckpoint", "FileRecord", "atomic_save", "atomic_write_bytes",
           "committed_steps", "load_committed", "load_sharded_checkpoint", "save_committed",
           "save_sharded_checkpoint", "step_directory"]
