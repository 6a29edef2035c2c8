"""Who created this process's default group, and what :func:`tandem.init`
added to it: the one module-level record of tandem.control (Note [who owns the
default group]). bootstrap.py (init, shutdown) and elastic_group.py (a new
generation's group) read and write it through the functions here."""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import weakref
from dataclasses import dataclass

import torch.distributed as dist

from tandem.comm.connections import Connection
from tandem.comm.exit import install_clean_exit
from tandem.control.membership import Membership
from tandem.comm.monitor import start_monitor
from tandem.comm.peers import DEFAULT_LIVENESS
from tandem.comm.world import WorldInfo

__all__ = ["GroupRecord", "current", "forget", "last", "start_watch", "stop_elastic_at_exit", "with_elastic"]


# Note [who owns the default group]
# tandem.init() either creates the default process group or adopts one that
# exists already; tandem.shutdown() destroys only a group tandem created, and
# leaves an adopted one as it found it (initialised, for its creator to destroy),
# taking away only what init() added: the monitor and the exit hook. torch
# records neither who created the group nor with which timeout, so init()
# records it in _membership (here), tandem.control's one module-level holder:
# which group (a weak reference, so that a group destroyed behind tandem's back is not
# mistaken for a later one), in which process (a forked child inherits the
# parent's memory, not its group), whether tandem created it, and the WorldInfo
# that init() returned, which a second init() returns again.

@dataclass(frozen=True)
class GroupRecord:
    """What :func:`init` did about this process's default group."""

    pid: int
    """The process that called :func:`init`."""
    group: weakref.ref[dist.ProcessGroup]
    """The default group it created or adopted."""
    owned: bool
    """Whether :func:`init` created the group (and :func:`shutdown` destroys it)."""
    info: WorldInfo
    """What :func:`init` returned."""
    timeout: datetime.timedelta | None
    """The timeout the group was created with; None for an adopted group (unknown)."""
    elastic: Membership | None = None
    """This process's place in an elastic job (Note [elastic membership] in
    membership.py), once it has one."""
    connections: tuple[Connection, ...] = ()
    """The group's gloo connections, when :func:`init` or a new generation made
    it: cut once it is left behind (Note [severing a forgotten group] in
    tandem/comm/connections.py)."""

    def is_current(self) -> bool:
        """Whether this is still this process's default group."""
        return (self.pid == os.getpid() and dist.is_initialized()
                and self.group() is dist.group.WORLD)


_membership: GroupRecord | None = None


def current() -> GroupRecord | None:
    """The record, when it is still about this process's default group."""
    return _membership if _membership is not None and _membership.is_current() else None


def last() -> GroupRecord | None:
    """The record, whichever group it is about (a group being replaced)."""
    return _membership


def forget() -> GroupRecord | None:
    """Drop the record; returns what it was."""
    global _membership
    member, _membership = _membership, None
    return member


def add_connections(connections: tuple[Connection, ...]) -> None:
    """Record the gloo connections of a further group over the default group's
    ranks (an elastic job's ``new_world_group``): they are cut with the default
    group's when a new generation leaves them behind (Note [severing a forgotten
    group] in tandem/comm/connections.py)."""
    global _membership
    if _membership is not None and connections:
        _membership = dataclasses.replace(_membership, connections=_membership.connections + connections)


def with_elastic(member: GroupRecord, elastic: Membership) -> None:
    """Record ``elastic`` as this process's place in an elastic job."""
    global _membership
    _membership = dataclasses.replace(member, elastic=elastic)


# Note [threads at exit]
# An elastic member beats from a daemon thread (Membership.start) into the job's
# store. Left running when the process ends, a beat in flight that returns while
# the interpreter finalizes takes the GIL, CPython ends the thread with
# pthread_exit inside torch's C++ frames, and the process dies with "terminate
# called without an active exception" (SIGABRT) after it finished training:
# seen in tests/launch/test_cluster_faults.py once the launcher counted such a
# crash as one (Note [a crash after finishing] in tandem/launch/elastic_agent.py).
# So the beat stops, and its thread is joined, at tandem.shutdown() and at the
# process's exit (atexit; after an uncaught exception too, Note [exit on an
# uncaught exception] in tandem/comm/exit.py), as the monitor's thread does; a
# beat still waiting for the store then is waited on before the interpreter
# finalizes (Note [a store call in flight at exit] in tandem/comm/thread_exit.py).

@atexit.register
def stop_elastic_at_exit() -> None:
    """Stop this process's elastic beat before the interpreter finalizes (Note [threads at exit])."""
    member = _membership
    if member is not None and member.elastic is not None and member.pid == os.getpid():
        member.elastic.stop()


def start_watch(info: WorldInfo, timeout_td: datetime.timedelta, *, owned: bool,
                 timeout: datetime.timedelta | None, elastic: Membership | None = None,
                 connections: tuple[Connection, ...] = ()) -> None:
    """What :func:`init` adds to a group it created or adopted, and the record of it."""
    global _membership
    monitor = start_monitor(timeout_s=timeout_td.total_seconds(),
                            liveness=elastic.liveness() if elastic is not None else DEFAULT_LIVENESS)
    if elastic is not None and monitor.peers is not None:
        monitor.peers.departed = elastic.departed  # Note [a peer gone to regroup] in tandem/comm/peers.py
        monitor.peers.judged = elastic.judged_ranks  # Note [a watch reads the verdict] there
    install_clean_exit()  # Note [exit on an uncaught exception] in tandem.comm.exit
    group = dist.group.WORLD
    assert group is not None, "the default group is initialised"
    _membership = GroupRecord(pid=os.getpid(), group=weakref.ref(group), owned=owned,
                              info=info, timeout=timeout, elastic=elastic, connections=connections)
