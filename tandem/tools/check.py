"""``tandem check``: does my distributed run train the same model as one process?

The user's own model, data, loss and optimizer are trained for a few steps
twice: once as ONE process on each global batch (the reference, in the calling
process), and once as N ranks under DDP, ZeRO-1, ZeRO-2 or fully_shard, each
rank on its shard of every global batch. The parameters (and floating buffers)
after every step are compared, and the report names the largest divergence per
tensor and per step, the first divergence, and what probably caused it.

Two parts, as everywhere in tandem: :func:`compare_snapshots` and
:func:`build_report` are pure (a :class:`CheckReport` from per-step snapshots
and what the runs observed); :func:`check` runs the reference here and the
ranks with :func:`tandem.spawn`, and :func:`main` is the command line.

# Note [what the factories are]
``model()`` builds the model. The tool seeds every generator
(:func:`tandem.seed_everything` with ``seed``) before calling it, in the
reference and on every rank, so a factory that does not seed still builds the
same model everywhere. The factory stands for the part of a training script
from seeding to the finished model: a script that seeds each rank differently
for dropout after building the model (``seed_everything(seed, per_rank=True)``)
must do so at the end of the factory too (Note [dropout]).

``data(step)`` returns the GLOBAL batch of a step as ``(inputs, targets)``;
the tool gives rank r the r-th of N equal dim-0 slices of every tensor in it.
A factory that also takes ``rank`` and ``world_size`` keywords is asked for
each rank's batch itself (``data(step, rank=r, world_size=n)``): that tests the
user's own sharding, and the report says when the ranks' batches are not a
split of ``data(step)`` into equal parts (checked per sample, in any order).
A ``torch.utils.data.Dataset`` with ``batch_size`` works too: step s is
samples ``[s*B, (s+1)*B)`` (wrapping around), collated by torch's default.
Inputs are passed as ``model(x)``, ``model(*x)`` for a tuple or list,
``model(**x)`` for a dict.

# Note [what is compared]
After step 0 (the initial model) and after each of the K optimizer steps: every
parameter (a fully-sharded one gathered in full) and every floating buffer
(BatchNorm's running statistics; rank 0's, as DDP broadcasts rank 0's), from
rank 0, against the one-process run. The verdict judges the parameters, which
are what training produces; the buffers are shown but not judged, as they
follow the parameters (a running mean tracks the bias before it, Note
[rounding-noise gradients]) and a wrong one shows in the parameters of the next
step anyway. A tensor is within tolerance when every
element satisfies ``|distributed - single| <= atol + rtol * |single|``
(:func:`torch.isclose`'s rule). The default tolerance comes from the lowest
floating precision among the parameters (:data:`DEFAULT_TOLERANCES`): the two
runs differ only in the order of summation, which costs a few ulps per step.

# Note [first divergence]
The first divergence is at the earliest step where some tensor is out of
tolerance. Within that step a parameter is named before a buffer, and among
them the one furthest out of tolerance (the largest
``|diff| / (atol + rtol * |single|)``), ties broken by model order
(``named_parameters()`` then ``named_buffers()``). After one wrong step every
parameter usually differs, so the step and the worst tensor are what the
numbers can say; the cause is named by the first module whose output in the
first step's forward differs (below), which is compared with the same rule.

# Note [rounding-noise gradients]
Some parameters have no gradient in exact arithmetic, only rounding noise: a
bias right before a normalisation layer (the normalisation subtracts the mean
it adds). SGD moves such a parameter by ``lr * noise``, far inside any
tolerance; Adam-type optimizers divide by the gradient's own running scale and
move it by about ``lr`` in the direction of the noise, which differs between one
process and N ranks. With an optimizer other than SGD, a parameter whose
one-process gradient stays at or below ``rtol`` x the step's largest gradient in
every step is still compared and shown, but not judged; the notes name it.

# Note [dropout]
One process and N ranks cannot draw the same dropout masks, so for the
comparison every dropout module (``nn.Dropout``, ``Dropout1d/2d/3d``,
``AlphaDropout``, ``FeatureAlphaDropout``) is put in eval mode and
``nn.MultiheadAttention``'s dropout is set to 0, on both sides; the report
lists them. What the comparison cannot see is checked apart: if the model's
forward draws random numbers in training mode and torch's generator is in the
same state on every rank after the factory returns, every rank draws the same
masks, so samples k, k + B/N, ... of the global batch share a mask, which one
process never does. That is reported as a divergence ("every rank draws the
same dropout masks") with the fix. A forward that still draws random numbers
with the dropout modules off (functional dropout) is named in the notes: the
two runs cannot match draw for draw, and a divergence may come from it.
"""

from __future__ import annotations

import argparse
import collections
import logging
import copy
import functools
import hashlib
import inspect
import pickle
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem._tree import iter_tensors, map_tensors
from tandem.tools.entry import load_entry

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_TOLERANCES", "STRATEGIES", "CheckReport", "Comparison", "Divergence", "RankRecord",
           "ReferenceRun", "Tolerance", "build_parser", "build_report", "check", "check_strategies",
           "compare_snapshots", "default_tolerance", "main", "sample_keys", "shard_batch"]

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
"""``tandem.DistributedDataParallel``, with ``zero_stage=1`` or ``2`` and a
:class:`tandem.ZeroOptimizer`, and ``tandem.fully_shard`` (each item of every
``nn.ModuleList`` a unit, then the root, as ``tandem plan`` assumes)."""

EXIT_EQUAL = 0
"""Every strategy trained the same model as one process."""
EXIT_DIVERGES = 1
"""Some strategy diverged."""
EXIT_USAGE = 2
"""Bad arguments, or the check could not run (a rank failed): nothing was compared."""


# ---------------------------------------------------------------------- the comparison (pure)

