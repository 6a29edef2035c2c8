"""Mixed precision for one device: the autocast context and the gradient scaler.

# Note [agreed found-inf]
A GradScaler skips the optimizer step when it finds an Inf or NaN in the
gradients it unscales. Under plain DDP every rank unscales the same averaged
gradients, so every rank finds the same. When the gradients are sharded (a
ZeroOptimizer's reduced gradient shards, a fully-sharded model's DTensor
gradients), each rank sees only its shard: an overflow in one shard would make
its rank skip while the others step, leaving a partly applied update and scalers
that disagree from then on. torch's ShardedGradScaler all-reduces the found-inf
of each rank before deciding, so every rank skips or steps together; it is what
``scaler_for(..., sharded=True)`` returns. A ZeroOptimizer's gradients are not
its parameters' ``.grad`` (they live in the DDP reducer's ``grad_shards``):
:class:`ShardedGradients` shows them to the scaler as an optimizer would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tandem.train.config import Precision

__all__ = ["ShardedGradients", "autocast_for", "scaler_for"]

_DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def autocast_for(precision: Precision, device: torch.device) -> Callable[[], Any]:
    """A factory of the context that forward and loss run under."""
    if precision is Precision.FP32:
        return contextlib.nullcontext
    dtype = _DTYPES[precision]
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def scaler_for(precision: Precision, device: torch.device, *, sharded: bool = False,
               process_group: Any = None) -> Any:
    """A GradScaler for fp16 (whose small gradients underflow without one), else None.

    bf16 has fp32's exponent range and needs no scaling.

    Args:
        precision: the training precision.
        device: where the gradients are.
        sharded: each rank holds only a shard of the gradients: the scaler agrees
            on found-inf across ``process_group`` (Note [agreed found-inf]).
        process_group: the group the gradients are sharded over (default: the world).
    """
    if precision is not Precision.FP16:
        return None
    if sharded:
        import torch.distributed as dist
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        return ShardedGradScaler(device.type, process_group=process_group or dist.group.WORLD)
    amp_scaler = getattr(torch.amp, "GradScaler", None)
    if amp_scaler is not None:
        return amp_scaler(device.type)
    return torch.cuda.amp.GradScaler()  # torch < 2.3


class ShardedGradients:
    """A ZeroOptimizer as a GradScaler sees it (Note [agreed found-inf]): one param
    group whose "parameters" carry the reduced gradient shards as ``.grad``, so
    that ``scaler.unscale_`` unscales and checks exactly what the optimizer will
    step on, and a ``step`` that steps the ZeroOptimizer.

    Pass it wherever the scaler takes the optimizer (``unscale_``, ``step``); the
    ZeroOptimizer's own ``clip_grad_norm_`` then clips the unscaled shards.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, grad_shards: Sequence[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.param_groups = [{"params": [_holding(shard) for shard in grad_shards]}]

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self.optimizer.step(*args, **kwargs)


def _holding(grad: torch.Tensor) -> torch.Tensor:
    """A stand-in parameter whose ``.grad`` is ``grad``: one element of memory,
    expanded to ``grad``'s shape (GradScaler only reads ``.grad``)."""
    holder = torch.empty(1, dtype=grad.dtype, device=grad.device).expand(grad.shape)
    holder.grad = grad
    return holder
