"""Run replicas concurrently, one thread each, and report a failure by replica.

Threads share the process, so a replica's forward sees the caller's gradient
mode and autocast settings only if they are set again in its thread (both are
thread-local in torch); ``_CallerState`` carries them over.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["parallel_apply"]


@dataclass(frozen=True)
class _CallerState:
    """The caller's thread-local settings that a replica's forward must see."""

    grad_enabled: bool
    autocast: dict[str, tuple[bool, torch.dtype]]    # device type -> (enabled, dtype)

    @classmethod
    def capture(cls, devices: Sequence[torch.device]) -> _CallerState:
        types = {d.type for d in devices}
        return cls(torch.is_grad_enabled(),
                   {t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types})

    def enter(self, stack: contextlib.ExitStack, device: torch.device) -> None:
        stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
        enabled, dtype = self.autocast[device.type]
        if enabled:
            stack.enter_context(torch.autocast(device.type, dtype=dtype))
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))


def parallel_apply(replicas: Sequence[nn.Module], args: Sequence[tuple[Any, ...]],
                   kwargs: Sequence[dict[str, Any]], devices: Sequence[torch.device]) -> list[Any]:
    """Call ``replicas[i](*args[i], **kwargs[i])`` on ``devices[i]`` for every ``i``,
    in parallel threads (in the calling thread when there is one replica).

    Returns:
        The outputs, in replica order.

    Raises:
        The exception of the lowest-numbered replica that failed, as the same
        type when it can be built from a message (``RuntimeError`` otherwise),
        saying which replica and device it came from, and chained to the
        original (whose traceback shows where in the replica's forward it was
        raised).
    """
    if not len(replicas) == len(args) == len(kwargs) == len(devices):
        raise ValueError(f"parallel_apply: {len(replicas)} replicas, {len(args)} argument tuples, "
                         f"{len(kwargs)} keyword dicts and {len(devices)} devices; expected one each")
    state = _CallerState.capture(devices)
    results: list[Any] = [None] * len(replicas)
    errors: dict[int, BaseException] = {}

    def work(i: int) -> None:
        try:
            with contextlib.ExitStack() as stack:
                state.enter(stack, devices[i])
                results[i] = replicas[i](*args[i], **kwargs[i])
        except Exception as exc:  # re-raised in the caller below
            errors[i] = exc

    if len(replicas) == 1:
        work(0)
    else:
        threads = [threading.Thread(target=work, args=(i,), name=f"tandem-dp-replica-{i}")
                   for i in range(len(replicas))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        i = min(errors)
        _reraise(errors[i], f"replica {i} on device {devices[i]}")
    return results


def _reraise(exc: BaseException, where: str) -> None:
    message = f"{where} raised {type(exc).__name__}: {exc}"
    try:
        wrapped = type(exc)(message)
    except Exception:
        wrapped = RuntimeError(message)
    raise wrapped from exc
