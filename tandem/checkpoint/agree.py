"""Agreement between ranks on the outcome of local work: a failure on any rank
becomes an error on every rank, instead of one rank raising and the others
waiting in their next collective until the timeout.

Each step of a checkpoint runs its local work through :func:`attempt` (which
returns the exception rather than raising it, so that the rank still reaches the
gather), gathers the outcomes, then :func:`raise_failures` raises on every rank.
Without torch.distributed (one process) the gather is the process's own outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from tandem.comm.group import GroupComm

__all__ = ["agree", "attempt", "describe", "gather", "group_comm", "raise_failures"]

T = TypeVar("T")


def group_comm(group: dist.ProcessGroup | None) -> GroupComm | None:
    """The group's collectives, or None in a process without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return GroupComm(group)
    return None


def gather(comm: GroupComm | None, obj: dict[str, Any], tag: str) -> list[dict[str, Any]]:
    """Every rank's ``obj``, in rank order."""
    return [obj] if comm is None else comm.all_gather_object(obj, tag=tag)


def attempt(fn: Callable[[], Any]) -> Exception | None:
    """Run ``fn``, returning its exception rather than raising it."""
    try:
        fn()
    except Exception as e:
        return e
    return None


def describe(error: Exception | None) -> str | None:
    """An exception as one line for the gather (None for no exception)."""
    return None if error is None else f"{type(error).__name__}: {error}"


def raise_failures(rank: int, outcomes: list[dict[str, Any]], own: Exception | None, what: str,
                   error_type: type[Exception]) -> None:
    """Raise if any rank's outcome has an ``error``: this rank's own exception when
    it failed itself, else ``error_type`` naming the ranks that failed and why."""
    if own is not None:
        raise own
    ranks_of: dict[str, list[int]] = {}
    for r, o in enumerate(outcomes):
        if o["error"] is not None:
            ranks_of.setdefault(o["error"], []).append(r)
    if ranks_of:
        reasons = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {e}"
                            for e, rs in ranks_of.items())
        raise error_type(f"rank {rank}: {what}: {reasons}")


def agree(fn: Callable[[], T], *, what: str, error_type: type[Exception],
          group: dist.ProcessGroup | None = None) -> T:
    """Run ``fn`` on this rank and return its result once every rank's call
    succeeded; if any failed, raise on every rank (:func:`raise_failures`). A
    collective: call it on every rank."""
    result: list[T] = []
    comm = group_comm(group)
    error = attempt(lambda: result.append(fn()))
    outcomes = gather(comm, {"error": describe(error)}, what)
    raise_failures(comm.rank if comm else 0, outcomes, error, what, error_type)
    return result[0]