@dataclass(frozen=True)
class Tolerance:
    """``|distributed - single| <= atol + rtol * |single|``, elementwise."""

    rtol: float
    atol: float
    source: str = "given"
    """Where it came from: ``"given"`` or ``"float32 default"`` and so on."""

    def __post_init__(self) -> None:
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"tolerance {name}={value!r} must be a number >= 0")

    def describe(self) -> str:
        return f"|distributed - single| <= {self.atol:g} + {self.rtol:g} * |single| ({self.source})"


DEFAULT_TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
"""(rtol, atol) by the lowest floating precision among the parameters: the two
runs differ by the order of summation, a few ulps per step over a few steps."""


def default_tolerance(dtypes: Sequence[torch.dtype]) -> Tolerance:
    """The tolerance for parameters of ``dtypes``: the loosest of :data:`DEFAULT_TOLERANCES`."""
    known = [d for d in dtypes if d in DEFAULT_TOLERANCES] or [torch.float32]
    dtype = max(known, key=lambda d: DEFAULT_TOLERANCES[d][0])
    rtol, atol = DEFAULT_TOLERANCES[dtype]
    return Tolerance(rtol, atol, f"{str(dtype).removeprefix('torch.')} default")


@dataclass(frozen=True)
class Divergence:
    """Where the distributed run first left the tolerance (Note [first divergence])."""

    step: int
    """Optimizer steps taken (0: the initial model)."""
    name: str
    """The parameter or buffer, as ``named_parameters()`` / ``named_buffers()`` name it."""
    max_abs_diff: float
    """Its largest elementwise ``|distributed - single|`` at that step."""
    is_buffer: bool = False


@dataclass(frozen=True)
class Comparison:
    """Per-step, per-tensor differences of two runs' snapshots."""

    names: tuple[str, ...]
    """The compared tensors, parameters then buffers, in model order."""
    buffers: frozenset[str]
    """Which of ``names`` are buffers."""
    max_abs_diff: tuple[tuple[float, ...], ...]
    """``[step][tensor]``: the largest ``|distributed - single|`` (inf: missing or another shape)."""
    excess: tuple[tuple[float, ...], ...]
    """``[step][tensor]``: the largest ``|diff| / (atol + rtol*|single|)``; above 1 is out of tolerance."""
    first_divergence: Divergence | None
    ignored: frozenset[str] = frozenset()
    """Names compared and shown but not judged (Note [rounding-noise gradients])."""

    def judged_out(self, step: int) -> list[str]:
        """The judged tensors out of tolerance at ``step``."""
        return [n for n, e in zip(self.names, self.excess[step]) if e > 1 and n not in self.ignored]


def _diff(ref: torch.Tensor | None, got: torch.Tensor | None, tol: Tolerance) -> tuple[float, float]:
    if ref is None or got is None or tuple(ref.shape) != tuple(got.shape):
        return float("inf"), float("inf")
    if ref.numel() == 0:
        return 0.0, 0.0
    r, g = ref.detach().double(), got.detach().double()
    diff = (g - r).abs()
    bound = tol.atol + tol.rtol * r.abs()
    ratio = torch.where(diff == 0, torch.zeros_like(diff), diff / bound)
    worst, over = diff.max().item(), ratio.max().item()
    nan = bool(torch.isnan(diff).any())  # NaN on one side only, or on both: out of tolerance either way
    return (float("nan") if nan else worst), (float("inf") if nan or over != over else over)


def compare_snapshots(reference: Sequence[Mapping[str, torch.Tensor]],
                      distributed: Sequence[Mapping[str, torch.Tensor]], tolerance: Tolerance,
                      *, buffers: Sequence[str] = (), ignored: Sequence[str] = ()) -> Comparison:
    """Compare two runs' tensors after each step (pure).

    Args:
        reference: the one-process run: for each step (0: initial), name -> tensor,
            in model order (parameters, then buffers).
        distributed: the same for the distributed run.
        tolerance: the elementwise rule (Note [what is compared]).
        buffers: which names are buffers (named after parameters, Note [first divergence]).
        ignored: names compared but never named as the first divergence.

    Returns:
        The :class:`Comparison`; a name on one side only, or with another shape,
        counts as an infinite difference.

    Raises:
        ValueError: the runs have different numbers of steps.
    """
    if len(reference) != len(distributed):
        raise ValueError(f"the one-process run has {len(reference)} snapshots, the distributed run "
                         f"{len(distributed)}: compare the same steps")
    names: list[str] = []
    for snap in [*reference, *distributed]:
        names += [n for n in snap if n not in names]
    buffer_set, ignored_set = frozenset(buffers), frozenset(ignored)
    names.sort(key=lambda n: n in buffer_set)  # stable: model order within parameters and buffers
    diffs, excess = [], []
    first: Divergence | None = None
    for step, (ref, got) in enumerate(zip(reference, distributed)):
        row = [_diff(ref.get(n), got.get(n), tolerance) for n in names]
        diffs.append(tuple(d for d, _ in row))
        excess.append(tuple(e for _, e in row))
        if first is None:
            out = [i for i, (_, e) in enumerate(row) if e > 1 and names[i] not in ignored_set]
            if out:
                # Parameters before buffers, then the furthest out; max() keeps the first of equals.
                worst = max(out, key=lambda i: (names[i] not in buffer_set, row[i][1]))
                first = Divergence(step, names[worst], row[worst][0], names[worst] in buffer_set)
    return Comparison(tuple(names), buffer_set, tuple(diffs), tuple(excess), first, ignored_set)


