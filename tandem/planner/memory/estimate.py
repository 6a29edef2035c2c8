"""What the memory planner is asked and what it answers: how ``fully_shard``
is applied (:class:`FullyShardSpec`), each unit it would build
(:class:`UnitEstimate`), the bytes one rank holds at a stage
(:class:`MemoryEstimate`), and what a step holds beside them
(:class:`StepActivity`). Plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.ddp.plan import BucketPlan
from tandem.fsdp.layout import DEFAULT_MIN_UNIT_BYTES, UnitLayout

__all__ = ["FullyShardSpec", "MemoryEstimate", "StepActivity", "UnitEstimate"]


@dataclass(frozen=True, kw_only=True)
class FullyShardSpec:
    """How ``tandem.fully_shard`` will be applied, for :func:`estimate_memory`'s stage 3."""

    units: tuple[str, ...] = ()
    """Submodules fully_shard is called on, by their names in ``named_modules()``
    (``("layers.0", "layers.1")``); the root ``""`` is always a unit, and the
    calls are taken bottom-up, as fully_shard requires."""
    param_dtype: torch.dtype | None = None
    """``MixedPrecisionPolicy.param_dtype``: the dtype units are gathered and
    computed in (None: the parameters' own)."""
    reduce_dtype: torch.dtype | None = None
    """``MixedPrecisionPolicy.reduce_dtype`` (None: ``param_dtype``)."""
    reshard_after_forward: bool = True
    """fully_shard's argument for the units in ``units``; the root keeps its
    parameters from forward to backward either way."""
    min_unit_bytes: int = DEFAULT_MIN_UNIT_BYTES  # Note [tiny units] in tandem/fsdp/api.py
    """fully_shard's ``min_unit_bytes``: smaller units join the unit of an
    enclosing call."""
    cpu_offload: bool = False  # Note [stage 3 memory] in fully_shard.py
    """``offload_policy=CPUOffloadPolicy()``: the shards, their gradients and the
    optimizer state live on the host; the device holds what a step gathers and
    reduces."""

    def __post_init__(self) -> None:
        units = (self.units,) if isinstance(self.units, str) else self.units
        if not all(isinstance(u, str) for u in units):
            raise ValueError(f"FullyShardSpec.units must be module names (str), got {self.units!r}")
        object.__setattr__(self, "units", tuple(units))
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"FullyShardSpec.{name} must be a floating torch.dtype or None, got {value!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"FullyShardSpec.reshard_after_forward must be a bool, got "
                             f"{self.reshard_after_forward!r} (partial resharding to k ranks is not planned)")
        if not isinstance(self.min_unit_bytes, int) or self.min_unit_bytes < 0:
            raise ValueError(f"FullyShardSpec.min_unit_bytes must be an int >= 0, got {self.min_unit_bytes!r}")
        if not isinstance(self.cpu_offload, bool):
            raise ValueError(f"FullyShardSpec.cpu_offload must be a bool, got {self.cpu_offload!r}")


@dataclass(frozen=True, kw_only=True)
class StepActivity:
    """What one training step holds beside the model's state, from one rank's
    batch (``tandem plan`` measures it: tandem/tools/plan/measure.py), for
    fully_shard's peak over the phases of a step (Note [stage 3 peak] in
    fully_shard.py). Bytes, in the dtype the step computes in."""

    before: int
    """Activations saved before the first block ran (the embeddings'): alive until the end of backward."""
    after: int
    """Activations saved outside the blocks after the first one ran (the head's and the loss's)."""
    blocks: tuple[tuple[str, int, int], ...]
    """``(module name, saved, inputs)`` of each block in forward order: the
    activations saved while it ran, and its tensor inputs (what checkpointing keeps)."""
    outputs: int = 0
    """The model's outputs, not saved by the loss: held through backward as a training loop holds them."""
    loss: int = 0
    """The most the loss's forward and backward hold at once beyond what it saves (its gradients)."""
    head_grads: int = 0
    """Gradients of parameters outside the blocks that backward computes before the first block's (the head's)."""
    checkpointed: bool = False
    """Each block checkpointed: it keeps its inputs, and its backward first recomputes its forward."""


@dataclass(frozen=True)
class UnitEstimate:
    """One unit fully_shard would build (stage 3 of :func:`estimate_memory`)."""

    name: str                     # the module fully_shard is called on ("": the root)
    merged: tuple[str, ...]       # tiny units that joined it (Note [tiny units] in tandem/fsdp/api.py)
    layout: UnitLayout            # rank 0's buffers
    dtype: torch.dtype            # the parameters' dtype: shards, sharded gradients
    trainable: tuple[bool, ...]   # requires_grad of each parameter, in layout order


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at ZeRO ``stage``; activations are not included."""

    # The formulas: Notes [stages 0 to 2 memory] in buckets.py and [stage 3 memory] in fully_shard.py.

    stage: int
    params: int
    grads: int
    optimizer: int
    state: int = 0                                          # optimizer state alone, without master copies
    buddy: int = 0                                          # elastic: buddy copy and kept shard (Note [one step back])
    rows: int = 0                                           # stages 1-2: this rank's rows of the parameters
    host: int = 0                                           # stage 3 under CPUOffloadPolicy: held on the host
    gathered: int = 0                                       # parameters gathered (stages 1-3)
    reducing: int = 0                                       # gradients being reduced in backward
    units: tuple[UnitEstimate, ...] = field(default=(), repr=False)   # stage 3: the units planned
    buckets: BucketPlan | None = field(default=None, repr=False)      # stages 0-2: DDP's buckets

    @property
    def steady(self) -> int:
        """What is held between steps: parameters, gradients, optimizer state (and,
        in an elastic job under ZeRO or fully_shard, the copy of the previous
        rank's shard and this rank's own shard as it was before the last step)."""
        # Notes [buddy copies] and [one step back] in tandem/elastic/buddy.py.
        return self.params + self.grads + self.optimizer + self.buddy

    @property
    def total(self) -> int:
        """The steady state plus the transient peaks: at stage 3 both (an upper
        bound), at stages 0-2 the larger (they are never alive together)."""
        if self.stage == 3:
            return self.steady + self.gathered + self.reducing
        return self.steady + max(self.gathered, self.reducing)

    def peak(self, activations: int) -> int:
        """:attr:`total` with ``activations`` bytes alive from forward through
        backward (with backward's transients; at stage 3 with everything)."""
        if self.stage == 3:
            return self.total + activations
        return self.steady + max(self.gathered, self.reducing + activations)
