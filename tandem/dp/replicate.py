"""Replicas of a module, one per device, that autograd connects to the original.

# Note [replica sharing]
A replica is a shallow copy of every module in the tree: a new object whose
``__dict__`` is a copy of the original's, with its own ``_parameters``,
``_buffers`` and ``_modules`` dicts. What goes in them:

* Parameters. On the source device a replica holds the original ``Parameter``
  objects themselves: forward only reads them, and gradients from every replica
  accumulate straight into ``param.grad``. On another device a replica holds
  ``param.to(device)``, made once per device and shared by the replicas there; the
  copy is differentiable, so its gradient flows back to the original. Replicas
  are rebuilt on every forward, so they always see the current parameters.
* Buffers. Replica 0 holds the original buffers; every other replica gets its
  own copy. Forward may write buffers in place (BatchNorm's running statistics),
  and copies keep replicas that share a device from racing on one tensor. So,
  as with torch's DataParallel on distinct GPUs, only replica 0's updates reach
  the original module.
* Submodules and tied parameters keep their sharing: a module or parameter that
  appears twice in the tree maps to one replica object.

Plain attributes are shared by reference, and assignments to them inside a
replica's forward are lost when the replica is dropped, as in torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["replicate"]


def replicate(module: nn.Module, devices: Sequence[torch.device], *,
              detach: bool = False) -> list[nn.Module]:
    """One replica of ``module`` per entry of ``devices`` (which may repeat).

    ``module`` must be on ``devices[0]``. On that device a replica holds the
    original parameters; elsewhere, copies that autograd connects to them
    (unless ``detach``), so that gradients reach the original. Replica 0 holds the original buffers, the others copies
    of them: only replica 0's in-place buffer updates reach the module.

    Args:
        module: the module to replicate.
        devices: one device per replica; ``devices[0]`` is the module's own device.
        detach: make replicas that autograd does not connect to the original
            (for forward without gradients).

    Returns:
        ``len(devices)`` modules; replica ``i`` computes on ``devices[i]``.
    """
    # What a replica shares with the original: Note [replica sharing] above.
    params = {id(p): p for p in module.parameters()}
    copies_per_device: dict[torch.device, dict[int, torch.Tensor]] = {}
    replicas = []
    for i, device in enumerate(devices):
        if device not in copies_per_device:
            copies_per_device[device] = {
                key: _param_on(p, device, detach) for key, p in params.items()}
        tensors = dict(copies_per_device[device])
        for b in module.buffers():
            tensors[id(b)] = b if i == 0 else _buffer_copy(b, device, detach)
        replicas.append(_copy_tree(module, tensors, {}))
    return replicas


def _param_on(p: torch.Tensor, device: torch.device, detach: bool) -> torch.Tensor:
    if p.device == device:
        return p
    return (p.detach() if detach else p).to(device)


def _buffer_copy(b: torch.Tensor, device: torch.device, detach: bool) -> torch.Tensor:
    if detach or not b.requires_grad:
        b = b.detach()
    return b.to(device, copy=True)


def _copy_tree(module: nn.Module, tensors: dict[int, torch.Tensor],
               memo: dict[int, nn.Module]) -> nn.Module:
    if id(module) in memo:
        return memo[id(module)]
    replica = type(module).__new__(type(module))
    replica.__dict__ = module.__dict__.copy()
    memo[id(module)] = replica
    # A replica's parameters are plain tensors (copies autograd connects to the
    # originals), as in torch's replicate, not the Parameters _parameters is typed for.
    replica._parameters = {k: None if p is None else tensors[id(p)]  # type: ignore[misc]
                           for k, p in module._parameters.items()}
    replica._buffers = {k: None if b is None else tensors[id(b)]
                        for k, b in module._buffers.items()}
    replica._modules = {k: None if m is None else _copy_tree(m, tensors, memo)
                        for k, m in module._modules.items()}
    return replica
