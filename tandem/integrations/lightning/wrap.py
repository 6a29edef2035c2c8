"""The one wrapping step that tandem's DDP strategies (Trainer and Fabric) change
in Lightning's: ``tandem.DistributedDataParallel`` where Lightning builds
``torch.nn.parallel.DistributedDataParallel``, with the same device ids and
the strategy's keyword arguments passed through."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from tandem.ddp import DistributedDataParallel

__all__ = ["wrap_ddp"]


def wrap_ddp(module: nn.Module, device_ids: list[int] | None, ddp_kwargs: dict[str, Any]) -> DistributedDataParallel:
    """``module`` in ``tandem.DistributedDataParallel`` with ``ddp_kwargs`` (torch's
    arguments such as ``bucket_cap_mb``, ``find_unused_parameters``,
    ``static_graph``, and tandem's own: ``zero_stage``, ``check_finite``). On a GPU
    the construction runs on a side stream, as Lightning does for torch's DDP, so
    that its broadcasts do not serialise with the default stream."""
    ids: list[int | torch.device] | None = None if device_ids is None else list(device_ids)
    stream = torch.cuda.stream(torch.cuda.Stream()) if ids is not None else nullcontext()
    with stream:
        return DistributedDataParallel(module, device_ids=ids, **ddp_kwargs)
