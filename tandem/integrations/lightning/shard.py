"""The sharding that tandem's fully_shard strategies (Trainer and Fabric) do in
place of a user's ``configure_model`` or ``parallelize_fn``: each submodule of a
class in ``auto_wrap_policy`` becomes a ``tandem.fully_shard`` unit, bottom-up,
and the module given the root unit, over the data-parallel dimension of
Lightning's device mesh. A module that is already sharded (by tandem's
``fully_shard`` or torch's) is left as it is."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel

from tandem.fsdp import FSDPModule, fully_shard

__all__ = ["LayerSharding", "check_not_fsdp1", "is_sharded"]


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` (tandem's or torch's) already ran on ``module`` or a submodule."""
    return any(isinstance(m, (FSDPModule, TorchFSDPModule)) for m in module.modules())


def check_not_fsdp1(module: nn.Module, strategy: str) -> None:
    """Refuse a module with torch's FSDP1 wrappers inside: FSDP2's API cannot shard it again."""
    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise TypeError(f"{strategy} shards with tandem.fully_shard (FSDP2's API); found modules "
                        "wrapped in torch's FSDP1 FullyShardedDataParallel: remove that wrapping")


class LayerSharding:
    """``tandem.fully_shard`` on each layer of the given classes, deepest first, then on the root.

    Called as ``sharding(module, device_mesh)``, the signature of Fabric's
    ``parallelize_fn``, with the strategy's 2-D mesh (``data_parallel``,
    ``tensor_parallel``); the units shard over its ``data_parallel`` dimension.

    Args:
        auto_wrap_policy: the layer classes each of whose instances becomes a unit; a
            class alone, or empty (the whole module one unit).
        fully_shard_kwargs: the keyword arguments of every ``tandem.fully_shard`` call
            (``reshard_after_forward``, ``mp_policy``, ``offload_policy``, ...).

    Raises:
        TypeError: ``auto_wrap_policy`` is not a set of ``nn.Module`` subclasses (FSDP1's
            policy functions are not taken).
    """

    def __init__(self, auto_wrap_policy: Iterable[type[nn.Module]] | type[nn.Module],
                 fully_shard_kwargs: dict[str, Any]) -> None:
        self.layers = _layer_classes(auto_wrap_policy)
        self.fully_shard_kwargs = dict(fully_shard_kwargs)

    def __call__(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if is_sharded(module):
            return module
        mesh = device_mesh["data_parallel"]
        # Deepest first: fully_shard takes the parameters that no earlier call took.
        layers = [m for m in module.modules() if m is not module and isinstance(m, self.layers)]
        for layer in reversed(layers):
            fully_shard(layer, mesh=mesh, **self.fully_shard_kwargs)
        fully_shard(module, mesh=mesh, **self.fully_shard_kwargs)
        return module


def _layer_classes(policy: Iterable[type[nn.Module]] | type[nn.Module]) -> tuple[type[nn.Module], ...]:
    classes = (policy,) if isinstance(policy, type) else policy
    if callable(classes) or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(f"auto_wrap_policy must be a set of nn.Module subclasses (the layers to shard), got "
                        f"{policy!r}; for a custom policy, shard the model yourself (the LightningModule's "
                        "configure_model, or Fabric's ModelParallelStrategy with a parallelize_fn)")
    return tuple(classes)
