"""``--fresh`` for the examples that resume from their output directory."""

from __future__ import annotations

import os
import shutil

import torch.distributed as dist

from tandem.control.elastic_group import JOIN_ENV
from tandem.comm.world import WorldInfo

__all__ = ["start_over"]


def start_over(output_dir: str, world: WorldInfo) -> None:
    """Delete ``output_dir`` (rank 0) before any rank reads it. Not in a
    replacement under ``--elastic`` (``TANDEM_ELASTIC_JOIN=1``): it is rank 0 of
    a world of its own until it joins, and the directory holds the running
    job's checkpoints."""
    if os.environ.get(JOIN_ENV) == "1":
        return
    if world.rank == 0:
        shutil.rmtree(output_dir, ignore_errors=True)
    if world.world_size > 1:
        dist.barrier()
