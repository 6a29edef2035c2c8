"""What the Trainer finds out about its world, model and batches without being
told: rank and size, the model's device, whether it is a DDP model, a plain
gradient norm, a batch's length."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem._compat import dtensor_api

__all__ = ["batch_len", "device_of", "is_ddp", "plain_tensor", "rank_and_size"]


def rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def is_ddp(model: nn.Module) -> bool:
    return hasattr(model, "no_sync") and isinstance(getattr(model, "module", None), nn.Module)


def plain_tensor(norm: torch.Tensor) -> torch.Tensor:
    """``norm`` as a plain tensor: clip_grad_norm_ over DTensor gradients returns a
    replicated DTensor (so ``full_tensor()`` communicates nothing)."""
    DTensor, _, _ = dtensor_api()
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def batch_len(targets: Any) -> int:
    if isinstance(targets, torch.Tensor):
        return targets.shape[0]
    if isinstance(targets, (list, tuple)) and targets:
        return batch_len(targets[0])
    if isinstance(targets, Mapping) and targets:
        return batch_len(next(iter(targets.values())))
    raise TypeError(f"cannot tell the batch size of targets of type {type(targets).__name__}")
