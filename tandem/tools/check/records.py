"""What the two runs of ``tandem check`` observed: each rank's
:class:`RankRecord` and the one-process :class:`ReferenceRun`, the inputs of
:func:`tandem.tools.check.report.build_report`. Plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.fsdp.precision import PrecisionFinding

__all__ = ["RankRecord", "ReferenceRun"]


@dataclass(frozen=True)
class RankRecord:
    """What one rank saw in one strategy's run (the runner's output, input to :func:`build_report`)."""

    rank: int
    losses: tuple[float, ...]
    """Its loss on its own batch, per step."""
    sample_keys: tuple[tuple[bytes, ...], ...]
    """Per step, a fingerprint of each sample of its batch."""
    rng_state: bytes
    """A fingerprint of torch's generator after the model factory returned."""
    outputs: tuple[tuple[str, torch.Tensor], ...] = ()
    """Module outputs of step 1's forward, in the order they finished: the first that differs from
    the one-process run's names the likely cause of a divergence."""
    # Note [first divergence] in compare.py.
    snapshots: tuple[dict[str, torch.Tensor], ...] = ()
    """Rank 0 only: the full tensors after each step (0: initial)."""
    precision: tuple[PrecisionFinding, ...] = ()
    """fsdp: the precision audit of the units the run built (the same on every rank)."""
    # Note [precision of a unit] in tandem/fsdp/precision.py.


@dataclass(frozen=True)
class ReferenceRun:
    """The one-process run (:func:`build_report`'s other input)."""

    snapshots: tuple[dict[str, torch.Tensor], ...]
    buffers: tuple[str, ...]
    losses: tuple[float, ...]
    sample_keys: tuple[tuple[bytes, ...], ...]
    outputs: tuple[tuple[str, torch.Tensor], ...]
    param_dtypes: tuple[torch.dtype, ...]
    random_layers: tuple[str, ...]
    """Dropout modules turned off for the comparison: one process and N ranks cannot draw the same masks."""
    # Note [dropout] in run.py.
    draws_random: bool
    """The forward drew random numbers in training mode, dropout on."""
    draws_random_without_dropout: bool
    """... and still did with the dropout modules off."""
    module_types: dict[str, str] = field(default_factory=dict)
    loss_name: str = ""
    grad_max: tuple[dict[str, float], ...] = ()
    """Per step: each parameter's largest ``|grad|``, which finds the parameters whose gradient is only
    rounding noise."""
    # Note [rounding-noise gradients] in diagnose.py.
    adaptive: bool = False
    """The optimizer divides by a running gradient scale (anything but SGD and ASGD)."""
