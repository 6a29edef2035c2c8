"""Which collectives layer a hook issues through.

A hook's ``state`` names a process group the way torch's hooks expect (``None``
for the world, a ``ProcessGroup``), or is a tandem ``GroupComm``. When the group
is the one the DDP reduces over, tandem's hooks issue through the DDP's own
``GroupComm`` (``bucket.comm``), so its observers see the hook's collectives and
``ddp.comm_stats`` counts their bytes. On torch's DDP (whose bucket has no
``comm``) or for another group, they use a ``GroupComm`` of their own, which
nothing counts.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from tandem.comm.group import GroupComm

__all__ = ["hook_comm", "is_default_group"]


def hook_comm(group: Any, bucket: Any) -> GroupComm:
    """The ``GroupComm`` for a hook whose state names ``group``.

    Args:
        group: ``None`` (the default group), a ``ProcessGroup``, or a ``GroupComm``.
        bucket: tandem's or torch's ``GradBucket``.
    """
    if isinstance(group, GroupComm):
        return group
    comm = getattr(bucket, "comm", None)
    if isinstance(comm, GroupComm) and _same_group(comm.group, group):
        return comm
    return GroupComm(group)


def is_default_group(group: Any) -> bool:
    """Whether ``group`` (``None``, a ``ProcessGroup`` or a ``GroupComm``) is the default group."""
    if isinstance(group, GroupComm):
        group = group.group
    return _same_group(group, None)


def _same_group(a: Any, b: Any) -> bool:
    world = dist.group.WORLD
    return (world if a is None else a) is (world if b is None else b)
