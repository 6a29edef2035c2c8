"""Mixed precision for one device: the autocast context and the gradient scaler."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from tandem.train.config import Precision

__all__ = ["autocast_for", "scaler_for"]

_DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def autocast_for(precision: Precision, device: torch.device) -> Callable[[], Any]:
    """A factory of the context that forward and loss run under."""
    if precision is Precision.FP32:
        return contextlib.nullcontext
    dtype = _DTYPES[precision]
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def scaler_for(precision: Precision, device: torch.device) -> Any:
    """A GradScaler for fp16 (whose small gradients underflow without one), else None.

    bf16 has fp32's exponent range and needs no scaling.
    """
    if precision is not Precision.FP16:
        return None
    amp_scaler = getattr(torch.amp, "GradScaler", None)
    if amp_scaler is not None:
        return amp_scaler(device.type)
    return torch.cuda.amp.GradScaler()  # torch < 2.3
