"""``tandem.DataParallel``: one process, one thread per device.

Each forward scatters the inputs (scatter_gather.py), replicates the module
(replicate.py), runs the replicas in threads (parallel_apply.py) and gathers
their outputs on ``output_device``. Every step is differentiable, so
``loss.backward()`` on the gathered output brings the gradients of all replicas
back to the original parameters, and ``optimizer.step()`` on them works as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tandem.dp.parallel_apply import parallel_apply
from tandem.dp.replicate import replicate
from tandem.dp.scatter_gather import gather, scatter_kwargs

__all__ = ["DataParallel"]

logger = logging.getLogger(__name__)

DeviceLike = int | str | torch.device


class DataParallel(nn.Module):
    """Data parallelism over the devices of one process: a drop-in for
    :class:`torch.nn.DataParallel`.

    On each call the batch is split along ``dim`` into one chunk per device, the
    module is replicated onto each device, the replicas run in parallel threads,
    and their outputs are concatenated on ``output_device``. Tensors nested in
    tuples, lists, dicts, namedtuples and dataclasses are split; other arguments
    are passed to every replica by reference.

    Unlike torch's, this works with any devices, including the CPU named several
    times (``device_ids=["cpu"] * 3``), which is how it is tested without GPUs.
    With ``device_ids=None`` it uses every CUDA device, and with no CUDA device it
    calls the module directly, as torch does; with one device it moves the inputs
    there and calls the module directly.

    Warning:
        Only replica 0's in-place buffer updates (BatchNorm's running statistics)
        reach the original module, computed from replica 0's chunk of the batch,
        as in torch. Use :class:`tandem.SyncBatchNorm` with
        :class:`tandem.DistributedDataParallel` for statistics of the whole batch.

    Args:
        module: the module to parallelise; its parameters and buffers must be on
            ``device_ids[0]`` (with one device it is moved there).
        device_ids: devices to run on: ints (CUDA indices), strings or
            ``torch.device``; may repeat. Default: all CUDA devices, or none.
        output_device: where outputs are gathered (``-1`` means the CPU).
            Default: ``device_ids[0]``.
        dim: the batch dimension along which inputs are split and outputs joined.

    Attributes:
        device_ids: the devices, as ``torch.device`` (torch keeps CUDA indices).
        output_device: ``torch.device``, or ``None`` when there are no devices.
        src_device_obj: ``device_ids[0]``, where the module lives.
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[DeviceLike] | None = None,
                 output_device: DeviceLike | None = None, dim: int = 0) -> None:
        super().__init__()
        self.module = module
        self.dim = dim
        self.device_ids = _default_devices() if device_ids is None else [_as_device(d) for d in device_ids]
        if not self.device_ids:
            self.output_device: torch.device | None = None
            self.src_device_obj: torch.device | None = None
            return
        self.src_device_obj = self.device_ids[0]
        self.output_device = self.src_device_obj if output_device is None else _as_device(output_device)
        if len(self.device_ids) == 1:
            self.module.to(self.src_device_obj)
        logger.info("DataParallel: %d replicas on %s, outputs on %s", len(self.device_ids),
                    ", ".join(map(str, self.device_ids)), self.output_device)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self.device_ids or (not inputs and not kwargs):
            return self.module(*inputs, **kwargs)
        self._check_module_on_source_device()
        args, kw = self.scatter(inputs, kwargs, self.device_ids)
        if len(self.device_ids) == 1:
            return self.module(*args[0], **kw[0])
        devices = self.device_ids[: len(args)]
        replicas = self.replicate(self.module, devices)
        outputs = self.parallel_apply(replicas, args, kw)
        return self.gather(outputs, self.output_device)

    # The four steps are methods, as in torch, so that a subclass can change one.

    def scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None,
                device_ids: Sequence[torch.device]) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def replicate(self, module: nn.Module, device_ids: Sequence[torch.device]) -> list[nn.Module]:
        return replicate(module, device_ids, detach=not torch.is_grad_enabled())

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[tuple[Any, ...]],
                       kwargs: Sequence[dict[str, Any]]) -> list[Any]:
        return parallel_apply(replicas, inputs, kwargs, self.device_ids[: len(replicas)])

    def gather(self, outputs: Sequence[Any], output_device: torch.device | None) -> Any:
        assert output_device is not None  # gather runs only with devices
        return gather(outputs, output_device, dim=self.dim)

    def _check_module_on_source_device(self) -> None:
        for kind, named in (("parameter", self.module.named_parameters()),
                            ("buffer", self.module.named_buffers())):
            for name, t in named:
                if t.device != self.src_device_obj:
                    raise RuntimeError(
                        f"DataParallel: {kind} '{name}' is on {t.device}, but the module must be "
                        f"on device_ids[0] = {self.src_device_obj}; move it there with "
                        f"module.to({str(self.src_device_obj)!r}) before the first forward")


def _default_devices() -> list[torch.device]:
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []


def _as_device(d: DeviceLike) -> torch.device:
    """The device as tensors report it (``cpu``, ``cuda:<i>``), so that equal devices compare equal."""
    if isinstance(d, int):
        return torch.device("cpu") if d < 0 else torch.device("cuda", d)
    device = torch.device(d)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
