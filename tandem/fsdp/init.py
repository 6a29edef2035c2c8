"""Random initialisation of sharded parameters: :func:`init_like_unsharded`.

# Note [random init of shards]
A model built on the meta device, sharded and given memory with ``to_empty``
gets its values from its own ``init_weights()`` / ``reset_parameters()``, as
torchtitan does (Note [meta init] in api.py). Those run ``nn.init`` functions
on the sharded parameters, which are DTensors, so every random op
(``normal_``, ``uniform_``, ...) goes through DTensor's dispatch. That is what
torch's FSDP2 relies on, and what tandem's ``fully_shard`` gets too, by
construction the same values as torch's FSDP2 on the same device:

- on CUDA, DTensor's ``OffsetBasedRNGTracker`` starts each shard at its own
  offset of the Philox stream: the shards differ and the ranks' generators
  stay in step, but the full parameter is not what an unsharded init draws
  (CUDA's kernels do not number elements as one stream), and it changes with
  the world size;
- on CPU there is no tracker (the CPU generator cannot skip ahead), and each
  rank draws its shard from the start of the same stream: with one seed on
  every rank, the shards of a parameter hold the same numbers (rank 1's rows
  repeat rank 0's), and the full parameter is again not the unsharded draw.

Within ``init_like_unsharded()`` the sharded init equals the eager one bit for
bit, at every world size and on every device: an in-place random op on a
DTensor runs on a plain tensor of the parameter's full shape (same device and
dtype), which draws from the generator exactly what the eager init draws, and
each rank keeps its own piece. Every rank draws every parameter, so the
generators stay in step, as in an eager init on every rank. What it costs is
one parameter's full size, freed before the next op: the full model is never
allocated. Deterministic inits (``ones_``, ``zeros_``, ``constant_``) and
elementwise ops on the drawn values (``trunc_normal_``'s ``erfinv_``,
``mul_``, ``clamp_``) need nothing: they act on each element where it lives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from tandem._compat import TorchDispatchMode, dtensor_api, dtensor_local

__all__ = ["init_like_unsharded"]

_aten = torch.ops.aten

# The in-place random ops of torch.nn.init and of Tensor's sampling methods.
_RANDOM_INPLACE = {
    _aten.normal_.default, _aten.uniform_.default, _aten.bernoulli_.float, _aten.bernoulli_.Tensor,
    _aten.random_.default, getattr(_aten.random_, "from"), _aten.random_.to, _aten.exponential_.default,
    _aten.cauchy_.default, _aten.log_normal_.default, _aten.geometric_.default,
}


@contextlib.contextmanager
def init_like_unsharded() -> Iterator[None]:
    """Random initialisation of sharded (DTensor) parameters that draws what
    the unsharded model would, bit for bit, at every world size and on every
    device::

        with torch.device("meta"):
            model = GPT()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cuda")
        torch.manual_seed(0)                  # the same seed on every rank
        with tandem.fsdp.init_like_unsharded():
            model.init_weights()              # equal to GPT().init_weights() with seed 0

    Each random op draws the parameter's full shape, on every rank, and each
    rank keeps its own piece: the generators stay in step, and the memory it
    costs is one parameter's full size at a time. Works for torch's
    ``fully_shard`` too, and for any DTensor whose placements are ``Shard`` and
    ``Replicate``.

    Warning:
        Without it, random init of sharded parameters follows
        DTensor's rules, as in torch's FSDP2: on CPU every rank's shard repeats
        the same numbers. Set the same seed on every rank before it.

    Raises:
        NotImplementedError: a random op on a DTensor with another placement
            (``Partial``, a strided shard of a 2-D layout).
    """
    # Note [random init of shards] at the top of this file.
    with _UnshardedInit():
        yield


class _UnshardedInit(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        DTensor, _, _ = dtensor_api()
        if func not in _RANDOM_INPLACE or not isinstance(args[0], DTensor):
            return func(*args, **kwargs)
        target = args[0]
        local = dtensor_local(target)
        full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
        # A DTensor argument (bernoulli_'s probabilities) in full too: every rank gathers it, in the same order.
        func(full, *(a.full_tensor() if isinstance(a, DTensor) else a for a in args[1:]), **kwargs)
        local.copy_(_local_piece(full, target))
        return target


def _local_piece(full: torch.Tensor, target: Any) -> torch.Tensor:
    """This rank's part of ``full``, laid out as ``target``'s placements say
    (``torch.chunk``'s split, as DTensor's ``Shard``)."""
    _, Shard, Replicate = dtensor_api()
    mesh = target.device_mesh
    coordinate = mesh.get_coordinate()
    piece = full
    for mesh_dim, placement in enumerate(target.placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard:
            raise NotImplementedError(
                f"init_like_unsharded: a random op on a DTensor of shape {tuple(target.shape)} placed "
                f"{tuple(target.placements)}: only Shard and Replicate are supported; initialise "
                "the parameter before it is distributed this way")
        dim, parts = placement.dim, mesh.size(mesh_dim)
        size = piece.shape[dim]
        chunk = -(-size // parts)
        start = min(coordinate[mesh_dim] * chunk, size)
        piece = piece.narrow(dim, start, max(0, min(chunk, size - start)))
    return piece
