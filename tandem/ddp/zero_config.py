"""ZeRO's modes and options: which state is sharded, and what overlaps with what.

In ddp/, below tandem.zero: the DDP wrapper takes a stage and these options
(its reducer reduce-scatters instead of all-reducing), and the ZeRO optimizer
(tandem.zero, a layer above) builds on that wrapper. ``tandem.zero`` exports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

__all__ = ["ZeroConfig", "ZeroStage"]


class ZeroStage(IntEnum):
    """What each rank keeps only a shard of (Rajbhandari et al., 2020)."""

    NONE = 0             # plain data parallelism: gradients all-reduced
    OPTIMIZER = 1        # optimizer state sharded; gradients reduce-scattered
    GRADIENTS = 2        # also: param.grad released after the reduce-scatter

    @classmethod
    def parse(cls, value: int | ZeroStage) -> ZeroStage:
        try:
            return cls(int(value))
        except (TypeError, ValueError):
            raise ValueError(f"zero_stage must be 0, 1 or 2, got {value!r}") from None


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """Overlap options of ZeRO stages 1 and 2 (``zero_config=`` of
    :class:`tandem.DistributedDataParallel`)."""

    overlap_grad_reduce: bool = True
    """Launch each bucket's reduce-scatter during backward as soon as the bucket
    is complete (False: all at the end of backward, in bucket order)."""
    overlap_param_gather: bool = False
    """Let ``ZeroOptimizer.step()`` return with the parameter all-gathers in
    flight; the next forward waits for each bucket just before a module that
    uses it runs (forward pre-hooks)."""

    def __post_init__(self) -> None:
        for name in ("overlap_grad_reduce", "overlap_param_gather"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"ZeroConfig.{name} must be a bool, got {value!r}")
