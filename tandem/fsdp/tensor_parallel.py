"""Tensor-parallel parameters under fully_shard: the two DTensor layouts of a
parameter that is sharded over ``mesh["tp"]`` by torch's tensor parallelism
and over ``mesh["dp"]`` by fully_shard.

Note [2-D parameters]
~~~~~~~~~~~~~~~~~~~~~
After ``parallelize_module(block, mesh["tp"], plan)`` a weight is a DTensor over
the tensor-parallel mesh, and its local tensor is this rank's tensor-parallel
shard. ``fully_shard(block, mesh=mesh["dp"])`` treats that local tensor as the
"full" parameter of the data-parallel ranks, which all hold the same one
(Note [tensor-parallel parameters] in tandem/dtensor.py): its rows are
chunked on dim 0 across ``dp`` as a plain parameter's are, and the gathers and
reduce-scatters run over ``dp`` only. The parameter then has two forms:

- *unsharded* (registered for forward and backward): the gathered local
  tensor wrapped in the tensor-parallel DTensor it was, so the module's
  tensor-parallel forward runs as before;
- *sharded* (what the optimizer, ``clip_grad_norm_`` and state dicts see): a
  DTensor over the 2-D mesh of the ``dp`` and ``tp`` dimensions with
  placements ``(Shard(0), <tp placement>)``. When tensor parallelism also
  shards dim 0 (``ColwiseParallel``), this rank's rows are a dim-0 chunk of a
  dim-0 chunk taken over ``tp`` first; DTensor calls that ``_StridedShard(0,
  split_factor=tp)`` on the ``dp`` dimension (as torch's FSDP2 does), so that
  ``full_tensor()`` and distributed checkpoints put every row in its place.
  If the root mesh lists ``tp`` before ``dp``, the plain placements already
  mean tp first and no strided placement is needed.

Only 1-D tensor parallelism under a 1-D data-parallel mesh, both slices of one
root mesh, is supported; anything else is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tandem._compat import dtensor_api, dtensor_local, dtensor_with_spec, root_device_mesh, strided_shard

__all__ = ["TensorParallelParam", "tensor_parallel_param"]


@dataclass(frozen=True)
class TensorParallelParam:
    """How a fully_shard unit holds one tensor-parallel parameter (Note [2-D parameters])."""

    unsharded_spec: Any          # the parameter's DTensorSpec over mesh["tp"]
    sharded_mesh: Any            # the 2-D mesh of the dp and tp dimensions
    sharded_placements: tuple[Any, ...]
    local_shape: tuple[int, ...]  # this rank's tensor-parallel shard: what fully_shard shards

    def unsharded(self, local: torch.Tensor) -> torch.Tensor:
        """The gathered ``local`` (a tensor-parallel shard) as the DTensor forward uses."""
        return dtensor_with_spec(local, self.unsharded_spec)

    def local_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's tensor-parallel shard of the full (global) tensor ``full``
        (a view): what a full state dict's entry becomes before dim-0 chunking."""
        placement = self.unsharded_spec.placements[0]
        if placement.is_shard():
            mesh = self.unsharded_spec.mesh
            return full.chunk(mesh.size(), dim=placement.dim)[mesh.get_local_rank()]
        return full

    def sharded(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's dim-0 chunk ``local`` as a DTensor over the 2-D mesh."""
        DTensor, _, _ = dtensor_api()
        shape = self.unsharded_spec.shape
        with torch.no_grad():
            return DTensor.from_local(local, self.sharded_mesh, self.sharded_placements, run_check=False,
                                      shape=shape, stride=self.unsharded_spec.stride)


def tensor_parallel_param(fqn: str, param: torch.Tensor, dp_mesh: Any) -> TensorParallelParam | None:
    """The 2-D layout of ``param`` if it is a tensor-parallel DTensor over a
    sibling of ``dp_mesh`` (None for a plain parameter).

    Raises:
        NotImplementedError: ``param``'s mesh is not a 1-D slice of the root
            mesh ``dp_mesh`` comes from, or its placements are not Shard/Replicate.
    """
    DTensor, Shard, Replicate = dtensor_api()
    if not isinstance(param, DTensor):
        return None
    tp_mesh = param.device_mesh
    root = root_device_mesh(dp_mesh)
    names = root.mesh_dim_names or ()
    dp_name = (dp_mesh.mesh_dim_names or (None,))[0]
    tp_name = (tp_mesh.mesh_dim_names or (None,))[0]
    if (tp_mesh.ndim != 1 or root_device_mesh(tp_mesh) is not root or dp_name not in names
            or tp_name not in names or tp_name == dp_name):
        raise NotImplementedError(
            f"fully_shard: parameter '{fqn}' is a DTensor over {tp_mesh}, which is not a 1-D dimension of "
            f"the mesh that mesh={dp_mesh} comes from. Build one DeviceMesh with named dimensions "
            "(init_device_mesh(..., mesh_dim_names=('dp', 'tp'))), parallelise over mesh['tp'] and "
            "pass mesh=mesh['dp']")
    tp_placement = param.placements[0]
    if not isinstance(tp_placement, (Shard, Replicate)):
        raise NotImplementedError(f"fully_shard: parameter '{fqn}' has tensor-parallel placement "
                                  f"{tp_placement}; only Shard and Replicate are supported")
    dp_first = names.index(dp_name) < names.index(tp_name)
    order = (dp_name, tp_name) if dp_first else (tp_name, dp_name)
    mesh_2d = root if root.ndim == 2 else root[order]
    dp_placement: Any = Shard(0)
    if dp_first and isinstance(tp_placement, Shard) and tp_placement.dim == 0:
        dp_placement = strided_shard(0, tp_mesh.size())
    placements = (dp_placement, tp_placement) if dp_first else (tp_placement, dp_placement)
    return TensorParallelParam(unsharded_spec=param._spec, sharded_mesh=mesh_2d,  # type: ignore[attr-defined]
                               sharded_placements=placements,
                               local_shape=tuple(dtensor_local(param).shape))
