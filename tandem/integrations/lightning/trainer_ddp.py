"""``TandemDDPStrategy``: Lightning's Trainer ``DDPStrategy`` that wraps the
LightningModule in ``tandem.DistributedDataParallel``.

Everything else is Lightning's own: the launcher (the script run once per
process, or spawned), the process group, the distributed sampler, precision
plugins, gradient clipping, callbacks, loggers and checkpoints (the wrapper's
parameters are the LightningModule's, so its state dict is unchanged).
Lightning's ``DDPStrategy`` takes some paths only for torch's wrapper class
(``isinstance(model, torch.nn.parallel.DistributedDataParallel)``); this class
takes them for tandem's:

- gradient accumulation: Lightning's ``block_backward_sync`` enters the
  wrapper's ``no_sync()`` for any wrapper that has one, tandem's included;
- manual optimization: the gradient sync is armed by ``manual_backward``
  (``pre_backward``) instead of by the forward, as Lightning does for torch's;
- communication hooks (``ddp_comm_hook``/``ddp_comm_state``/``ddp_comm_wrapper``):
  registered on every device type (Lightning registers them on CUDA only, where
  torch's DDP supports them; tandem's support them on CPU/gloo too);
- teardown gives the Trainer back the bare LightningModule.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from torch import Tensor, nn

from tandem.ddp import DistributedDataParallel
from tandem.integrations.lightning.wrap import check_ddp_kwargs, wrap_ddp

__all__ = ["TandemDDPStrategy"]


class TandemDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` (same arguments) with ``tandem.DistributedDataParallel``
    as the wrapper. Keyword arguments that Lightning does not take itself go to the
    wrapper, as with Lightning's strategy: torch's (``bucket_cap_mb``,
    ``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``,
    ``broadcast_buffers``) and tandem's (``check_finite``)::

        trainer = Trainer(accelerator="cpu", devices=2, strategy=TandemDDPStrategy(bucket_cap_mb=10))
        trainer = Trainer(accelerator="cpu", devices=2, strategy="tandem_ddp")  # after importing this package
    """

    strategy_name = "tandem_ddp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_ddp_kwargs(self._ddp_kwargs)
        self._forward_redirection = _TandemForwardRedirection()

    # Lightning annotates the result as torch's class; tandem's is the drop-in for it.
    def _setup_model(self, model: nn.Module) -> DistributedDataParallel:  # type: ignore[override]
        """Wrap the LightningModule in tandem's DDP (Lightning calls this when fitting)."""
        return wrap_ddp(model, self.determine_ddp_device_ids(), self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        if self._ddp_comm_hook is None and self._ddp_comm_wrapper is None:
            return
        assert isinstance(self.model, DistributedDataParallel)
        # Lightning's helper (it applies ddp_comm_wrapper), typed for torch's class; it calls register_comm_hook.
        _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,  # type: ignore[arg-type]
                                ddp_comm_hook=self._ddp_comm_hook, ddp_comm_wrapper=self._ddp_comm_wrapper)

    def pre_backward(self, closure_loss: Tensor) -> None:
        """Under manual optimization the forward left the gradient sync unarmed
        (:class:`_TandemForwardRedirection`): arm it for the backward of ``closure_loss``."""
        model, module = self.model, self.lightning_module
        if not isinstance(model, DistributedDataParallel) or module is None or module.automatic_optimization:
            return
        if torch.is_grad_enabled() and model.require_backward_grad_sync:
            model.require_forward_param_sync = True
            model.prepare_for_backward(closure_loss)
        else:
            model.require_forward_param_sync = False

    def teardown(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module  # the bare module, as Lightning does for torch's wrapper
        super().teardown()


class _TandemForwardRedirection(_ForwardRedirection):
    """Lightning's ``_DDPForwardRedirection`` for tandem's wrapper: under manual
    optimization, ``training_step`` runs through the wrapper's forward with the
    gradient sync off, so that the forward does not arm it; ``manual_backward``
    arms it (:meth:`TandemDDPStrategy.pre_backward`)."""

    def on_after_inner_forward(self, wrapper_module: nn.Module, original_module: LightningModule) -> None:
        if isinstance(wrapper_module, DistributedDataParallel) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = False

    def on_after_outer_forward(self, wrapper_module: nn.Module, original_module: LightningModule) -> None:
        if isinstance(wrapper_module, DistributedDataParallel) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = True
