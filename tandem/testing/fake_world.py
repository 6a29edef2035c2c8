"""One rank of a large world in one process: :func:`fake_world`.

torch's fake process group (backend ``"fake"``) runs rank ``r`` of a world of
``N`` alone: every collective returns at once and leaves its output as it
was (an all-gather's output holds whatever its memory held), while everything
else, the shards of 1/N, each unit's gathered buffers, the host's work and
the kernels, is real. So per-rank memory and step time of a sharded model at
a world of 64 can be measured, and compared between two implementations, on
one device. The values the model computes are meaningless.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from tandem._compat import fake_store

__all__ = ["fake_world"]


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """``with fake_world(64): ...``: the default process group is rank ``rank``
    of a fake world of ``world_size`` inside the block, and destroyed after it.

    Build a mesh over it as usual (``init_device_mesh("cuda", (world_size,))``).

    Raises:
        ValueError: ``world_size < 1`` or ``rank`` outside ``[0, world_size)``.
        RuntimeError: a default process group exists already (this process is
            a rank of a real job; the fake group would replace it).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    if dist.is_initialized():
        raise RuntimeError(f"fake_world({world_size}): a default process group ({dist.get_backend()}, "
                           f"{dist.get_world_size()} ranks) exists already; destroy it first")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