@dataclass(frozen=True, kw_only=True)
class CheckReport:
    """Did N ranks train the same model as one process? (:func:`check`)."""

    strategy: str
    """``ddp``, ``zero1``, ``zero2`` or ``fsdp``."""
    world_size: int
    steps: int
    """Optimizer steps compared (snapshots 0..steps)."""
    tolerance: Tolerance
    comparison: Comparison
    losses: tuple[tuple[float, float], ...] = ()
    """Per step: (one process's loss, the ranks' loss over the global batch)."""
    problems: tuple[str, ...] = ()
    """Divergences the snapshots alone cannot show (dropout, data sharding); each fails the check."""
    cause: str | None = None
    """What probably caused a divergence: the first module whose output differs in step 1."""
    notes: tuple[str, ...] = ()
    """What was changed for the check, and warnings."""
    setup: str = ""
    """The optimizer and loss, for the header."""

    @property
    def first_divergence(self) -> Divergence | None:
        return self.comparison.first_divergence

    @property
    def equal(self) -> bool:
        """True when every judged tensor (Note [what is compared]) is within tolerance after every
        step and no problem was found."""
        return self.first_divergence is None and not self.problems

    @property
    def verdict(self) -> str:
        first = self.first_divergence
        if first is not None:
            kind = "buffer" if first.is_buffer else "parameter"
            where = "the initial model" if first.step == 0 else f"step {first.step}"
            return (f"DIVERGES: first at {where} in {kind} '{first.name}', "
                    f"max |diff| = {first.max_abs_diff:.3g}")
        if self.problems:
            return f"DIVERGES: {self.problems[0]}"
        return f"equal within tolerance over {self.steps} steps"

    def per_step(self) -> list[tuple[float, str]]:
        """For each snapshot: the largest ``|diff|`` and the tensor that has it."""
        names = self.comparison.names
        out = []
        for row in self.comparison.max_abs_diff:
            i = max(range(len(row)), key=lambda k: _sortable(row[k])) if row else -1
            out.append((row[i], names[i]) if row else (0.0, ""))
        return out

    def per_tensor(self) -> dict[str, tuple[float, int | None]]:
        """For each tensor: the largest ``|diff|`` over all steps, and the first
        step out of tolerance (None: never)."""
        c = self.comparison
        result = {}
        for k, name in enumerate(c.names):
            worst = max((row[k] for row in c.max_abs_diff), key=_sortable, default=0.0)
            first = next((s for s, row in enumerate(c.excess) if row[k] > 1), None)
            result[name] = (worst, first)
        return result

    def describe(self, *, max_rows: int = 12) -> str:
        """The report as text: header, tolerance, per step, per tensor, verdict."""
        lines = [f"tandem check: {self.world_size} ranks ({self.strategy}) against one process on the "
                 f"global batch, {self.steps} steps{', ' + self.setup if self.setup else ''}",
                 f"tolerance: {self.tolerance.describe()}"]
        lines += [f"note: {n}" for n in self.notes]
        lines.append(f"{'step':>4}  {'loss, 1 process':>15}  {f'loss, {self.world_size} ranks':>15}  "
                     f"{'max |diff|':>10}  in")
        for step, (diff, name) in enumerate(self.per_step()):
            one, many = ("", "") if step == 0 or step > len(self.losses) else \
                (f"{self.losses[step - 1][0]:.6f}", f"{self.losses[step - 1][1]:.6f}")
            flag = "  <- out of tolerance" if self.comparison.judged_out(step) else ""
            label = (name if diff > 0 else "-") + (" (initial model)" if step == 0 else "")
            lines.append(f"{step:>4}  {one:>15}  {many:>15}  {diff:>10.3g}  {label}{flag}")
        table = sorted(self.per_tensor().items(), key=lambda kv: (kv[1][1] is None, kv[1][1] or 0,
                                                                   -_sortable(kv[1][0])))
        shown = table[:max_rows]
        width = max((len(n) for n, _ in shown), default=4)
        lines.append(f"{'tensor':<{width}}  {'max |diff|':>10}  first step out of tolerance")
        for name, (diff, first) in shown:
            tags = [t for t, on in (("buffer", name in self.comparison.buffers),
                                    ("not judged", name in self.comparison.ignored)) if on]
            suffix = f" ({', '.join(tags)})" if tags else ""
            lines.append(f"{name:<{width}}  {diff:>10.3g}  {'-' if first is None else first}{suffix}")
        if len(table) > max_rows:
            lines.append(f"... {len(table) - max_rows} more")
        lines.append(f"verdict: {self.verdict}")
        extra = list(self.problems[1:] if self.first_divergence is None else self.problems)
        lines += [f"  because: {p}" for p in extra]
        if self.cause is not None and not self.equal:
            lines.append(f"  likely cause: {self.cause}")
        return "\n".join(lines)


def _sortable(x: float) -> float:
    return float("inf") if x != x else x


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
    """Module outputs of step 1's forward, in the order they finished (Note [first divergence])."""
    snapshots: tuple[dict[str, torch.Tensor], ...] = ()
    """Rank 0 only: the full tensors after each step (0: initial)."""


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
    """Dropout modules turned off for the comparison (Note [dropout])."""
    draws_random: bool
    """The forward drew random numbers in training mode, dropout on."""
    draws_random_without_dropout: bool
    """... and still did with the dropout modules off."""
    module_types: dict[str, str] = field(default_factory=dict)
    loss_name: str = ""
    grad_max: tuple[dict[str, float], ...] = ()
    """Per step: each parameter's largest ``|grad|`` (Note [rounding-noise gradients])."""
    adaptive: bool = False
    """The optimizer divides by a running gradient scale (anything but SGD and ASGD)."""


