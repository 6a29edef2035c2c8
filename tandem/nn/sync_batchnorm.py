"""``tandem.SyncBatchNorm``: batch norm over the global batch of a process group,
on any device (torch's needs CUDA), and its converter."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from tandem.comm.group import GroupComm
from tandem.nn.functional import sync_batch_norm

__all__ = ["SyncBatchNorm"]

logger = logging.getLogger(__name__)

# What convert_sync_batchnorm replaces. Lazy layers are refused until materialised
# (their first forward turns them into BatchNorm*d).
_CONVERTIBLE = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_LAZY = (nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d)
_BatchNormLayer = nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d | nn.SyncBatchNorm


class SyncBatchNorm(nn.SyncBatchNorm):
    """Batch normalisation whose training statistics cover every rank of a process
    group: a drop-in for :class:`torch.nn.SyncBatchNorm` that also runs on CPU
    (gloo) and accepts ranks with different batch sizes, including empty ones.

    In training mode each forward issues one all-reduce (per-channel sums and
    the sample count) and each backward one more (the two gradient sums), so
    outputs, input gradients and running statistics equal those of
    :class:`torch.nn.BatchNorm2d` (or 1d/3d) on the concatenation of all ranks'
    batches. Weight and bias gradients are each rank's share; the average DDP
    takes over ranks is the global gradient divided by the world size, as with
    torch's SyncBatchNorm. In eval mode, without a process group, or in a group
    of one, it is exactly :func:`torch.nn.functional.batch_norm`.

    Warning:
        Every rank of the group must run every training-mode forward and backward
        of this layer, even a rank with an empty batch (shape ``(0, C, ...)``):
        the collectives are matched across ranks. The ranks together must hold at
        least 2 values per channel, or every rank raises ``ValueError``. One
        replica per process: not inside :class:`tandem.DataParallel`, whose
        replicas would issue the collectives from several threads.

    Args are torch's: ``num_features`` (C of an ``(N, C, *)`` input), ``eps``,
    ``momentum`` (``None`` for a cumulative average), ``affine``,
    ``track_running_stats``, ``process_group`` (default: the world),
    ``device``, ``dtype`` and ``bias``.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: dist.ProcessGroup | None = None, device: Any = None,
                 dtype: torch.dtype | None = None, *, bias: bool = True) -> None:
        # torch < 2.5 has no ``bias`` argument: drop the parameter ourselves.
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         process_group, device, dtype)
        if not bias:  # nn.Module takes None for a registered parameter; torch's stub does not
            self.bias = None  # type: ignore[assignment]
        self._comm: GroupComm | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The GroupComm is bound to this process (its ledger and monitors): a copy
        # (deepcopy, torch.save) builds its own on first use, as torch's layer
        # holds only the process group.
        state: dict[str, Any] = super().__getstate__()
        state["_comm"] = None
        return state

    @property
    def comm(self) -> GroupComm:
        """The collectives of ``process_group`` (observable through ``comm.observers``)."""
        if self._comm is None or self._comm.group is not self.process_group:
            self._comm = GroupComm(self.process_group)
        return self._comm

    def _check_input(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expected an (N, C, *) input, got {input.dim()}D input "
                             f"of shape {tuple(input.shape)}")
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got an input with "
                             f"{input.shape[1]} channels (shape {tuple(input.shape)})")

    def _needs_sync(self) -> bool:
        return (self.training and dist.is_available() and dist.is_initialized()
                and self.comm.size > 1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            assert self.num_batches_tracked is not None  # registered with track_running_stats
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        # Batch statistics in training, and in eval when there are no running ones.
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        if not self._needs_sync():
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                use_batch_stats, factor, self.eps)
        return sync_batch_norm(input, self.weight, self.bias, running_mean, running_var,
                               momentum=factor, eps=self.eps, comm=self.comm)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module,
                               process_group: dist.ProcessGroup | None = None) -> nn.Module:
        """Replace every ``BatchNorm1d/2d/3d`` (and ``torch.nn.SyncBatchNorm``) in
        ``module`` with a :class:`SyncBatchNorm` over ``process_group``.

        The new layers hold the very same weight and bias ``Parameter`` objects
        (so ``requires_grad`` and an optimizer built earlier still apply) and the
        same buffers, and keep each layer's training mode, so the state_dict is
        unchanged. Call it before wrapping the model in DDP.

        Returns:
            ``module`` with its layers replaced in place, or a new layer when
            ``module`` itself is a batch norm layer.

        Raises:
            ValueError: a lazy batch norm layer that has not run yet (its
                parameters have no shape): run one forward first.
        """
        replaced: list[str] = []
        converted = _convert(cls, module, process_group, "", replaced)
        logger.info("convert_sync_batchnorm: %d batch norm layers now synchronise over %s",
                    len(replaced), "the default group" if process_group is None else "the given group")
        return converted


def _convert(cls: type[SyncBatchNorm], module: nn.Module, group: dist.ProcessGroup | None,
             prefix: str, replaced: list[str]) -> nn.Module:
    if isinstance(module, _LAZY):
        raise ValueError(f"convert_sync_batchnorm: '{prefix or type(module).__name__}' is a lazy "
                         "batch norm that has not been materialised yet; run one forward first")
    converted = module
    if isinstance(module, _CONVERTIBLE):
        converted = _from_batchnorm(cls, module, group)
        replaced.append(prefix.rstrip("."))
    for name, child in module.named_children():
        converted.add_module(name, _convert(cls, child, group, f"{prefix}{name}.", replaced))
    return converted


def _from_batchnorm(cls: type[SyncBatchNorm], bn: _BatchNormLayer,
                    group: dist.ProcessGroup | None) -> SyncBatchNorm:
    # Built on the meta device: every tensor it would allocate is replaced below.
    new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
              group, device="meta", bias=bn.bias is not None)
    new.weight, new.bias = bn.weight, bn.bias
    new.running_mean, new.running_var = bn.running_mean, bn.running_var
    new.num_batches_tracked = bn.num_batches_tracked
    new.train(bn.training)
    if hasattr(bn, "qconfig"):
        new.qconfig = bn.qconfig
    return new
