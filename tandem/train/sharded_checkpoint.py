"""The Trainer's sharded checkpoints: every rank writes its own shard of the model
and optimizer state with torch.distributed.checkpoint, in parallel, into a
committed step directory; the rest of the training state goes beside it.

# Note [sharded trainer checkpoints]
A checkpoint is the committed step directory ``checkpoints/step-00000120/``
(Note [committed step directories] in tandem/checkpoint/commit.py)::

    step-00000120/
      trainer.pt          rank 0: step, epoch, consumed samples, every rank's RNG
                          state, scheduler, scaler, history (TrainingState's loop part)
      __0_0.distcp ...    each rank: its shard of the model and optimizer (DCP)
      .metadata           DCP's coordinator: keys, shapes, which file holds what
      COMMITTED.json      rank 0, last: every file's size and CRC-32

The DCP state is ``{"model": ..., "optim": ...}`` in the layout of torch's
``get_state_dict``: a fully-sharded model's DTensors (each rank writes its dim-0
slice), a ZeroOptimizer's flat shards (Note [ZeRO state in DCP] in
tandem/zero/dcp_state.py) beside the model's replicated parameters (which DCP
de-duplicates, spreading them over the ranks), or a plain model's replicated
state. No rank gathers anything but the small RNG states. A save killed at any
point before the marker leaves the directory unloaded, and the step before it is
the one resumed. DCP reshards at load: a run saved on N ranks resumes on M, and
in either layout (a ZeRO checkpoint loads into a fully-sharded model of the
same parameters, and the other way round).

The full format (one file, ``step-00000120.pt``, the whole state gathered onto
rank 0: Note [full checkpoints of a sharded model] in tandem/checkpoint/full_state.py) stays
available: ``TrainerConfig(checkpoint_format="full")``, or ``Trainer.export`` for
one file to share. Both formats live in one checkpoint directory; the newest
step is resumed, whichever its format.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.checkpoint.atomic import atomic_save
from tandem.checkpoint.commit import load_committed, save_committed
from tandem.checkpoint.dcp import dcp_state_dicts, dcp_writer, load_dcp_files, load_dcp_into, read_dcp_metadata
from tandem.checkpoint.state import TrainingState, unwrap_model
from tandem.checkpoint.steps import LOOP_FILE, step_of
from tandem.zero.dcp_state import zero_dcp_state, zero_load_target
from tandem.zero.optimizer import ZeroOptimizer

__all__ = ["KIND", "capture_sharded_state", "load_sharded_state", "save_sharded_state",
           "write_sharded_state"]

logger = logging.getLogger(__name__)

KIND = "tandem.trainer"
"""The ``kind`` in the commit marker of the Trainer's sharded checkpoints."""


def save_sharded_state(state: TrainingState, root: str | Path, *, group: dist.ProcessGroup | None = None) -> Path:
    """Save ``state`` into the committed step directory of ``state.step`` under
    ``root`` (Note [sharded trainer checkpoints]). A collective.

    Returns:
        The committed step directory.

    Raises:
        tandem.checkpoint.CheckpointError: on every rank, when a rank failed.
    """
    loop, shards = capture_sharded_state(state, group)
    return write_sharded_state(loop, shards, root, state.step, group=group)


def capture_sharded_state(state: TrainingState, group: dist.ProcessGroup | None = None
                          ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """What a sharded checkpoint of ``state`` holds: the loop part (on rank 0,
    None elsewhere) and this rank's DCP state, whose tensors are the live ones
    (stage them before training goes on: Note [saves in the background] in
    background_saves.py). A collective: the one gather of every rank's RNG state."""
    return state.loop_state_dict(group), _dcp_state(state.model, state.optimizer)


def write_sharded_state(loop: dict[str, Any] | None, shards: dict[str, Any], root: str | Path, step: int, *,
                        group: dist.ProcessGroup | None = None) -> Path:
    """Write what :func:`capture_sharded_state` returned into the committed step
    directory of ``step`` under ``root``. A collective over ``group``, which
    need not be the group that captured it (only its ranks must be the same).

    Returns:
        The committed step directory.
    """
    def write_loop(directory: Path) -> None:
        if loop is not None:  # rank 0
            atomic_save(loop, directory / LOOP_FILE)

    return save_committed(root, step, dcp_writer(shards, group, before=write_loop), kind=KIND, group=group)


def load_sharded_state(state: TrainingState, directory: str | Path, *,
                       map_location: Any = None, group: dist.ProcessGroup | None = None) -> None:
    """Load the committed checkpoint ``directory`` (a step directory that
    :func:`save_sharded_state` wrote) into ``state``, at any world size. A
    collective.

    Raises:
        tandem.checkpoint.CheckpointError: on every rank: a missing, truncated or
            corrupt file, or a key or shape that does not fit (named).
        ValueError: the loop part does not fit the run (no scheduler state for
            a scheduler, ...), before anything is loaded.
    """
    directory = Path(directory)
    ckpt = load_committed(directory.parent, step=step_of(directory), kind=KIND, group=group)
    loop = torch.load(ckpt.path(LOOP_FILE), map_location=map_location or "cpu", weights_only=True)
    state.check_loop_state(loop)
    model, optimizer = state.model, state.optimizer
    if isinstance(optimizer, ZeroOptimizer):
        target = zero_load_target(optimizer, read_dcp_metadata(ckpt).state_dict_metadata)
        shards = {"model": unwrap_model(model).state_dict(), "optim": target.state}
        load_dcp_files(ckpt, shards, group)  # in place: into the parameters and the target's buffers
        unwrap_model(model).load_state_dict(shards["model"])
        target.install()
    else:
        load_dcp_into(ckpt, unwrap_model(model), optimizer, group)
    state.load_loop_state_dict(loop, group)
    logger.info("resumed from the sharded checkpoint %s (saved by %d ranks)", ckpt.directory, ckpt.world_size)


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if isinstance(optimizer, ZeroOptimizer):
        return {"model": unwrap_model(model).state_dict(), "optim": zero_dcp_state(optimizer)}
    return dcp_state_dicts(unwrap_model(model), optimizer)