def build_report(reference: ReferenceRun, ranks: Sequence[RankRecord], *, strategy: str,
                 tolerance: Tolerance | None = None, setup: str = "", ranks_shard_data: bool = False) -> CheckReport:
    """The :class:`CheckReport` of one strategy from both runs' records (pure).

    Args:
        reference: the one-process run.
        ranks: every rank's record, by rank; rank 0's holds the snapshots.
        strategy: for the report.
        tolerance: None: :func:`default_tolerance` of the parameters' dtypes.
        setup: optimizer and loss, for the header.
        ranks_shard_data: the ranks' batches came from the user's
            ``data(step, rank=, world_size=)``, so check that they split the global batch.
    """
    tol = tolerance if tolerance is not None else default_tolerance(reference.param_dtypes)
    world = len(ranks)
    noise = _noise_gradients(reference, tol) if reference.adaptive else []
    comparison = compare_snapshots(reference.snapshots, ranks[0].snapshots, tol, buffers=reference.buffers,
                                   ignored=[*noise, *reference.buffers])  # Note [what is compared]
    losses = []
    for step, one in enumerate(reference.losses):
        sizes = [len(r.sample_keys[step]) for r in ranks]
        total = sum(sizes) or 1
        losses.append((one, sum(r.losses[step] * n for r, n in zip(ranks, sizes)) / total))
    problems: list[str] = []
    if ranks_shard_data:
        problems += _sharding_problems(reference.sample_keys, [r.sample_keys for r in ranks])
    if world > 1 and reference.draws_random and len({r.rng_state for r in ranks}) == 1:
        what = (f"dropout masks ({', '.join(reference.random_layers)})" if reference.random_layers
                else "random numbers in the forward")
        problems.append(
            f"every rank draws the same {what}: torch's generator is in the same state on all {world} ranks "
            "after the model factory, so sample i of every rank's shard gets the same mask, which one process "
            "never does; seed each rank differently after building the model: end the factory with "
            "tandem.seed_everything(seed, per_rank=True)")
    notes = []
    if reference.random_layers:
        notes.append(f"dropout off for the comparison (one process cannot draw the ranks' masks): "
                     f"{', '.join(reference.random_layers)}")
    if reference.draws_random_without_dropout:
        notes.append("the forward draws random numbers even with dropout modules off (functional dropout?): "
                     "one process and N ranks cannot draw the same numbers, make it deterministic for the check")
    if noise:
        worst = {n: d for n, (d, _) in CheckReport(strategy="", world_size=world, steps=0, tolerance=tol,
                                                    comparison=comparison).per_tensor().items()}
        notes.append(f"not judged: {', '.join(f'{n} (max |diff| {worst[n]:.3g})' for n in noise)}: the one-process "
                     f"gradient is rounding noise (below {tol.rtol:g} x the largest in every step; a bias right "
                     "before a normalisation has none), which this optimizer scales up to full steps of either "
                     "sign; judge it with --optimizer sgd")
    cause = None
    if comparison.first_divergence is not None and not problems:
        cause = _first_module(reference, ranks, tol)
    return CheckReport(strategy=strategy, world_size=world, steps=len(reference.losses), tolerance=tol,
                       comparison=comparison, losses=tuple(losses), problems=tuple(problems), cause=cause,
                       notes=tuple(notes), setup=setup)


def _noise_gradients(reference: ReferenceRun, tol: Tolerance) -> list[str]:
    """Note [rounding-noise gradients]."""
    if not reference.grad_max:
        return []
    names = list(reference.grad_max[0])
    for grads in reference.grad_max:
        scale = max(grads.values(), default=0.0)
        names = [n for n in names if grads.get(n, 0.0) <= tol.rtol * scale]
    return names if len(names) < len(reference.grad_max[0]) else []


def _sharding_problems(global_keys: Sequence[Sequence[bytes]],
                       rank_keys: Sequence[Sequence[Sequence[bytes]]]) -> list[str]:
    for step, expected in enumerate(global_keys):
        shards = [keys[step] for keys in rank_keys]
        sizes = [len(s) for s in shards]
        want = collections.Counter(expected)
        got = collections.Counter(k for s in shards for k in s)
        if want != got:
            missing, extra = sum((want - got).values()), sum((got - want).values())
            return [f"step {step + 1}: the ranks' batches are not a split of the global batch data({step}): "
                    f"{missing} of its {len(expected)} samples are on no rank and {extra} samples on the ranks "
                    "are not in it or repeated; data(step, rank=r, world_size=n) must return disjoint shards "
                    "that together are data(step)"]
        if len(set(sizes)) > 1:
            return [f"step {step + 1}: the ranks hold {', '.join(map(str, sizes))} samples: DDP averages the "
                    "ranks' mean losses, which weighs the samples of a smaller shard more; give every rank "
                    "the same number of samples"]
    return []


def _first_module(reference: ReferenceRun, ranks: Sequence[RankRecord], tol: Tolerance) -> str | None:
    """The first module whose output in step 1's forward differs, the ranks' outputs
    put back into the global batch's sample order."""
    order = _global_positions(reference.sample_keys[0], [r.sample_keys[0] for r in ranks])
    if order is None:
        return None
    per_rank = [dict(r.outputs) for r in ranks]
    for name, ref in reference.outputs:
        parts = [outs.get(name) for outs in per_rank]
        if any(p is None for p in parts):
            continue
        got = torch.cat([p for p in parts if p is not None])
        if tuple(got.shape) != tuple(ref.shape):
            continue
        placed = torch.empty_like(got)
        placed[order] = got
        if _diff(ref, placed, tol)[1] > 1:
            kind = reference.module_types.get(name, "")
            label = f"'{name}'" if name else "the model"
            hint = ""
            if "BatchNorm" in kind and "Sync" not in kind:
                hint = (": it normalises with each rank's batch statistics, not the global batch's; convert "
                        "the model with tandem.SyncBatchNorm.convert_sync_batchnorm(model) before wrapping it")
            return f"the first module whose output differs in step 1's forward is {label} ({kind}){hint}"
    return None


