"""The memory planner: per-rank bytes of parameters, gradients and optimizer
state under ZeRO stages 0 to 3, before running anything.

Stage 0 is plain data parallelism (a full copy of everything on every rank);
stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the
parameters (Rajbhandari et al., 2020). Sharded sizes round up to whole
per-rank shards of each bucket, as the flat buffer does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.ddp.plan import ParamInfo, cap_bytes_from_mb, plan_buckets

__all__ = ["MemoryEstimate", "estimate_memory", "format_memory_table"]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at ZeRO ``stage``."""

    stage: int
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def estimate_memory(model: nn.Module, world_size: int, *, optimizer_bytes_per_param: int = 8,
                    bucket_cap_mb: float | None = None) -> list[MemoryEstimate]:
    """Per-rank memory of ``model``'s trainable parameters at stages 0, 1, 2 and 3.

    Args:
        model: the model (only its trainable parameters' sizes and dtypes are read).
        world_size: ranks the state would be sharded over.
        optimizer_bytes_per_param: optimizer state per parameter element; 8 is
            Adam's two fp32 moments, 4 is SGD with momentum, 0 plain SGD.
        bucket_cap_mb: DDP's bucket cap (buckets are what gets sharded).

    Returns:
        One estimate per stage. Activations and temporary buffers are not
        included; at stage 2 one bucket is counted in full as the staging area
        for the reduce-scatter.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    infos = [ParamInfo(n, p.numel(), p.dtype, p.device)
             for n, p in model.named_parameters() if p.requires_grad]
    if not infos:
        raise ValueError("the model has no trainable parameters")
    plan = plan_buckets(infos, list(reversed(range(len(infos)))), cap_bytes_from_mb(bucket_cap_mb),
                        pad_to=world_size)
    full = sum(b.nbytes for b in plan.buckets)
    shard = sum(b.nbytes // world_size for b in plan.buckets)
    per_elem = sum(b.padded_numel for b in plan.buckets)
    opt_full = per_elem * optimizer_bytes_per_param
    opt_shard = sum(b.padded_numel // world_size for b in plan.buckets) * optimizer_bytes_per_param
    staging = max(b.nbytes for b in plan.buckets)
    return [
        MemoryEstimate(0, params=full, grads=full, optimizer=opt_full),
        MemoryEstimate(1, params=full, grads=full, optimizer=opt_shard),
        MemoryEstimate(2, params=full, grads=shard + staging, optimizer=opt_shard),
        MemoryEstimate(3, params=shard, grads=shard + staging, optimizer=opt_shard),
    ]


def format_memory_table(estimates: list[MemoryEstimate], world_size: int) -> str:
    """A plain-text table of :func:`estimate_memory`'s result."""
    rows = [f"ZeRO memory per rank at world size {world_size} (parameters, gradients, optimizer state)",
            f"{'stage':>5}  {'params':>10}  {'grads':>10}  {'optimizer':>10}  {'total':>10}"]
    for e in estimates:
        rows.append(f"{e.stage:>5}  {_mib(e.params):>10}  {_mib(e.grads):>10}  "
                    f"{_mib(e.optimizer):>10}  {_mib(e.total):>10}")
    return "\n".join(rows)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
