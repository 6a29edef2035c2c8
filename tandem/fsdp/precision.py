"""The precision audit of a fully_shard unit (pure): where its gradients or its
optimizer state would be held or reduced in a lower precision than its
``MixedPrecisionPolicy`` says. :func:`audit_precision` takes plain data (the
unit's name, its trainable parameters' names, their dtype and the policy's
dtypes) and returns :class:`PrecisionFinding` s; :func:`unit_findings` reads
them off a built unit; ``fully_shard`` warns with :func:`warn_precision` and
``tandem check`` lists every finding in its report.

# Note [precision of a unit]
As in torch's FSDP2, a unit's parameters have one dtype, the *held* dtype
(``orig``: the model's dtype when ``fully_shard`` was called). The shards, their
``.grad`` and the optimizer state built over them are in the held dtype; the
all-gather, forward and backward run in ``param_dtype`` (None: held); gradients
are reduced in ``reduce_dtype`` (None: ``param_dtype``), and the gradients of
backwards without sync (``set_requires_gradient_sync(False)``) accumulate in it
(Note [accumulation dtype] in unit.py); the reduced gradient is then cast
to the held dtype; ``output_dtype`` casts the unit's forward outputs. What the
optimizer sees is therefore never more precise than the held dtype, whatever
the policy says.

Two levels. A WARNING (``fully_shard`` warns, ``tandem check`` lists it) where
the optimizer ends up with less precision than the policy asks for, explicitly
or through a default that is a known pitfall:

- ``reduce_dtype`` wider than the held dtype (a model cast with
  ``.to(torch.bfloat16)`` before ``fully_shard``, reduced in float32): the
  float32 sum is rounded to bfloat16 in ``.grad``, and the optimizer keeps its
  state and applies its updates in bfloat16, where an update below 1/256 of a
  weight is lost. Fix: keep the model float32 and set ``param_dtype``.
- ``param_dtype`` below the held dtype with ``reduce_dtype`` left None: the
  gradients are reduced, and accumulated without sync, in ``param_dtype`` (the
  classic pitfall). Fix: ``reduce_dtype=torch.float32``; passing
  ``reduce_dtype=param_dtype`` keeps the low-precision reduction on purpose and
  turns this into a note.

A NOTE (``tandem check`` lists it, ``fully_shard`` stays silent) where the
precision is what the policy states but worth knowing: an explicit
``reduce_dtype`` below ``param_dtype`` or below the held dtype, a held dtype
below float32 with nothing wider in the policy (pure low-precision training),
``output_dtype`` below ``param_dtype``, and float16 anywhere (its gradients
overflow without loss scaling). "Below" compares mantissa precision
(``torch.finfo(dtype).eps``); only floating dtypes are audited, and a unit
without trainable parameters has nothing to audit.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import Protocol

import torch

__all__ = ["PrecisionFinding", "PrecisionIssue", "PrecisionLevel", "audit_precision", "unit_findings",
           "warn_precision"]


class PrecisionLevel(Enum):
    WARNING = auto()  # less precision than the policy asks for: fully_shard warns
    NOTE = auto()     # as the policy says, worth knowing: listed by tandem check only


class PrecisionIssue(Enum):
    REDUCED_THEN_ROUNDED = auto()      # reduce_dtype wider than the held dtype
    REDUCE_DEFAULTS_TO_PARAM = auto()  # param_dtype below held, reduce_dtype None
    REDUCE_BELOW_PARAM = auto()        # explicit reduce_dtype below param_dtype
    REDUCE_BELOW_HELD = auto()         # explicit reduce_dtype below the held dtype (not below param_dtype)
    LOW_PRECISION_MODEL = auto()       # held below float32, nothing wider in the policy
    OUTPUT_BELOW_PARAM = auto()        # output_dtype below param_dtype
    FLOAT16 = auto()                   # float16 anywhere: needs loss scaling

    @property
    def level(self) -> PrecisionLevel:
        warning = (PrecisionIssue.REDUCED_THEN_ROUNDED, PrecisionIssue.REDUCE_DEFAULTS_TO_PARAM)
        return PrecisionLevel.WARNING if self in warning else PrecisionLevel.NOTE


@dataclass(frozen=True, kw_only=True)
class PrecisionFinding:
    """One thing the audit found in one unit (Note [precision of a unit])."""

    issue: PrecisionIssue
    unit: str
    """The unit's name (its modules' class names, as fully_shard names it)."""
    params: tuple[str, ...]
    """Its trainable parameters, by name under the module given to fully_shard."""
    what: str
    """What happens to the gradients or the optimizer state, with the dtypes."""
    why: str
    """Why it matters."""
    fix: str
    """What to change."""

    @property
    def level(self) -> PrecisionLevel:
        return self.issue.level

    @property
    def where(self) -> str:
        shown = ", ".join(f"'{p}'" for p in self.params[:3])
        more = f", ... ({len(self.params)} in all)" if len(self.params) > 3 else ""
        return f"fully_shard unit '{self.unit}' (parameters {shown}{more})"

    def describe(self) -> str:
        """One line: where, what, why, fix."""
        return f"{self.where}: {self.what}; {self.why}. Fix: {self.fix}"


def audit_precision(unit: str, params: Sequence[str], held: torch.dtype, *, param_dtype: torch.dtype | None = None,
                    reduce_dtype: torch.dtype | None = None,
                    output_dtype: torch.dtype | None = None) -> list[PrecisionFinding]:
    """The findings for one unit (Note [precision of a unit]), warnings first.

    Args:
        unit: the unit's name, for the findings.
        params: the names of its trainable parameters (none: nothing to audit).
        held: the parameters' dtype when the unit was built (``orig``).
        param_dtype, reduce_dtype, output_dtype: the ``MixedPrecisionPolicy``'s,
            None where the policy leaves them None.

    Returns:
        A list of :class:`PrecisionFinding`, empty when the policy is kept.
    """
    dtypes = [d for d in (held, param_dtype, reduce_dtype, output_dtype) if d is not None]
    if not params or not all(d.is_floating_point for d in dtypes):
        return []
    compute = param_dtype or held
    reduce = reduce_dtype or compute
    found: list[tuple[PrecisionIssue, str, str, str]] = []
    if _below(held, reduce):
        source = "" if reduce_dtype is not None else " (from param_dtype)"
        keep = (f"param_dtype={_torch(compute)} still gathers and computes in {_name(compute)}"
                if param_dtype is not None else f"add param_dtype={_torch(held)} to keep computing in {_name(held)}")
        found.append((
            PrecisionIssue.REDUCED_THEN_ROUNDED,
            f"gradients are reduced in {_name(reduce)}{source}, then rounded to {_name(held)}, the parameters' "
            f"dtype, for the sharded .grad, and the optimizer state (Adam's moments) is held in {_name(held)}: "
            f"less than the {_name(reduce)} the policy asks for",
            _lost_updates(held),
            f"keep the model in {_name(reduce)} (do not cast it to {_name(held)} before fully_shard); {keep}"))
    if reduce_dtype is None and _below(compute, held):
        found.append((
            PrecisionIssue.REDUCE_DEFAULTS_TO_PARAM,
            f"gradients are reduced, and accumulated across backwards without sync, in {_name(compute)}: "
            f"reduce_dtype is None, so it defaults to param_dtype={_torch(compute)}, below the parameters' "
            f"{_name(held)}",
            _rounded_sum(compute),
            f"pass reduce_dtype={_torch(held)} to the MixedPrecisionPolicy (or reduce_dtype={_torch(compute)} "
            "to reduce in it on purpose, half the bytes)"))
    if reduce_dtype is not None and _below(reduce, compute):
        found.append((
            PrecisionIssue.REDUCE_BELOW_PARAM,
            f"gradients are computed in {_name(compute)} but reduced, and accumulated across backwards without "
            f"sync, in {_name(reduce)}, as reduce_dtype={_torch(reduce)} says",
            _rounded_sum(reduce),
            f"reduce_dtype={_torch(compute)} or wider, if the halved reduce-scatter bytes are not the point"))
    elif reduce_dtype is not None and _below(reduce, held):
        found.append((
            PrecisionIssue.REDUCE_BELOW_HELD,
            f"gradients are reduced, and accumulated across backwards without sync, in {_name(reduce)}, "
            f"below the parameters' {_name(held)}, as reduce_dtype={_torch(reduce)} says",
            _rounded_sum(reduce),
            f"reduce_dtype={_torch(held)}, if the halved reduce-scatter bytes are not the point"))
    if _below(held, torch.float32) and not _below(held, reduce):
        found.append((
            PrecisionIssue.LOW_PRECISION_MODEL,
            f"the parameters are {_name(held)}, so their gradients and the optimizer state are {_name(held)} too "
            "(pure low-precision training)",
            _lost_updates(held),
            f"if mixed precision was meant, keep the model in float32 and pass MixedPrecisionPolicy("
            f"param_dtype={_torch(held)}, reduce_dtype=torch.float32)"))
    if output_dtype is not None and _below(output_dtype, compute):
        found.append((
            PrecisionIssue.OUTPUT_BELOW_PARAM,
            f"the unit's outputs are cast to {_name(output_dtype)} from the {_name(compute)} it computes in, "
            f"and the gradients flowing back into it arrive in {_name(output_dtype)}",
            f"the next module and this unit's backward see {_bits(output_dtype)} significant bits, not "
            f"{_bits(compute)}",
            f"output_dtype={_torch(compute)} or None"))
    if torch.float16 in (held, compute, reduce):
        found.append((
            PrecisionIssue.FLOAT16,
            "gradients are float16 (computed, reduced or held)",
            "float16 overflows above 65504 and flushes small gradients to zero unless the loss is scaled",
            "scale the loss (torch.amp.GradScaler), or use torch.bfloat16"))
    return [PrecisionFinding(issue=issue, unit=unit, params=tuple(params), what=what, why=why, fix=fix)
            for issue, what, why, fix in sorted(found, key=lambda f: f[0].level.value)]


class _Managed(Protocol):
    @property
    def fqn(self) -> str: ...
    @property
    def requires_grad(self) -> bool: ...


class _Config(Protocol):
    @property
    def param_dtype(self) -> torch.dtype | None: ...
    @property
    def reduce_dtype(self) -> torch.dtype | None: ...
    @property
    def output_dtype(self) -> torch.dtype | None: ...


class _Params(Protocol):
    """What :func:`unit_findings` reads off a ``UnitParams`` (unit_params.py)."""

    @property
    def managed(self) -> Sequence[_Managed]: ...
    @property
    def orig_dtype(self) -> torch.dtype: ...


class _Unit(Protocol):
    """What :func:`unit_findings` reads off a ``ShardedUnit`` (unit.py)."""

    @property
    def name(self) -> str: ...
    @property
    def params(self) -> _Params: ...
    @property
    def config(self) -> _Config: ...


def unit_findings(unit: _Unit) -> list[PrecisionFinding]:
    """:func:`audit_precision` of a built unit: its name, trainable parameters,
    held dtype and its policy's dtypes as given (None where left None)."""
    config = unit.config
    return audit_precision(unit.name, [m.fqn for m in unit.params.managed if m.requires_grad], unit.params.orig_dtype,
                           param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype,
                           output_dtype=config.output_dtype)