def _global_positions(expected: Sequence[bytes], shards: Sequence[Sequence[bytes]]) -> torch.Tensor | None:
    where: dict[bytes, list[int]] = collections.defaultdict(list)
    for i, key in enumerate(expected):
        where[key].append(i)
    positions = []
    for shard in shards:
        for key in shard:
            if not where.get(key):
                return None
            positions.append(where[key].pop(0))
    return torch.tensor(positions, dtype=torch.long)


# ---------------------------------------------------------------------- running the model

@dataclass(frozen=True, kw_only=True)
class _Spec:
    """Everything a rank needs, picklable (entry points as strings or importable objects)."""

    model: Any
    data: Any
    batch_size: int | None
    loss: Any
    optimizer: Any
    optimizer_kwargs: dict[str, Any]
    steps: int
    seed: int
    strategies: tuple[str, ...]
    tolerance: Tolerance | None


_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "mse": nn.functional.mse_loss, "cross_entropy": nn.functional.cross_entropy, "l1": nn.functional.l1_loss}


def _resolve(obj: Any, what: str) -> Any:
    return load_entry(obj, what=what) if isinstance(obj, str) else obj


def _build_model(spec: _Spec) -> nn.Module:
    from tandem.train.rng import seed_everything

    seed_everything(spec.seed)  # Note [what the factories are]
    model = _resolve(spec.model, "--model")()
    if not isinstance(model, nn.Module):
        raise ValueError(f"the model factory {spec.model!r} returned a {type(model).__name__}, not an nn.Module")
    return model.train()


class _Batches:
    """Global and per-rank batches from ``data`` (Note [what the factories are])."""

    def __init__(self, data: Any, batch_size: int | None) -> None:
        from torch.utils.data import Dataset

        self.dataset = data if isinstance(data, Dataset) else None
        self.fn = None if self.dataset is not None else _resolve(data, "--data")
        if self.dataset is None and isinstance(self.fn, Dataset):
            self.dataset, self.fn = self.fn, None
        if self.dataset is not None and not (isinstance(batch_size, int) and batch_size > 0):
            raise ValueError(f"a Dataset needs a global batch_size (--batch-size), got {batch_size!r}")
        self.batch_size = batch_size
        self.per_rank = self.fn is not None and _takes_rank(self.fn)

    def global_batch(self, step: int) -> tuple[Any, Any]:
        if self.dataset is not None:
            from torch.utils.data import default_collate

            n, b = len(self.dataset), self.batch_size  # type: ignore[arg-type]
            assert b is not None
            return _as_pair(default_collate([self.dataset[(step * b + i) % n] for i in range(b)]), "dataset")
        assert self.fn is not None
        return _as_pair(self.fn(step), f"data({step})")

    def rank_batch(self, step: int, rank: int, world_size: int) -> tuple[Any, Any]:
        if self.per_rank:
            assert self.fn is not None
            return _as_pair(self.fn(step, rank=rank, world_size=world_size),
                            f"data({step}, rank={rank}, world_size={world_size})")
        return shard_batch(self.global_batch(step), rank, world_size, step=step)


def _takes_rank(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return False  # **kwargs alone does not say the factory shards
    return "rank" in params and "world_size" in params


def _as_pair(batch: Any, what: str) -> tuple[Any, Any]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ValueError(f"{what} must return (inputs, targets), got {type(batch).__name__}")
    return batch[0], batch[1]


def _batch_size(batch: Any, what: str) -> int:
    sizes = {t.shape[0] for t in iter_tensors(batch) if t.dim()}
    if len(sizes) != 1:
        raise ValueError(f"{what}: the tensors of a batch must share their first (batch) dimension, "
                         f"got sizes {sorted(sizes)}")
    return sizes.pop()


def shard_batch(batch: tuple[Any, Any], rank: int, world_size: int, *, step: int = 0) -> tuple[Any, Any]:
    """Rank ``rank``'s equal dim-0 slice of every tensor in a global batch.

    Raises:
        ValueError: the global batch does not divide by ``world_size``.
    """
    size = _batch_size(batch, f"data({step})")
    if size % world_size:
        raise ValueError(f"the global batch of step {step + 1} has {size} samples, which {world_size} ranks cannot "
                         f"share equally (DDP averages the ranks' mean losses); use a global batch that is a "
                         f"multiple of {world_size}")
    per = size // world_size
    inputs, targets = map_tensors(lambda t: t[rank * per:(rank + 1) * per] if t.dim() else t, batch)
    return inputs, targets


def sample_keys(batch: tuple[Any, Any]) -> tuple[bytes, ...]:
    """A fingerprint of each sample of a batch: its rows of every batched tensor."""
    tensors = [t for t in iter_tensors(batch) if t.dim()]
    if not tensors:
        return ()
    size = tensors[0].shape[0]
    rows = [t.detach().cpu().contiguous().view(torch.uint8).reshape(size, -1).numpy() if t.numel() else None
            for t in tensors]
    keys = []
    for i in range(size):
        h = hashlib.blake2b(digest_size=16)
        for r in rows:
            if r is not None:
                h.update(r[i].tobytes())
        keys.append(h.digest())
    return tuple(keys)


def _loss_fn(spec: Any) -> Callable[[Any, Any], torch.Tensor]:
    if isinstance(spec, str) and spec in _LOSSES:
        return _LOSSES[spec]
    if spec == "auto":
        return _auto_loss
    return _resolve(spec, "--loss")


def _auto_loss(outputs: Any, targets: Any) -> torch.Tensor:
    """Cross-entropy for integer targets (class indices), MSE for floating ones."""
    if torch.is_floating_point(targets):
        return nn.functional.mse_loss(outputs, targets)
    return nn.functional.cross_entropy(outputs, targets)


def _loss_name(spec: Any, targets: Any) -> str:
    if spec == "auto":
        floating = isinstance(targets, torch.Tensor) and torch.is_floating_point(targets)
        return f"{'mse' if floating else 'cross_entropy'} (auto)"
    return spec if isinstance(spec, str) else getattr(spec, "__name__", repr(spec))


def _optimizer_class(spec: Any) -> type[torch.optim.Optimizer]:
    if isinstance(spec, type) and issubclass(spec, torch.optim.Optimizer):
        return spec
    if isinstance(spec, str):
        for name in dir(torch.optim):
            obj = getattr(torch.optim, name)
            if name.lower() == spec.lower() and isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer):
                return obj
    raise ValueError(f"optimizer {spec!r} is not a torch.optim class: name one (sgd, adam, adamw, ...) "
                     "or pass the class")


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _dropout_off(model: nn.Module) -> tuple[str, ...]:
    """Note [dropout]: dropout modules to eval mode, attention dropout to 0."""
    names = []
    for name, m in model.named_modules():
        if isinstance(m, _DROPOUT) and m.p > 0:
            m.eval()
            names.append(f"{name} (p={m.p:g})")
        elif isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            names.append(f"{name} (attention dropout={m.dropout:g})")
            m.dropout = 0.0
    return tuple(names)


