"""``TandemFabricFSDPStrategy``: Fabric shards the model given to ``fabric.setup``
with ``tandem.fully_shard`` (FSDP2's API) and saves it as sharded
torch.distributed.checkpoint (DCP) state.

It is Fabric's ``ModelParallelStrategy`` (FSDP2 through a ``parallelize_fn``) with
the ``parallelize_fn`` written by the strategy: the sharding of
``TandemFSDPStrategy`` (shard.py), each submodule of a class in
``auto_wrap_policy`` a unit, bottom-up, and the model the root unit. A model
that is already sharded when it reaches ``fabric.setup`` is left as it is.
Fabric's launcher, precision, ``fabric.clip_gradients`` and
``fabric.save``/``fabric.load`` stay Fabric's: a checkpoint is a directory of DCP
files (one per rank, and ``meta.pt`` for the rest of the state) that DCP
reshards at load, so a run saved on N processes resumes on M.
``fabric.no_backward_sync`` turns off the gradient sync of tandem's units
(Fabric's own control knows torch's only).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from tandem.fsdp import FSDPModule
from tandem.integrations.lightning.shard import LayerSharding

__all__ = ["TandemFabricFSDPStrategy"]


class TandemFabricFSDPStrategy(ModelParallelStrategy):
    """Shard the model of ``fabric.setup`` over all processes with ``tandem.fully_shard``::

        strategy = TandemFabricFSDPStrategy(auto_wrap_policy={nn.TransformerEncoderLayer})
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric = Fabric(accelerator="cpu", devices=2, strategy="tandem_fsdp")  # after importing this package

    Create the optimizer after ``model = fabric.setup_module(model)``, from the
    sharded parameters, and then ``fabric.setup_optimizers(optimizer)``: sharding
    replaces the parameters, as with Fabric's FSDP strategies.

    The arguments are those of the Trainer's :class:`TandemFSDPStrategy`, with the same
    meaning: ``auto_wrap_policy`` (the set of layer classes whose instances become
    units), ``reshard_after_forward``, ``mp_policy``, ``offload_policy``,
    ``save_distributed_checkpoint`` (True: DCP, one file per rank, loads at any world
    size), ``process_group_backend``, ``timeout``, and further keyword arguments of
    ``tandem.fully_shard``.

    Raises:
        TypeError: ``auto_wrap_policy`` is not a set of ``nn.Module`` subclasses.
    """

    strategy_name = "tandem_fsdp"

    def __init__(self, auto_wrap_policy: Iterable[type[nn.Module]] | type[nn.Module] = (), *,
                 reshard_after_forward: bool | int | None = None, mp_policy: Any = None,
                 offload_policy: Any = None, save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 **fully_shard_kwargs: Any) -> None:
        sharding = LayerSharding(auto_wrap_policy, {
            "reshard_after_forward": reshard_after_forward, "mp_policy": mp_policy,
            "offload_policy": offload_policy, **fully_shard_kwargs})
        super().__init__(parallelize_fn=sharding, save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._sharding = sharding
        self._backward_sync_control = _TandemFSDPBackwardSyncControl()

    def setup_environment(self) -> None:
        # Data parallel over every process: the mesh is (world, 1) where
        # ModelParallelStrategy's "auto" would make it (nodes, processes per node).
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()


class _TandemFSDPBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the backward inside it accumulates full
    gradients locally in every unit (tandem's or torch's), and the first backward
    after it reduces their sum."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        units = [m for m in module.modules() if isinstance(m, (FSDPModule, TorchFSDPModule))]
        if not units:
            raise TypeError(f"no_backward_sync needs the model set up by {TandemFabricFSDPStrategy.__name__} "
                            f"(sharded by fully_shard), got {type(module).__name__}: pass the model "
                            "fabric.setup_module returned")
        return _NoGradientSync(units)


class _NoGradientSync(AbstractContextManager):
    def __init__(self, units: list[Any]) -> None:
        self._units = units

    def __enter__(self) -> None:
        for unit in self._units:
            unit.set_requires_gradient_sync(False, recurse=False)

    def __exit__(self, *exc_info: object) -> None:
        for unit in self._units:
            unit.set_requires_gradient_sync(True, recurse=False)
