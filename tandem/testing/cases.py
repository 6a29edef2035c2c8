"""Run many cases in one spawned group of ranks, each case as if it had its own.

:func:`~tandem.testing.run_distributed` starts a fresh group for every call:
forking the ranks, importing the test's module in each, and joining a process
group. A test module that checks a dozen small cases pays that a dozen times.
:func:`run_cases` starts the ranks once and runs the cases one after another
in them, each case in a process group of its own (a new file store, joined
before the case and destroyed after it), and keeps each case's outcome apart::

    CASES = {"sum": Case(check_sum), "order": Case(check_order, args=(True,), timeout=60)}

    @pytest.fixture(scope="module")
    def results():
        return run_cases(CASES, world_size=2)

    def test_sum(results):
        for value in results["sum"]:  # one value per rank, or the case's own failure
            ...

A case sees what a fresh rank sees: the default process group (new for it),
the random number generators of a new rank (torch's state as the forkserver
left it, Python's reseeded from the OS as after a fork), the environment of
the group plus the case's ``env``, the working directory, the default dtype
and grad mode, all restored after it.

Each case keeps its own deadline and failure reporting. Reading a case's
results raises, for that case alone, what ``run_distributed`` would have
raised: :class:`~tandem.testing.RankFailure` with the tracebacks of the ranks
that raised in it, or :class:`TimeoutError` when its ranks did not all finish
within its ``timeout`` (counted from the end of the case before it). A case
that raises on some ranks only leaves the others in a collective: destroying
its group makes them fail fast (as in ``run_distributed``); ranks that still
have not reported after a grace period, a rank that dies, and a case that runs
out of time end the group: its ranks are killed, and the cases after it run in
a new group. So one failing case never fails another, and nothing hangs.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.testing.harness import (
    _GRACE_AFTER_FAILURE_S,
    _POLL_S,
    RankFailure,
    _context,
    _load,
    join_group,
    run_and_report,
    stop_all,
)

__all__ = ["Case", "CaseResults", "run_cases"]


@dataclass(frozen=True)
class Case:
    """``fn(rank, world_size, *args)`` on every rank, within ``timeout`` seconds,
    with ``env`` added to the environment."""

    fn: Callable[..., Any]
    args: Sequence[Any] = ()
    timeout: float = 120.0
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Failed:
    first: int
    tracebacks: dict[int, str]


class CaseResults(Mapping[str, list[Any]]):
    """Each case's list of per-rank return values; reading a case that failed
    raises its failure (a new exception at every read)."""

    def __init__(self, outcomes: dict[str, list[Any] | _Failed | str]) -> None:
        self._outcomes = outcomes

    def __getitem__(self, name: str) -> list[Any]:
        outcome = self._outcomes[name]
        if isinstance(outcome, _Failed):
            raise RankFailure(outcome.first, outcome.tracebacks)
        if isinstance(outcome, str):
            raise TimeoutError(outcome)
        return outcome

    def __iter__(self) -> Iterator[str]:
        return iter(self._outcomes)

    def __len__(self) -> int:
        return len(self._outcomes)


def run_cases(cases: Mapping[str, Case], world_size: int = 2, *, backend: str = "gloo") -> CaseResults:
    """Run every case of ``cases`` on ``world_size`` ranks, in order, in as few
    spawned groups as their failures allow; see the module's docstring."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    names = list(cases)
    outcomes: dict[str, list[Any] | _Failed | str] = {}
    start = 0
    while start < len(names):
        start = _run_group(cases, names, start, world_size, backend, outcomes)
    return CaseResults({name: outcomes[name] for name in names})