def _draws_random(model: nn.Module, inputs: Any) -> bool:
    """Whether a training-mode forward of a copy of ``model`` uses torch's generator."""
    probe = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]):
        before = torch.get_rng_state()
        with torch.no_grad():
            _call(probe, inputs)
        return not torch.equal(before, torch.get_rng_state())


def _record_outputs(model: nn.Module) -> tuple[list[tuple[str, torch.Tensor]], list[Any]]:
    records: list[tuple[str, torch.Tensor]] = []
    seen: collections.Counter[str] = collections.Counter()

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.dim():
                key = name if not seen[name] else f"{name}#{seen[name] + 1}"  # a module called twice
                seen[name] += 1
                records.append((key, output.detach().cpu().clone()))
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
    return records, handles


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full copies of the parameters and floating buffers (a fully-sharded one gathered: a collective)."""
    from tandem._compat import dtensor_api

    DTensor, _, _ = dtensor_api()
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not t.is_floating_point():
            continue
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = full.detach().cpu().clone()
    return out


_Run = tuple[list[float], list[dict[str, torch.Tensor]], list[tuple[str, torch.Tensor]], list[tuple[bytes, ...]]]


def _train(model: nn.Module, forward: nn.Module, optimizer: Any, batch_of: Callable[[int], Any],
           loss_fn: Callable[[Any, Any], torch.Tensor], steps: int,
           grad_max: list[dict[str, float]] | None = None) -> _Run:
    """``steps`` optimizer steps of ``forward`` (``model`` or its wrapper): the losses,
    the snapshots (0: initial), step 1's module outputs and each step's sample keys."""
    snapshots = [_snapshot(model)]
    losses, keys = [], []
    records, handles = _record_outputs(model)
    for step in range(steps):
        inputs, targets = batch = batch_of(step)
        keys.append(sample_keys(batch))
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(_call(forward, inputs), targets)
        if step == 0:
            for h in handles:
                h.remove()
        loss.backward()
        if grad_max is not None:
            grad_max.append({n: float(p.grad.detach().abs().max()) if p.numel() else 0.0
                             for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        losses.append(float(loss.detach()))
        snapshots.append(_snapshot(model))
    return losses, snapshots, records, keys


def _reference(spec: _Spec) -> tuple[ReferenceRun, bool]:
    from tandem.train.rng import capture_rng_state, restore_rng_state

    saved = capture_rng_state()  # library code leaves the caller's generators as they were
    try:
        batches = _Batches(spec.data, spec.batch_size)
        model = _build_model(spec)
        params = dict(model.named_parameters())
        buffers = tuple(n for n, b in model.named_buffers() if b.is_floating_point())
        first_inputs, first_targets = batches.global_batch(0)
        draws = _draws_random(model, first_inputs)
        layers = _dropout_off(model)
        draws_after = _draws_random(model, first_inputs) if draws else False
        optimizer = _optimizer_class(spec.optimizer)(model.parameters(), **spec.optimizer_kwargs)
        loss_fn = _loss_fn(spec.loss)
        grad_max: list[dict[str, float]] = []
        losses, snapshots, outputs, keys = _train(model, model, optimizer, batches.global_batch, loss_fn,
                                                  spec.steps, grad_max)
        run = ReferenceRun(snapshots=tuple(snapshots), buffers=buffers, losses=tuple(losses),
                           sample_keys=tuple(keys), outputs=tuple(outputs),
                           param_dtypes=tuple({p.dtype for p in params.values() if p.is_floating_point()}),
                           random_layers=layers, draws_random=draws, draws_random_without_dropout=draws_after,
                           module_types={n: type(m).__name__ for n, m in model.named_modules()},
                           loss_name=_loss_name(spec.loss, first_targets), grad_max=tuple(grad_max),
                           adaptive=spec.optimizer not in (torch.optim.SGD, torch.optim.ASGD))
        return run, batches.per_rank
    finally:
        restore_rng_state(saved)


def _wrap(strategy: str, model: nn.Module, spec: _Spec) -> tuple[nn.Module, Any]:
    opt_class = _optimizer_class(spec.optimizer)
    if strategy == "ddp":
        from tandem.ddp import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        return ddp, opt_class(ddp.parameters(), **spec.optimizer_kwargs)
    if strategy in ("zero1", "zero2"):
        from tandem.ddp import DistributedDataParallel
        from tandem.zero import ZeroOptimizer

        ddp = DistributedDataParallel(model, zero_stage=int(strategy[-1]))
        return ddp, ZeroOptimizer(ddp, opt_class, **spec.optimizer_kwargs)
    assert strategy == "fsdp", strategy
    from tandem.fsdp import fully_shard
    from tandem.tools.plan import default_fsdp_units

    for name in default_fsdp_units(model):
        fully_shard(model.get_submodule(name))
    fully_shard(model)
    return model, opt_class(model.parameters(), **spec.optimizer_kwargs)


def _rank_main(rank: int, specs: tuple[_Spec, ...]) -> list[dict[str, RankRecord]]:
    """What each spawned rank runs: every check and strategy in turn, each from a freshly built model."""
    return [{strategy: _rank_run(rank, spec, strategy) for strategy in spec.strategies} for spec in specs]


def _rank_run(rank: int, spec: _Spec, strategy: str) -> RankRecord:
    world_size = dist.get_world_size()
    batches = _Batches(spec.data, spec.batch_size)
    model = _build_model(spec)
    rng = hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=16).digest()
    _dropout_off(model)
    wrapped, optimizer = _wrap(strategy, model, spec)
    losses, snapshots, outputs, keys = _train(
        model, wrapped, optimizer, functools.partial(batches.rank_batch, rank=rank, world_size=world_size),
        _loss_fn(spec.loss), spec.steps)
    dist.barrier()
    return RankRecord(rank=rank, losses=tuple(losses), sample_keys=tuple(keys), rng_state=rng,
                      outputs=tuple(outputs), snapshots=tuple(snapshots) if rank == 0 else ())


def _make_spec(model: Any, data: Any, *, strategies: Sequence[str], nproc: int, steps: int, loss: Any,
               optimizer: Any, lr: float, optimizer_kwargs: Mapping[str, Any] | None, batch_size: int | None,
               seed: int, rtol: float | None, atol: float | None) -> _Spec:
    """Validate :func:`check`'s arguments into what the ranks are sent."""
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise ValueError(f"strategy {', '.join(unknown) or '(none)'} is not one of {', '.join(STRATEGIES)}")
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc={nproc!r} must be a positive int")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps={steps!r} must be a positive int")
    if (rtol is None) != (atol is None):
        raise ValueError(f"give both rtol and atol, or neither (got rtol={rtol!r}, atol={atol!r})")
    tolerance = None if rtol is None or atol is None else Tolerance(rtol, atol)
    if isinstance(loss, str) and loss not in _LOSSES and loss != "auto" and ":" not in loss:
        raise ValueError(f"loss {loss!r} is not auto, {', '.join(_LOSSES)} or an entry point 'module:function'")
    spec = _Spec(model=model, data=data, batch_size=batch_size, loss=loss, optimizer=_optimizer_class(optimizer),
                 optimizer_kwargs={"lr": lr, **dict(optimizer_kwargs or {})}, steps=steps, seed=seed,
                 strategies=tuple(strategies), tolerance=tolerance)
    for name in ("model", "data", "loss"):
        value = getattr(spec, name)
        main = sys.modules.get("__main__")
        interactive = getattr(value, "__module__", None) == "__main__" and not getattr(main, "__file__", None)
        try:
            pickle.dumps(value)
            problem = "it was defined in a notebook or the REPL" if interactive else ""
        except Exception as e:
            problem = str(e)
        if problem:
            raise ValueError(f"{name} {value!r} cannot be sent to the ranks ({problem}): define it at the top level "
                             "of a .py module and import it from there, or name it as 'package.module:function'")
    return spec


