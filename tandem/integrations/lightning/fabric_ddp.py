"""``TandemFabricDDPStrategy``: Lightning Fabric's ``DDPStrategy`` that wraps the
model given to ``fabric.setup`` in ``tandem.DistributedDataParallel``.

Fabric's launcher, process group, precision, ``fabric.clip_gradients`` and
``fabric.save``/``fabric.load`` stay Fabric's. The paths Fabric's strategy takes
only for torch's wrapper class are taken for tandem's: ``fabric.no_backward_sync``
enters the wrapper's ``no_sync()``, and the module's state dict is that of the
wrapped module (no ``module.`` prefix), so a checkpoint loads into a model
set up with any strategy.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import Tensor, nn

from tandem.ddp import DistributedDataParallel
from tandem.integrations.lightning.wrap import check_ddp_kwargs, wrap_ddp

__all__ = ["TandemFabricDDPStrategy"]


class TandemFabricDDPStrategy(DDPStrategy):
    """Fabric's ``DDPStrategy`` (same arguments) with ``tandem.DistributedDataParallel``
    as the wrapper; keyword arguments that Fabric does not take itself go to the
    wrapper::

        fabric = Fabric(accelerator="cpu", devices=2, strategy=TandemFabricDDPStrategy(bucket_cap_mb=10))
        fabric = Fabric(accelerator="cpu", devices=2, strategy="tandem_ddp")  # after importing this package
    """

    strategy_name = "tandem_ddp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_ddp_kwargs(self._ddp_kwargs)
        self._backward_sync_control = _TandemBackwardSyncControl()

    # Fabric annotates the result as torch's class; tandem's is the drop-in for it.
    def setup_module(self, module: nn.Module) -> DistributedDataParallel:  # type: ignore[override]
        return wrap_ddp(module, self._determine_ddp_device_ids(), self._ddp_kwargs)

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any | Tensor]:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        return super().get_module_state_dict(module)

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any | Tensor],
                               strict: bool = True) -> None:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        super().load_module_state_dict(module=module, state_dict=state_dict, strict=strict)


class _TandemBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the backward inside it accumulates
    gradients locally, through the wrapper's ``no_sync()``."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, DistributedDataParallel):
            raise TypeError(
                f"no_backward_sync needs the model set up by {TandemFabricDDPStrategy.__name__} (wrapped in "
                f"tandem.DistributedDataParallel), got {type(module).__name__}: pass the model fabric.setup returned")
        return module.no_sync()
