"""The Trainer's checkpoints when the ranks' models differ (local steps,
:class:`tandem.DiLoCo`): every rank writes its own whole state.

# Note [per-rank trainer checkpoints]
Between two syncs each rank of a DiLoCo run has its own parameters, its own
inner optimizer state and its own outer state (a sync in flight): one copy
of rank 0's would resume every rank from rank 0's, and the run would not
continue as if never stopped. So each rank writes its own file into a
committed step directory (Note [committed step directories] in
tandem/checkpoint/commit.py)::

    step-00000120/
      trainer.pt          rank 0: the loop part (step, epoch, consumed samples,
                          every rank's RNG state, scheduler, scaler, history)
      rank-0-of-4.pt      each rank: its model, optimizer and local state
      ...
      COMMITTED.json      rank 0, last: every file's size and CRC-32

A save killed before the marker leaves the step unloaded. A run resumes on
as many ranks as saved it (each rank reads its own file); another world
size is refused, naming both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tandem._tree import map_tensors
from tandem.checkpoint.atomic import atomic_save
from tandem.checkpoint.full_state import is_fully_sharded
from tandem.dtensor import is_distributed
from tandem.checkpoint.commit import load_committed, save_committed
from tandem.checkpoint.state import TrainingState, unwrap_model
from tandem.checkpoint.steps import LOOP_FILE, step_of

__all__ = ["KIND", "load_per_rank_state", "save_per_rank_state"]

logger = logging.getLogger(__name__)

KIND = "tandem.trainer.per_rank"
"""The ``kind`` in the commit marker of these checkpoints."""


def _rank_file(rank: int, world: int) -> str:
    return f"rank-{rank}-of-{world}.pt"


def save_per_rank_state(state: TrainingState, root: str | Path, local: Callable[[], dict[str, Any]]) -> Path:
    """Save ``state`` (and ``local()``, this rank's own extra state) into the
    committed step directory of ``state.step`` under ``root``. A collective.

    Raises:
        tandem.checkpoint.CheckpointError: on every rank, when a rank failed.
    """
    loop = state.loop_state_dict()
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {"model": unwrap_model(state.model).state_dict(),
            "optimizer": None if state.optimizer is None else state.optimizer.state_dict(), "local": local()}
    if is_fully_sharded(state.model):
        # A shard's local tensor is a view into its unit's padded buffer, which torch.save
        # cannot write: each is copied out (fully_shard inside a node: Note [DiLoCo across
        # nodes, fully_shard inside] in tandem/diloco/diloco.py).
        mine = map_tensors(lambda t: t.detach().clone() if is_distributed(t) else t, mine)

    def write(directory: Path) -> list[str]:
        names = [_rank_file(rank, world)]
        atomic_save(mine, directory / names[0])
        if loop is not None:  # rank 0
            atomic_save(loop, directory / LOOP_FILE)
            names.append(LOOP_FILE)
        return names

    return save_committed(root, state.step, write, kind=KIND)


def load_per_rank_state(state: TrainingState, directory: str | Path, load_local: Callable[[dict[str, Any]], None],
                        *, map_location: Any = None) -> None:
    """Load the committed checkpoint ``directory`` that :func:`save_per_rank_state`
    wrote into ``state`` (and ``load_local``), each rank its own file. A collective.

    Raises:
        tandem.checkpoint.CheckpointError: on every rank: a missing, truncated or corrupt file.
        ValueError: the checkpoint was saved by another number of ranks (named), or
            its loop part does not fit the run; before anything is loaded.
    """
    directory = Path(directory)
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = load_committed(directory.parent, step=step_of(directory), kind=KIND)
    if ckpt.world_size != world:
        raise ValueError(f"rank {rank}: {directory} was saved by {ckpt.world_size} ranks, each its own model "
                         f"(local steps: the ranks differ between syncs); resume it on {ckpt.world_size} ranks, "
                         f"not {world}")
    loop = torch.load(ckpt.path(LOOP_FILE), map_location=map_location or "cpu", weights_only=True)
    state.check_loop_state(loop)
    mine = torch.load(ckpt.path(_rank_file(rank, world)), map_location=map_location or "cpu", weights_only=True)
    unwrap_model(state.model).load_state_dict(mine["model"])
    if state.optimizer is not None:
        state.optimizer.load_state_dict(mine["optimizer"])
    load_local(mine["local"])
    state.load_loop_state_dict(loop)
    logger.info("resumed from the per-rank checkpoint %s", ckpt.directory)