def _check_specs(specs: Sequence[_Spec], nproc: int) -> list[dict[str, CheckReport]]:
    """Run several checks on one launch of ``nproc`` ranks (a launch costs seconds)."""
    start = time.perf_counter()
    references = [_reference(spec) for spec in specs]
    logger.info("tandem check: %d one-process run(s) in %.1f s; starting %d ranks", len(specs),
                time.perf_counter() - start, nproc)
    for reference, per_rank in references:
        if per_rank:
            continue
        for step, keys in enumerate(reference.sample_keys):  # fail here, before starting the ranks
            if len(keys) % nproc:
                raise ValueError(f"the global batch of step {step + 1} has {len(keys)} samples, which {nproc} "
                                 "ranks cannot share equally (DDP averages the ranks' mean losses); use a global "
                                 f"batch that is a multiple of {nproc}")
    from tandem.launch.spawn import spawn

    records = spawn(_rank_main, args=(tuple(specs),), nprocs=nproc, backend="gloo")
    reports = []
    for k, (spec, (reference, per_rank)) in enumerate(zip(specs, references)):
        kwargs = ", ".join(f"{key}={v!r}" for key, v in spec.optimizer_kwargs.items())
        setup = f"{spec.optimizer.__name__}({kwargs}), loss {reference.loss_name}"
        reports.append({s: build_report(reference, [r[k][s] for r in records], strategy=s, tolerance=spec.tolerance,
                                        setup=setup, ranks_shard_data=per_rank) for s in spec.strategies})
    return reports


def check_strategies(model: Callable[[], nn.Module] | str, data: Any, *, strategies: Sequence[str] = ("ddp",),
                     nproc: int = 2, steps: int = 5, loss: Callable[[Any, Any], torch.Tensor] | str = "auto",
                     optimizer: str | type[torch.optim.Optimizer] = "sgd", lr: float = 0.1,
                     optimizer_kwargs: Mapping[str, Any] | None = None, batch_size: int | None = None,
                     seed: int = 0, rtol: float | None = None, atol: float | None = None) -> dict[str, CheckReport]:
    """:func:`check` for several strategies in one launch of the ranks: a report for each."""
    spec = _make_spec(model, data, strategies=strategies, nproc=nproc, steps=steps, loss=loss, optimizer=optimizer,
                      lr=lr, optimizer_kwargs=optimizer_kwargs, batch_size=batch_size, seed=seed, rtol=rtol,
                      atol=atol)
    return _check_specs([spec], nproc)[0]