def warn_precision(findings: Sequence[PrecisionFinding], *, stacklevel: int = 3) -> None:
    """One ``UserWarning`` per unit with WARNING-level findings, naming the unit,
    the dtypes and the fix; notes are not warned. ``stacklevel=3`` points at the
    caller of the function that calls this (``fully_shard``'s caller)."""
    by_unit: dict[str, list[PrecisionFinding]] = {}
    for f in findings:
        if f.level is PrecisionLevel.WARNING:
            by_unit.setdefault(f.unit, []).append(f)
    for group in by_unit.values():
        # The text names the unit, not its place in the model: the units of a
        # stack of identical blocks warn once (Python shows a text once per place).
        text = "; and ".join(f"{f.what}; {f.why}. Fix: {f.fix}" for f in group)
        warnings.warn(f"{group[0].where}: {text}", UserWarning, stacklevel=stacklevel)


def _below(a: torch.dtype, b: torch.dtype) -> bool:
    """``a`` keeps fewer mantissa bits than ``b``."""
    return torch.finfo(a).eps > torch.finfo(b).eps


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch(dtype: torch.dtype) -> str:
    return str(dtype)


def _bits(dtype: torch.dtype) -> int:
    """Significant bits of ``dtype``: 8 for bfloat16, 11 for float16, 24 for float32."""
    return round(-math.log2(torch.finfo(dtype).eps)) + 1


def _lost_updates(held: torch.dtype) -> str:
    return (f"{_name(held)} keeps {_bits(held)} significant bits: an optimizer update smaller than about "
            f"1/{2 ** _bits(held)} of a weight is rounded away, so small learning rates stall")


def _rounded_sum(dtype: torch.dtype) -> str:
    return (f"every addition over ranks and micro-batches rounds the sum to {_bits(dtype)} significant bits "
            "before the optimizer sees it")
