"""The report of ``tandem check`` (pure): both runs' records in
(records.py), a :class:`CheckReport` out: the comparison (compare.py), the
losses, the problems and the likely cause (diagnose.py), fully_shard's
precision audit (tandem/fsdp/precision.py), and the text."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.fsdp.precision import PrecisionFinding
from tandem.tools.check.compare import Comparison, Divergence, Tolerance, compare_snapshots, default_tolerance
from tandem.tools.check.diagnose import first_module, noise_gradients, sharding_problems
from tandem.tools.check.records import RankRecord, ReferenceRun

__all__ = ["CheckReport", "build_report"]


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
    precision: tuple[PrecisionFinding, ...] = ()
    """fsdp: where the units hold or reduce gradients or optimizer state in less precision than the
    policy says, or worth a note; not judged."""
    # Note [precision of a unit] in tandem/fsdp/precision.py.

    @property
    def first_divergence(self) -> Divergence | None:
        return self.comparison.first_divergence

    @property
    def equal(self) -> bool:
        """True when every judged tensor (the parameters, less those whose gradient is only rounding
        noise; buffers are shown but not judged) is within tolerance after every step and no problem was
        found."""
        return self.first_divergence is None and not self.problems  # Note [what is compared] in compare.py

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
        lines += _precision_lines(self.precision)
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


def _precision_lines(findings: Sequence[PrecisionFinding]) -> list[str]:
    """One line per issue: the units of a stack of identical blocks share theirs."""
    groups: dict[tuple[str, ...], list[PrecisionFinding]] = {}
    for f in findings:
        groups.setdefault((f.issue.name, f.what, f.why, f.fix), []).append(f)
    lines = []
    for same in groups.values():
        f = same[0]
        if len(same) == 1:
            text = f.describe()
        else:
            units = collections.Counter(g.unit for g in same)
            where = ", ".join(f"'{u}'" + (f" (x{n})" if n > 1 else "") for u, n in units.items())
            text = f"fully_shard units {where}: {f.what}; {f.why}. Fix: {f.fix}"
        lines.append(f"precision {f.level.name.lower()}: {text}")
    return lines


def _sortable(x: float) -> float:
    return float("inf") if x != x else x


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
    noise = noise_gradients(reference, tol) if reference.adaptive else []
    comparison = compare_snapshots(reference.snapshots, ranks[0].snapshots, tol, buffers=reference.buffers,
                                   ignored=[*noise, *reference.buffers])  # Note [what is compared] in compare.py
    losses = []
    for step, one in enumerate(reference.losses):
        sizes = [len(r.sample_keys[step]) for r in ranks]
        total = sum(sizes) or 1
        losses.append((one, sum(r.losses[step] * n for r, n in zip(ranks, sizes)) / total))
    problems: list[str] = []
    if ranks_shard_data:
        problems += sharding_problems(reference.sample_keys, [r.sample_keys for r in ranks])
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
        cause = first_module(reference, ranks, tol)
    return CheckReport(strategy=strategy, world_size=world, steps=len(reference.losses), tolerance=tol,
                       comparison=comparison, losses=tuple(losses), problems=tuple(problems), cause=cause,
                       notes=tuple(notes), setup=setup, precision=ranks[0].precision if ranks else ())