def check(model: Callable[[], nn.Module] | str, data: Any, *, strategy: str = "ddp", nproc: int = 2,
          steps: int = 5, loss: Callable[[Any, Any], torch.Tensor] | str = "auto",
          optimizer: str | type[torch.optim.Optimizer] = "sgd", lr: float = 0.1,
          optimizer_kwargs: Mapping[str, Any] | None = None, batch_size: int | None = None, seed: int = 0,
          rtol: float | None = None, atol: float | None = None) -> CheckReport:
    """Train ``steps`` steps as one process on the global batch and as ``nproc``
    ranks under ``strategy``, and compare the parameters after every step.

    Args:
        model: a function building the model, called with no arguments after
            :func:`tandem.seed_everything` ``(seed)``, or its entry point
            ``"package.module:function"`` (Note [what the factories are]).
        data: ``data(step) -> (inputs, targets)``, the global batch of a step
            (sliced into equal shards, one per rank); one that also takes
            ``rank`` and ``world_size`` keywords gives each rank's batch
            itself; or a ``torch.utils.data.Dataset`` with ``batch_size``; or
            an entry point naming one of these.
        strategy: ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"fsdp"`` (:data:`STRATEGIES`).
        nproc: ranks (processes on this machine, gloo, CPU).
        steps: optimizer steps.
        loss: ``"auto"`` (cross-entropy for integer targets, MSE for floating
            ones), ``"mse"``, ``"cross_entropy"``, ``"l1"``, or
            ``loss(outputs, targets)`` (or its entry point): a MEAN over the
            batch, as DDP's gradient averaging assumes.
        optimizer, lr, optimizer_kwargs: a ``torch.optim`` class or its name
            (any case), built with ``lr`` and the keywords.
        batch_size: the global batch, with a Dataset.
        seed: seeds every generator before each call of ``model``.
        rtol, atol: the tolerance; None: from the parameters' dtype
            (:data:`DEFAULT_TOLERANCES`, 1e-5 and 1e-5 for float32).

    Returns:
        The :class:`CheckReport`: ``report.equal``, ``report.verdict``,
        ``report.first_divergence``, ``print(report.describe())``.

    Raises:
        ValueError: a bad argument or entry point, a batch that does not split
            into ``nproc`` equal shards.
        tandem.launch.spawn.SpawnError: a rank failed (its traceback included).

    .. warning:: Dropout cannot match draw for draw: dropout modules are off for
        the comparison, and ranks that would all draw the same masks are
        reported (Note [dropout]). Functional dropout in ``forward`` cannot be
        turned off: give it ``p=0`` for the check.
    """
    return check_strategies(model, data, strategies=(strategy,), nproc=nproc, steps=steps, loss=loss,
                            optimizer=optimizer, lr=lr, optimizer_kwargs=optimizer_kwargs, batch_size=batch_size,
                            seed=seed, rtol=rtol, atol=atol)[strategy]


# ---------------------------------------------------------------------- the command line

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem check",
        description="Train a few steps as one process on the global batch and as N ranks (DDP, ZeRO-1/2 or "
                    "fully_shard), each on its shard, and compare the parameters after every step. Exit 0: the "
                    "same model within tolerance; 1: it diverges; 2: bad arguments or a rank failed.")
    p.add_argument("--model", required=True, metavar="MOD:FN", help="a function building the model (no arguments)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", metavar="MOD:FN",
                        help="data(step) -> (inputs, targets), the global batch; or data(step, rank=, world_size=) "
                             "-> that rank's batch")
    source.add_argument("--dataset", metavar="MOD:FN", help="a function returning a Dataset (with --batch-size)")
    p.add_argument("--batch-size", type=int, default=None, help="global batch, with --dataset")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    p.add_argument("--strategy", default="ddp", metavar="S[,S...]",
                   help=f"one or more of {', '.join(STRATEGIES)}, comma-separated, in one launch (default ddp)")
    p.add_argument("--loss", default="auto",
                   help="auto (cross_entropy for integer targets, else mse), mse, cross_entropy, l1, or MOD:FN")
    p.add_argument("--optimizer", default="sgd", help="a torch.optim class, any case (default sgd)")
    p.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1)")
    p.add_argument("--momentum", type=float, default=None, help="passed to the optimizer when given")
    p.add_argument("--weight-decay", type=float, default=None, help="passed to the optimizer when given")
    p.add_argument("--seed", type=int, default=0, help="seeds every generator before the model factory (default 0)")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: from the dtype)")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance (default: from the dtype)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``tandem check``: 0 when every strategy trains the same model, 1 when one
    diverges, 2 on bad arguments or when a rank failed."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse's usage errors and --help
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    strategies = [s.strip() for s in args.strategy.split(",") if s.strip()]
    kwargs = {k: v for k, v in (("momentum", args.momentum), ("weight_decay", args.weight_decay)) if v is not None}
    try:
        if args.dataset is not None:
            data: Any = load_entry(args.dataset, what="--dataset")()
        else:
            data = args.data
        if args.rtol is not None and args.atol is None or args.atol is not None and args.rtol is None:
            raise ValueError("give both --rtol and --atol, or neither")
        reports = check_strategies(args.model, data, strategies=strategies, nproc=args.nproc, steps=args.steps,
                                   loss=args.loss, optimizer=args.optimizer, lr=args.lr, optimizer_kwargs=kwargs,
                                   batch_size=args.batch_size, seed=args.seed, rtol=args.rtol, atol=args.atol)
    except ValueError as e:
        print(f"tandem check: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except RuntimeError as e:  # SpawnError: a rank raised
        print(f"tandem check: the check could not run: {e}", file=sys.stderr)
        return EXIT_USAGE
    print("\n\n".join(r.describe() for r in reports.values()))
    return EXIT_EQUAL if all(r.equal for r in reports.values()) else EXIT_DIVERGES
