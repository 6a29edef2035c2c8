"""The DDP wrapper's fused step: an optimizer stepped inside backward, bucket by
bucket (Note [fused step] in fused.py); the third of the wrapper's layers
(module.py lists them)."""

from __future__ import annotations

from typing import Any

import torch

from tandem.ddp.fused import FusedOptimizer, check_fusable, patch_step, unpatch_step
from tandem.ddp.module_join import JoinSupport

__all__ = ["FusedStep"]


class FusedStep(JoinSupport):
    """The wrapper's third layer: ``fuse_optimizer`` and ``unfuse_optimizer``."""

    def fuse_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` inside backward, bucket by bucket, as soon as each
        bucket's averaged gradients have landed (Note [fused step] in fused.py).

        The training loop stays as it is: ``optimizer.step()`` becomes a no-op
        (the step already ran in the synchronised ``loss.backward()``), and
        ``zero_grad()``, ``state_dict()``, param groups and LR schedulers work on
        ``optimizer`` as before. After a fused step ``param.grad`` is None: the
        averaged gradients are not kept. Backwards under ``no_sync()`` accumulate
        as usual; the synchronised one that follows steps. Results equal the
        unfused ``optimizer.step()`` after backward.

        Args:
            optimizer: a ``torch.optim.Optimizer`` over this model's trainable
                parameters (any param groups), or, with ``zero_stage`` 1 or 2,
                the :class:`tandem.ZeroOptimizer` built on this model, whose
                shards then step as their reduce-scatters land.

        Raises:
            ValueError: the optimizer holds a tensor that is not a trainable
                parameter of this model, is LBFGS (it needs a closure), or, under
                ZeRO, is not the ZeroOptimizer of this model.
            TypeError: not a torch optimizer.

        .. warning:: what needs every gradient before the first update cannot
            run in a fused step: clipping by global norm, and fp16 loss scaling
            (``GradScaler`` unscales and checks all gradients before it steps).
            Use the unfused optimizer for those; with ``check_finite`` the fused
            step waits for every bucket and is dropped on every rank together.
        """
        optimizer = check_fusable(optimizer)
        if self._fused is not None:
            raise RuntimeError(f"an optimizer ({type(self._fused).__name__}) is already fused into this "
                               "DistributedDataParallel; call unfuse_optimizer() first")
        reducer = self._make_reducer()
        stepper: Any
        if self.zero_stage:
            # The ZeroOptimizer built on this model registered itself (tandem.zero
            # builds on this module, not the other way round) and makes its stepper.
            zero = self._zero_optimizer() if self._zero_optimizer is not None else None
            if zero is None or zero is not optimizer:
                raise ValueError(
                    f"fuse_optimizer under zero_stage={int(self.zero_stage)} needs the tandem.ZeroOptimizer "
                    f"built on this DistributedDataParallel, got {type(optimizer).__name__}: "
                    "ddp.fuse_optimizer(tandem.ZeroOptimizer(ddp, torch.optim.AdamW, lr=...))")
            stepper = zero.fused_stepper(reducer)
        else:
            stepper = FusedOptimizer(optimizer, reducer.params)
        reducer.set_stepper(stepper)
        patch_step(optimizer, "DistributedDataParallel.fuse_optimizer")
        self._fused = optimizer

    def unfuse_optimizer(self) -> None:
        """Undo :meth:`fuse_optimizer`: ``optimizer.step()`` steps again, after backward."""
        if self._fused is None:
            return
        assert self._reducer is not None
        self._reducer.set_stepper(None)
        unpatch_step(self._fused)
        self._fused = None

    @property
    def fused_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer that steps inside backward, or None."""
        return self._fused
