"""The plain types of a fully_shard unit: its states (one enum per dimension),
a parameter in both forms (:class:`ManagedParam`: the sharded DTensor and the
unsharded view), its configuration and communication overrides, and the
collectives in flight. :class:`tandem.fsdp.unit.ShardedUnit` (unit.py) and its
:class:`~tandem.fsdp.unit_params.UnitParams` (unit_params.py) use them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch
from torch import nn

from tandem.comm.group import Work
from tandem.quantized.collectives import QuantizedWork
from tandem.fsdp.comm_policy import QuantizedCommPolicy
from tandem.fsdp.layout import ParamShard
from tandem.fsdp.tensor_parallel import TensorParallelParam

__all__ = ["CommOverrides", "ManagedParam", "PendingGather", "PendingReduce", "ReduceState", "ShardState",
           "UnitConfig", "UnitPhase"]


class ShardState(Enum):
    SHARDED = auto()        # only this rank's shard exists; sharded parameters registered
    GATHERING = auto()      # all-gather launched, not yet waited on
    UNSHARDED = auto()      # full parameters in the unsharded buffer, registered on the modules
    GROUP_SHARDED = auto()  # reshard_after_forward=k: a 1/k slice of the full buffer kept


class ReduceState(Enum):
    IDLE = auto()        # no reduction pending in this backward
    READY = auto()          # every gradient of this backward arrived (or backward ended)
    IN_FLIGHT = auto()      # reduce-scatter launched, not yet finished
    ALL_REDUCING = auto()   # HSDP: the shard's all-reduce over the replicate group launched


class UnitPhase(Enum):
    """Where a unit is in its iteration (not torch's ``module.training``, nor tandem's TrainingState)."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()   # its backward has started (a forward now is a recomputation)


@dataclass
class ManagedParam:
    """One parameter of a unit, in both of its forms."""

    fqn: str                               # name under the module given to fully_shard
    owners: list[tuple[nn.Module, str]]    # (module, attribute) holding it; tied: several
    spec: ParamShard
    sharded: nn.Parameter                  # DTensor, Shard(0): a view of the shard buffer
    unsharded: nn.Parameter                # a view of the unsharded buffer
    requires_grad: bool
    tp: TensorParallelParam | None = None  # Note [2-D parameters] in tensor_parallel.py
    # Gradients of backwards without sync, kept in reduce_dtype (Note [accumulation dtype] in unit.py).
    accumulated: torch.Tensor | None = None


@dataclass(frozen=True)
class UnitConfig:
    """How one unit gathers, reduces and keeps its parameters (fully_shard's arguments)."""

    device: torch.device                # where forward and the collectives run
    shard_device: torch.device          # where the shards live (CPU with CPUOffloadPolicy)
    param_dtype: torch.dtype | None     # MixedPrecisionPolicy.param_dtype
    reduce_dtype: torch.dtype | None    # MixedPrecisionPolicy.reduce_dtype
    pin_memory: bool                    # pin the offloaded shards (CUDA only)
    cast_forward_inputs: bool = True    # MixedPrecisionPolicy.cast_forward_inputs
    output_dtype: torch.dtype | None = None  # MixedPrecisionPolicy.output_dtype
    comm_policy: QuantizedCommPolicy | None = None  # Note [quantized units] in comm_policy.py


@dataclass
class CommOverrides:
    """What FSDPModule's setters change in a unit's collectives (torch's FSDP2 names)."""

    all_gather: Any = None         # set_custom_all_gather: torch's AllGather (allocate, __call__)
    reduce_scatter: Any = None     # set_custom_reduce_scatter: torch's ReduceScatter
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None  # set_all_reduce_hook
    force_sum: bool = False        # set_force_sum_reduction_for_comms: the hook sees sums, not means
    gather_after: Any = None       # set_post_optim_event: the root's next gathers wait for it, once


@dataclass
class PendingGather:
    """An all-gather in flight (unit.py)."""

    work: Work | QuantizedWork
    output: torch.Tensor
    input: torch.Tensor     # kept alive until the collective completes
    direct: bool            # the output is parameter-major already (one plain copy)


@dataclass
class PendingReduce:
    """A reduction stage in flight (unit.py)."""

    work: Work | QuantizedWork
    output: torch.Tensor
    input: torch.Tensor
    # output is this rank's chunk of input (Note [reduce-scatter in place] in unit.py)
    output_in_input: bool = False
