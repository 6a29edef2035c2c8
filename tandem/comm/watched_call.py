"""A ``torch.distributed`` call of the default group that a dead peer cannot
hold forever: :func:`watched`.

# Note [watched object collectives]
tandem's own collectives wait in slices and watch the peers between them (Note
[dead peers] in peers.py). torch's object collectives (``all_gather_object``,
``broadcast_object_list``) cannot: they wait inside, with no timeout shorter
than the group's. In an elastic job's rebuild that is a hang, not a slow
error: a replacement receiving the state in ``all_gather_object`` waits on a
member that is alive but has left the collective (it saw another member die
and went to regroup), and the members wait in the regroup for the replacement
to arrive or die, both sides until the regroup's timeout. So the elastic paths run those calls through
:func:`watched`: the call runs in a thread of its own, and this thread waits on
it in slices as on any collective, so a peer that died is named within a slice
(:class:`~tandem.comm.peers.PeerLostError`) and the rebuild fails over to the
next regroup, or the replacement leaves. A call abandoned that way stays
blocked in its thread, in a group that is forgotten (Note [elastic default
group] in tandem/control/elastic_group.py), until the next world change cuts
that group's connections; its wait is among the threaded waits in flight that
the interpreter lets return before it finalizes (Note [severing a forgotten
group] in connections.py).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from tandem.comm.monitor import current_monitor_if_any
from tandem.comm.peers import ThreadedWait, wait_watching_peers

__all__ = ["watched"]

T = TypeVar("T")


class _Call:
    """A call as a work: waiting on it runs it (in :class:`ThreadedWait`'s thread)."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self._call = call
        self.result: Any = None

    def wait(self) -> bool:
        self.result = self._call()
        return True


def watched(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, a collective of every rank of the default gloo
    group, waited on watching the peers (Note [watched object collectives]);
    ``what`` names it in an error. Without a gloo group and a watch, a plain call."""
    monitor = current_monitor_if_any()
    watch = monitor.peers if monitor is not None else None
    if watch is None or not dist.is_initialized() or dist.get_backend() != "gloo":
        return fn(*args, **kwargs)
    call = _Call(functools.partial(fn, *args, **kwargs))
    work = ThreadedWait(call)
    threading.Thread(target=work.run, name="tandem-watched-call", daemon=True).start()
    wait_watching_peers(work, watch, list(range(dist.get_world_size())), lambda: what)
    return call.result  # type: ignore[no-any-return]
