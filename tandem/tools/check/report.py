"""The comparison and the report of ``tandem check`` (pure): per-step snapshots
of both runs and what they observed in, a :class:`CheckReport` out.

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
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["DEFAULT_TOLERANCES", "CheckReport", "Comparison", "Divergence", "RankRecord", "ReferenceRun",
           "Tolerance", "build_report", "compare_snapshots", "default_tolerance"]


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
