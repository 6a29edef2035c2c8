"""Checkpoint files: written atomically by one rank, read by every rank.

Each file is written as Note [atomic save] (tandem/checkpoint/atomic.py) says:
a save killed at any point leaves the previous checkpoint intact. Checkpoints of
several files, one or more per rank, go into committed step directories instead
(tandem/checkpoint/commit.py).

# Note [save on one rank]
Under data parallelism every rank holds the same model and optimizer state, so
rank 0 writes and the others wait. They wait in a collective that also carries
whether the write succeeded: a full disk on rank 0 becomes an error on every
rank, instead of rank 0 dying and the others hanging in the next collective. The wait is one of
tandem's (watched under ``--elastic``: Note [dead peers] in peers.py): a short
soak once found a rank held in it by a peer killed inside the save while the
others had left to regroup.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tandem.checkpoint.atomic import atomic_save
from tandem.checkpoint.steps import committed_steps, remove_step_directory, step_directory
from tandem.comm.group import GroupComm

__all__ = ["atomic_save", "latest_checkpoint", "list_checkpoints", "load_checkpoint", "prune_checkpoints",
           "remove_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)

_STEP_NAME = re.compile(r"^step-(\d+)\.pt$")


def save_checkpoint(obj: Any, path: str | os.PathLike[str], *,
                    group: dist.ProcessGroup | None = None) -> Path:
    """Write ``obj`` to ``path`` on rank 0 of ``group``, atomically, then let every
    rank continue once the file is complete. A collective: call it on every rank
    (only rank 0's ``obj`` is used; the others may pass None).

    Raises:
        RuntimeError: on every rank, when rank 0 failed to write (rank 0 raises
            its own exception).
    """
    path = Path(path)
    if not _distributed(group):
        return atomic_save(obj, path)
    rank = dist.get_rank(group)
    error: BaseException | None = None
    if rank == 0:
        try:
            atomic_save(obj, path)
            logger.info("checkpoint saved: %s", path)
        except Exception as e:  # reported to every rank below, then re-raised here
            error = e
    comm = GroupComm(group)
    failed = torch.tensor([0 if error is None else 1], device=comm.device)
    # Through tandem's collectives, so that under --elastic a rank waiting here for a
    # peer that died (or left to regroup) is told, not held until the group's timeout.
    comm.all_reduce(failed, tag="checkpoint written")
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError(f"rank {rank}: rank 0 failed to write the checkpoint {path}; "
                           "its own error says why (often a full disk or a missing permission)")
    return path


def load_checkpoint(path: str | os.PathLike[str], *, map_location: Any = None,
                    weights_only: bool = True) -> Any:
    """Read a checkpoint on this rank, onto ``map_location`` (by default this
    process's device: ``cuda:LOCAL_RANK`` when CUDA is in use, else the CPU).

    Args:
        weights_only: torch.load's safe mode (tensors, containers and numbers only),
            which every checkpoint tandem writes satisfies. Pass False only for
            files you trust that hold other Python objects.

    Raises:
        FileNotFoundError: naming the path and what the directory does hold.
    """
    path = Path(path)
    if not path.is_file():
        present = sorted(p.name for p in path.parent.glob("*.pt")) if path.parent.is_dir() else []
        raise FileNotFoundError(f"no checkpoint at {path} (that directory holds: "
                                f"{', '.join(present) or 'no .pt files'})")
    if map_location is None:
        map_location = _local_device()
    return torch.load(path, map_location=map_location, weights_only=weights_only)


def checkpoint_name(step: int) -> str:
    """The file name the Trainer uses for the checkpoint after ``step`` optimizer steps."""
    return f"step-{step:08d}.pt"


def list_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoints in ``directory``, oldest step first: ``step-N.pt``
    files (full state) and committed ``step-N/`` directories (sharded). Temporary
    files and directories of an unfinished save are not listed; of a file and a
    directory of the same step, the directory comes last."""
    # Sharded: Note [sharded trainer checkpoints] in tandem/train/sharded_checkpoint.py.
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), 0, p) for p in directory.iterdir() if (m := _STEP_NAME.match(p.name))]
    found += [(s, 1, step_directory(directory, s)) for s in committed_steps(directory)]
    return [p for _, _, p in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint with the highest step in ``directory``, or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def remove_checkpoint(path: str | os.PathLike[str]) -> None:
    """Delete a checkpoint file, or a sharded checkpoint's step directory (its
    commit marker first, so that a removal cut short leaves nothing loadable)."""
    path = Path(path)
    if path.is_dir():
        remove_step_directory(path)
    else:
        path.unlink(missing_ok=True)


def prune_checkpoints(directory: str | os.PathLike[str], keep: int, *, keeping: Path) -> None:
    """Remove all but the newest ``keep`` checkpoints in ``directory``, never
    ``keeping`` (the one just saved stays even below newer ones). Local: call it
    on one rank, once ``keeping`` is complete."""
    for old in list_checkpoints(directory)[:-keep]:
        if old != keeping:
            remove_checkpoint(old)


def _distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _local_device() -> torch.device:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
