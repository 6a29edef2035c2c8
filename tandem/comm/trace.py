"""A rank's collectives and steps as a Chrome / Perfetto trace:
:class:`StepSpan`, :func:`write_trace`.

The ledger (Note [ledger cost] in ledger.py) keeps each collective's op, tag,
size, step and the wall-clock times it was issued and completed. Written in
the Trace Event Format (https://ui.perfetto.dev and chrome://tracing open it),
each collective is a span on its rank's lane (``pid`` the rank, ``tid`` its
group), named by its tag, with its sequence number, size and step as
arguments. The Trainer adds its last steps on a lane of their own (``tid``
"step"): the wait for the batch, forward and backward, the optimizer; so the
collectives show against the compute they overlap. Times are wall-clock
microseconds, so the files of several ranks (and several nodes, whose clocks
NTP keeps close) load side by side.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.comm.ledger import LedgerEntry

__all__ = ["STEP_PHASES", "StepSpan", "trace_events", "write_trace"]

STEP_PHASES = ("data", "forward and backward", "optimizer")
"""The names of a step's spans in a trace, in order."""


@dataclass(frozen=True)
class StepSpan:
    """One training step on a rank, in wall-clock seconds: its batch awaited
    from ``fetched``, forward and backward from ``started``, the optimizer from
    ``optimizer``, until ``ended``."""

    step: int
    fetched: float
    started: float
    optimizer: float
    ended: float


def trace_events(entries: Iterable[LedgerEntry], rank: int, steps: Iterable[StepSpan] = ()) -> list[dict[str, Any]]:
    """The completed ``entries`` and the ``steps`` as Trace Event Format spans on rank ``rank``'s lane."""
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": rank,
                                     "args": {"name": f"rank {rank}"}}]
    for s in steps:
        bounds = (s.fetched, s.started, s.optimizer, s.ended)
        events += [{"name": name, "cat": "step", "ph": "X", "pid": rank, "tid": "step", "ts": begin * 1e6,
                    "dur": max(0.0, (end - begin) * 1e6), "args": {"step": s.step}}
                   for name, begin, end in zip(STEP_PHASES, bounds, bounds[1:])]
    for e in entries:
        if e.completed_at is None:
            continue
        events.append({"name": e.tag or e.op, "cat": e.op, "ph": "X", "pid": rank, "tid": e.group,
                       "ts": e.issued_at * 1e6, "dur": max(0.0, (e.completed_at - e.issued_at) * 1e6),
                       "args": {"seq": e.seq, "op": e.op, "numel": e.numel, "dtype": e.dtype, "bytes": e.nbytes,
                                "step": e.step}})
    return events


def write_trace(path: Path, entries: Iterable[LedgerEntry], rank: int, steps: Iterable[StepSpan] = ()) -> Path:
    """Write rank ``rank``'s collectives and steps to ``path`` (a JSON trace); returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"traceEvents": trace_events(entries, rank, steps), "displayTimeUnit": "ms"}))
    tmp.replace(path)
    return path
