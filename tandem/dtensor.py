"""The local tensors of tensor-parallel (DTensor) parameters and their
gradients, which is what tandem's data parallelism reduces and shards.

A model parallelised with torch's tensor parallelism (``parallelize_module``
over ``mesh["tp"]``) holds ``DTensor`` parameters, each rank its shard.
``tandem.DistributedDataParallel(model, device_mesh=mesh["dp"])`` averages
each rank's shards with the ranks that hold the same ones (the data-parallel
group of the 2-D mesh), and ``param.grad`` stays a DTensor laid out like its
parameter, so that torch's optimizers and ``clip_grad_norm_`` work as they do
without DDP. A gradient that tensor parallelism left as a ``Partial`` sum is
first redistributed to its parameter's placements, a collective over the
tensor-parallel group, as torch's FSDP2 does. ``tandem.fully_shard(model,
mesh=mesh["dp"])`` shards each rank's local tensors on dim 0 over ``dp`` in the
same way.

torch's own DDP does not accept DTensor parameters; torch converts them to
plain tensors and back around every forward (``_pre_dp_module_transform``),
which tandem does not need.
"""

# Note [tensor-parallel parameters]
# A model parallelised with torch's tensor parallelism (``parallelize_module``
# over ``mesh["tp"]``) holds ``DTensor`` parameters: each rank keeps its shard of
# a ``ColwiseParallel`` weight, say, and the DTensor knows the global shape. DDP
# over ``mesh["dp"]`` (the other dimension) averages each shard with the ranks
# that hold the same shard: the data-parallel group of a 2-D mesh is exactly the
# ranks with the same tensor-parallel coordinate. So DDP's reducer works on local
# tensors only: a parameter's bucket view is shaped like its local shard, its
# gradient is read from and written to ``param.grad``'s local tensor, and
# ``param.grad`` stays a DTensor laid out like the parameter, so that torch's
# optimizers and ``clip_grad_norm_`` see what they see without DDP.
#
# A gradient whose placements differ from its parameter's (a ``Partial`` sum that
# tensor parallelism left unreduced) is redistributed to the parameter's
# placements when it is first read, as torch's FSDP2 does; that is a collective
# over the tensor-parallel group, issued by every rank of it in the same order
# (the order of backward). Plain parameters (a LayerNorm that tensor parallelism
# left alone) are what they always were.
#
# fully_shard over ``mesh["dp"]`` shards the local tensor on dim 0 in the same
# way (Note [2-D parameters] in tandem/fsdp/tensor_parallel.py).

from __future__ import annotations

import sys
from typing import Any

import torch

from tandem._compat import dtensor_like, dtensor_local

__all__ = ["is_distributed", "local_grad", "local_tensor", "set_local_grad"]


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # never DTensors: answered without a look-up


def _dtensor_class() -> type | None:
    """DTensor's class, or None while its package is not loaded: no tensor can be
    a DTensor then, and importing the package (0.6 s) is left to whoever makes one."""
    package = sys.modules.get("torch.distributed.tensor") or sys.modules.get("torch.distributed._tensor")
    return getattr(package, "DTensor", None)


def is_distributed(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (a tensor-parallel parameter or gradient)."""
    if type(t) in _PLAIN:  # the per-gradient path of every step: as cheap as the isinstance it replaces
        return False
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or the local shard of a DTensor (the same tensor object, so
    writes to it are writes to ``t``)."""
    return dtensor_local(t) if is_distributed(t) else t


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The local tensor of ``p.grad`` (None when there is none). A DTensor
    gradient laid out unlike ``p`` (a ``Partial`` sum) is first redistributed
    to ``p``'s placements, a collective over the tensor-parallel group, and
    rebound to ``p.grad``."""
    # Note [tensor-parallel parameters] at the top of this file.
    grad = p.grad
    if grad is None or type(grad) is torch.Tensor or not is_distributed(grad):
        return grad
    dgrad: Any = grad  # a DTensor
    placements = p.placements  # type: ignore[attr-defined]
    if dgrad.placements != placements:
        dgrad = dgrad.redistribute(placements=placements)
        p.grad = dgrad
    return dtensor_local(dgrad)


def set_local_grad(p: torch.Tensor, local: torch.Tensor) -> None:
    """``p.grad = local``, as a DTensor laid out like ``p`` when ``p`` is one."""
    p.grad = dtensor_like(local, p) if is_distributed(p) else local
