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

__all__ = ["check_ddp_kwargs", "wrap_ddp"]


def check_ddp_kwargs(ddp_kwargs: dict[str, Any]) -> None:
    """Refuse, when the strategy is built, the wrapper options that Lightning's loop cannot
    honour: ZeRO stages need ``tandem.ZeroOptimizer`` to step and to clip (``param.grad``
    then holds this rank's gradients only, and Lightning would step and clip them as they
    are)."""
    if ddp_kwargs.get("zero_stage"):
        raise NotImplementedError(
            f"zero_stage={ddp_kwargs['zero_stage']!r} is not supported by tandem's Lightning strategies: Lightning "
            "steps and clips the optimizer of configure_optimizers, and under ZeRO only tandem.ZeroOptimizer may; "
            "use tandem.DistributedDataParallel and tandem.ZeroOptimizer in your own loop, or TandemFSDPStrategy")


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
