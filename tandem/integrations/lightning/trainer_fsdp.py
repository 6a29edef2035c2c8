"""``TandemFSDPStrategy``: the Trainer shards the LightningModule with
``tandem.fully_shard`` (FSDP2's API) and checkpoints it as sharded
torch.distributed.checkpoint (DCP) state.

It is Lightning's ``ModelParallelStrategy`` (FSDP2 through a user's
``configure_model``) with the sharding done by the strategy, as Lightning's
``FSDPStrategy`` does with its ``auto_wrap_policy``: each submodule of a class in
``auto_wrap_policy`` becomes a unit, bottom-up, and the LightningModule the root
unit. A ``configure_model`` that already shards (with ``tandem.fully_shard`` or
torch's) is left as it is. Saving and loading are ModelParallelStrategy's: a
directory of DCP files (one per rank, and ``meta.pt`` for the rest of Lightning's
checkpoint) that DCP reshards at load, so a run saved on N processes resumes on M.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers, _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from tandem.integrations.lightning.shard import LayerSharding, check_not_fsdp1, is_sharded

__all__ = ["TandemFSDPStrategy"]


class TandemFSDPStrategy(ModelParallelStrategy):
    """Shard the LightningModule over all processes with ``tandem.fully_shard``.

    Args:
        auto_wrap_policy: the layer classes each of whose instances becomes a unit
            (gathered before its forward and backward, freed after), as the set form of
            Lightning's ``FSDPStrategy(auto_wrap_policy={Block})``. Empty: the whole
            module is one unit.
        reshard_after_forward: FSDP2's: free a unit's gathered parameters after its
            forward (True), keep them for the backward (False), reshard to a smaller
            group (an int), or FSDP2's default (None: True but for the root unit).
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` (parameter and reduce dtypes).
        offload_policy: FSDP2's ``CPUOffloadPolicy``.
        save_distributed_checkpoint: True: each rank saves its shards (DCP, loads at
            any world size); False: rank 0 saves the full state in one file.
        process_group_backend: ``"gloo"``, ``"nccl"``; default by device.
        timeout: of the process group's collectives.
        fully_shard_kwargs: further arguments of ``tandem.fully_shard``
            (``shard_placement_fn``, ``min_unit_bytes``, ``comm_policy``).
    """

    strategy_name = "tandem_fsdp"

    def __init__(self, auto_wrap_policy: Iterable[type[nn.Module]] | type[nn.Module] = (), *,
                 reshard_after_forward: bool | int | None = None, mp_policy: Any = None,
                 offload_policy: Any = None, save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 **fully_shard_kwargs: Any) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._sharding = LayerSharding(auto_wrap_policy, {
            "reshard_after_forward": reshard_after_forward, "mp_policy": mp_policy,
            "offload_policy": offload_policy, **fully_shard_kwargs})

    def setup_environment(self) -> None:
        # Data parallel over every process: the mesh is (world, 1) where
        # ModelParallelStrategy's "auto" would make it (nodes, processes per node).
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def setup(self, trainer: pl.Trainer) -> None:
        """ModelParallelStrategy's setup, with the sharding done here when
        ``configure_model`` did not shard."""
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        check_not_fsdp1(self.model, type(self).__name__)
        if not is_sharded(self.model):
            if not _has_meta_device_parameters_or_buffers(self.model):
                self.model_to_device()  # shards are cut on the device they train on
            self._sharding(self.model, self.device_mesh)
        _materialize_distributed_module(self.model, self.root_device)  # a model built on the meta device
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
