"""The DDP wrapper's arguments checked and resolved before anything is built: the
ZeRO options, what tandem does not support yet, the group, the device."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.ddp.zero_config import ZeroConfig, ZeroStage

__all__ = ["check_zero_config", "reject_unsupported", "resolve_device_ids", "resolve_group", "single_device"]


def check_zero_config(config: ZeroConfig | None, stage: ZeroStage, gradient_as_bucket_view: bool,
                       find_unused_parameters: bool) -> ZeroConfig:
    if config is not None and not isinstance(config, ZeroConfig):
        raise TypeError(f"zero_config must be a tandem.zero.ZeroConfig, got {config!r}")
    if config is not None and not stage:
        raise ValueError("zero_config is given but zero_stage=0; pass zero_stage=1 or 2")
    if stage and gradient_as_bucket_view:
        raise ValueError(f"gradient_as_bucket_view=True is not supported with zero_stage={int(stage)}: "
                         "param.grad does not hold the reduced gradients under ZeRO")
    if stage and find_unused_parameters:
        # The shard holds zeros for a parameter no rank used, and the optimizer would
        # step it (torch's optimizers skip a parameter whose .grad is None).
        raise NotImplementedError(
            f"find_unused_parameters=True is not supported with zero_stage={int(stage)} yet")
    return config or ZeroConfig()


def reject_unsupported(**given: Any) -> None:
    for name, value in given.items():
        if value is not None:
            raise NotImplementedError(
                f"tandem.DistributedDataParallel does not support {name} yet (got {value!r}); "
                "leave it unset, or use torch.nn.parallel.DistributedDataParallel for this feature")


def resolve_group(process_group: dist.ProcessGroup | None, device_mesh: Any) -> dist.ProcessGroup | None:
    if process_group is not None and device_mesh is not None:
        raise ValueError("pass either process_group or device_mesh to DistributedDataParallel, not both")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise ValueError(f"only a 1-D device_mesh is supported, got {device_mesh.ndim}-D: {device_mesh}")
        return device_mesh.get_group(mesh_dim=0)
    return process_group


def single_device(named_params: list[tuple[str, nn.Parameter]]) -> tuple[torch.device, str]:
    devices = {p.device for _, p in named_params}
    types = {d.type for d in devices}
    if len(types) != 1:
        raise ValueError(
            "DistributedDataParallel's module must be on one type of device, but its parameters "
            f"are on {sorted(str(d) for d in devices)}; move the module with module.to(device)")
    if len(devices) > 1:
        raise ValueError(
            f"DistributedDataParallel's module spans several devices {sorted(str(d) for d in devices)}; "
            "tandem supports single-device modules: move the module to one device")
    device = next(iter(devices))
    return device, device.type


def resolve_device_ids(device_ids: Any, output_device: Any, device: torch.device,
                        device_type: str) -> tuple[list[int] | None, int | None]:
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(f"device_ids can only be None or contain a single element, got {device_ids}")
    if not device_ids or device_type == "cpu":
        if device_ids or output_device is not None:
            raise ValueError(
                "DistributedDataParallel device_ids and output_device only work with a module "
                f"on one GPU, but got device_ids={device_ids}, output_device={output_device} and "
                f"a module on {device}; leave both unset for CPU modules")
        return None, None
    ids = [torch.device(d).index if isinstance(d, (str, torch.device)) else int(d) for d in device_ids]
    if ids[0] != device.index:
        raise ValueError(f"device_ids={device_ids} but the module is on {device}; they must agree")
    out = ids[0] if output_device is None else (
        torch.device(output_device).index if isinstance(output_device, (str, torch.device))
        else int(output_device))
    return ids, out
