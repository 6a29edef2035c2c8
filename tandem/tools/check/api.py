"""``tandem check`` from Python: :func:`check` and :func:`check_strategies`
validate their arguments, run the one-process reference here, launch the
ranks once for every strategy, and build a :class:`CheckReport` for each."""

from __future__ import annotations

import logging
import pickle
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tandem._compat import fsdp_policies
from tandem.tools.check.inputs import _LOSSES, _optimizer_class, _Spec
from tandem.tools.check.compare import Tolerance, default_tolerance
from tandem.tools.check.report import CheckReport, build_report
from tandem.tools.check.run import STRATEGIES, _rank_main, _reference

logger = logging.getLogger(__name__)

__all__ = ["check", "check_strategies"]


def _make_spec(model: Any, data: Any, *, strategies: Sequence[str], nproc: int, steps: int, loss: Any,
               optimizer: Any, lr: float, optimizer_kwargs: Mapping[str, Any] | None, batch_size: int | None,
               seed: int, rtol: float | None, atol: float | None, mp_policy: Any = None) -> _Spec:
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
    if mp_policy is not None:
        MixedPrecisionPolicy, _, _ = fsdp_policies()
        if not isinstance(mp_policy, MixedPrecisionPolicy):
            raise ValueError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got {mp_policy!r}")
        others = [s for s in strategies if s != "fsdp"]
        if others:
            raise ValueError(f"mp_policy is fully_shard's and applies to strategy fsdp only, not {', '.join(others)}; "
                             "check those in a separate call without it")
    if isinstance(loss, str) and loss not in _LOSSES and loss != "auto" and ":" not in loss:
        raise ValueError(f"loss {loss!r} is not auto, {', '.join(_LOSSES)} or an entry point 'module:function'")
    spec = _Spec(model=model, data=data, batch_size=batch_size, loss=loss, optimizer=_optimizer_class(optimizer),
                 optimizer_kwargs={"lr": lr, **dict(optimizer_kwargs or {})}, steps=steps, seed=seed,
                 strategies=tuple(strategies), tolerance=tolerance, mp_policy=mp_policy)
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
        tolerance = spec.tolerance
        if spec.mp_policy is not None:
            mp = spec.mp_policy
            fields = [f"{f}={str(getattr(mp, f)).removeprefix('torch.')}" for f in
                      ("param_dtype", "reduce_dtype", "output_dtype") if getattr(mp, f) is not None]
            setup += f", mp_policy({', '.join(fields)})"
            if tolerance is None:
                tolerance = _mixed_precision_tolerance(reference.param_dtypes, mp)
        reports.append({s: build_report(reference, [r[k][s] for r in records], strategy=s, tolerance=tolerance,
                                        setup=setup, ranks_shard_data=per_rank) for s in spec.strategies})
    return reports


def _mixed_precision_tolerance(param_dtypes: Sequence[torch.dtype], mp_policy: Any) -> Tolerance:
    """The default tolerance when the ranks compute or reduce in the policy's
    dtypes and the one process in the parameters': the loosest of them all."""
    policy = [d for d in (mp_policy.param_dtype, mp_policy.reduce_dtype, mp_policy.output_dtype) if d is not None]
    own, tol = default_tolerance(param_dtypes), default_tolerance([*param_dtypes, *policy])
    return tol if tol == own else Tolerance(tol.rtol, tol.atol, f"{tol.source}, from mp_policy")


def check_strategies(model: Callable[[], nn.Module] | str, data: Any, *, strategies: Sequence[str] = ("ddp",),
                     nproc: int = 2, steps: int = 5, loss: Callable[[Any, Any], torch.Tensor] | str = "auto",
                     optimizer: str | type[torch.optim.Optimizer] = "sgd", lr: float = 0.1,
                     optimizer_kwargs: Mapping[str, Any] | None = None, batch_size: int | None = None,
                     seed: int = 0, rtol: float | None = None, atol: float | None = None,
                     mp_policy: Any = None) -> dict[str, CheckReport]:
    """:func:`check` for several strategies in one launch of the ranks: a report for each."""
    spec = _make_spec(model, data, strategies=strategies, nproc=nproc, steps=steps, loss=loss, optimizer=optimizer,
                      lr=lr, optimizer_kwargs=optimizer_kwargs, batch_size=batch_size, seed=seed, rtol=rtol,
                      atol=atol, mp_policy=mp_policy)
    return _check_specs([spec], nproc)[0]


def check(model: Callable[[], nn.Module] | str, data: Any, *, strategy: str = "ddp", nproc: int = 2,
          steps: int = 5, loss: Callable[[Any, Any], torch.Tensor] | str = "auto",
          optimizer: str | type[torch.optim.Optimizer] = "sgd", lr: float = 0.1,
          optimizer_kwargs: Mapping[str, Any] | None = None, batch_size: int | None = None, seed: int = 0,
          rtol: float | None = None, atol: float | None = None, mp_policy: Any = None) -> CheckReport:
    """Train ``steps`` steps as one process on the global batch and as ``nproc``
    ranks under ``strategy``, and compare the parameters after every step.

    Args:
        model: a function building the model, called with no arguments after
            :func:`tandem.seed_everything` ``(seed)`` in the one process and on
            every rank (so a factory that does not seed still builds the same
            model everywhere), or its entry point ``"package.module:function"``.
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
        optimizer: a ``torch.optim`` class or its name (any case).
        lr: the optimizer's learning rate.
        optimizer_kwargs: the optimizer's other keywords.
        batch_size: the global batch, with a Dataset.
        seed: seeds every generator before each call of ``model``.
        rtol: the relative tolerance; None: from the parameters' dtype
            (:data:`DEFAULT_TOLERANCES`, 1e-5 for float32).
        atol: the absolute tolerance; None: from the parameters' dtype
            (1e-5 for float32).
        mp_policy: ``strategy="fsdp"`` only: torch's ``MixedPrecisionPolicy``
            for every ``fully_shard`` call. The one process trains without it,
            so the default tolerance is the loosest of the parameters' and the
            policy's dtypes. The report lists fully_shard's precision audit of
            the units either way (``report.precision``).

    Returns:
        The :class:`CheckReport`: ``report.equal``, ``report.verdict``,
        ``report.first_divergence``, ``print(report.describe())``.

    Raises:
        ValueError: a bad argument or entry point, a batch that does not split
            into ``nproc`` equal shards, an ``mp_policy`` with a strategy other
            than ``fsdp``.
        tandem.launch.spawn.SpawnError: a rank failed (its traceback included).

    Warning:
        Dropout cannot match draw for draw: dropout modules are off for
        the comparison, and ranks that would all draw the same masks are
        reported. Functional dropout in ``forward`` cannot be turned off: give
        it ``p=0`` for the check.
    """
    # The factories: Note [what the factories are] in inputs.py; dropout: Note [dropout] in run.py.
    return check_strategies(model, data, strategies=(strategy,), nproc=nproc, steps=steps, loss=loss,
                            optimizer=optimizer, lr=lr, optimizer_kwargs=optimizer_kwargs, batch_size=batch_size,
                            seed=seed, rtol=rtol, atol=atol, mp_policy=mp_policy)[strategy]