def _run_group(cases: Mapping[str, Case], names: list[str], start: int, world_size: int, backend: str,
               outcomes: dict[str, list[Any] | _Failed | str]) -> int:
    """Run ``names[start:]`` in one new group until the end or until the group
    must go; records outcomes, returns the index of the first case not run."""
    ctx = _context()
    workdir = Path(tempfile.mkdtemp(prefix="tandem-cases-"))
    todo = [(name, cases[name]) for name in names[start:]]
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(target=_ranks_main, args=(todo, rank, world_size, str(workdir), backend),
                            name=f"tandem-rank-{rank}", daemon=True)
            p.start()
            procs.append(p)
        timeouts = [float(cases[name].timeout) for name in names]
        return _collect(procs, workdir, names, timeouts, start, outcomes)
    finally:
        stop_all(procs, workdir)


def _collect(procs: list[Any], workdir: Path, names: list[str], timeouts: list[float], start: int,
             outcomes: dict[str, list[Any] | _Failed | str]) -> int:
    """As harness._collect, case by case: rank r's outcome of the group's k-th
    case is the file ``r.k.ok`` or ``r.k.err``."""
    world_size = len(procs)
    i = start
    deadline = time.monotonic() + timeouts[i]
    first_failure: int | None = None
    failure_deadline = float("inf")
    while True:
        k = i - start
        name = names[i]
        errors = {r: (workdir / f"{r}.{k}.err").read_text() for r in range(world_size)
                  if (workdir / f"{r}.{k}.err").exists()}
        done = [r for r in range(world_size) if (workdir / f"{r}.{k}.ok").exists()]
        if errors and first_failure is None:
            first_failure = min(errors)
            failure_deadline = time.monotonic() + _GRACE_AFTER_FAILURE_S
        dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in errors and r not in done]
        for r in dead:
            errors[r] = f"process exited with code {procs[r].exitcode} without reporting a result"
            if first_failure is None:
                first_failure = r
                failure_deadline = time.monotonic() + _GRACE_AFTER_FAILURE_S
        if len(errors) + len(done) == world_size:
            if errors:
                assert first_failure is not None
                outcomes[name] = _Failed(first_failure, errors)
            else:
                outcomes[name] = [_load((workdir / f"{r}.{k}.ok").read_bytes()) for r in range(world_size)]
            i += 1
            if dead or i == len(names):
                return i  # a rank is gone: the rest run in a new group
            first_failure, failure_deadline = None, float("inf")
            deadline = time.monotonic() + timeouts[i]
            continue
        if first_failure is not None and time.monotonic() > failure_deadline:
            outcomes[name] = _Failed(first_failure, errors)
            return i + 1
        if time.monotonic() > deadline:
            pending = [r for r in range(world_size) if r not in done]
            outcomes[name] = (f"case {name!r}: ranks {pending} of {world_size} did not finish within "
                              f"{timeouts[i]:.0f}s (finished: {done}); all ranks were killed")
            return i + 1
        time.sleep(_POLL_S)


def _ranks_main(todo: list[tuple[str, Case]], rank: int, world_size: int, workdir: str, backend: str) -> None:

    from tandem._compat import bind_group_defaults_before_init

    bind_group_defaults_before_init()
    out = Path(workdir)
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
    })
    torch.set_num_threads(1)
    # What a new rank starts with, given back to every case.
    torch_rng = torch.get_rng_state()
    environ, cwd = dict(os.environ), os.getcwd()
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    for k, (_, case) in enumerate(todo):
        store = out / f"store-{k}"
        os.environ.update(case.env)
        os.environ["TANDEM_TEST_STORE"] = str(store)
        torch.set_rng_state(torch_rng)
        random.seed()  # as after a fork: Python's generator is reseeded from the OS

        def call(case: Case = case, store: Path = store) -> Any:
            join_group(backend, store, rank, world_size, case.timeout)
            return case.fn(rank, world_size, *case.args)

        try:
            run_and_report(call, out / f"{rank}.{k}.ok", out / f"{rank}.{k}.err")
        finally:
            os.environ.clear()
            os.environ.update(environ)
            os.chdir(cwd)
            torch.set_default_dtype(dtype)
            torch.set_grad_enabled(grad)
