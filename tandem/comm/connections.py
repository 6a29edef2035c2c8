"""A gloo group's connections, and how to end what is blocked on them:
:func:`opened_connections` and :func:`sever`.

# Note [severing a forgotten group]
An elastic job forgets its old default group rather than destroying it (Note
[elastic default group] in tandem/control/elastic_group.py): gloo cannot cancel a collective
(``abort`` and ``shutdown`` leave work in flight as it is, torch 2.4 to 2.13),
so destroying the group would join a worker thread blocked in a collective
with a peer that is alive but has left it. Such a collective ends only at the
group's timeout (10 minutes) or when the peer's connection closes, in practice
when the peer's process exits: at the end of the job, as this one exits too.
Whatever waits on it then comes back from torch: tandem's waiter thread of a
gloo reduce-scatter (whose wait ignores a timeout) or of a send or receive
(Note [late peers] in p2p.py), the thread of an object collective (Note
[watched object collectives] in watched_call.py), or a callback that gloo's
worker thread runs on the collective's future. If this process is finalizing
by then, CPython ends that thread with ``pthread_exit`` when it takes the GIL;
the forced unwind meets a ``noexcept`` frame (pybind11's ``gil_scoped_release``
destructor) and libstdc++ calls ``std::terminate``: SIGABRT, "terminate called
without an active exception", after the process finished training. gdb on the
core (tests/control/test_forgotten_group.py before this fix): the main thread in
``Py_FinalizeEx``; the aborting thread, a Python thread, in ``Work.wait`` ->
``~gil_scoped_release`` -> ``PyEval_RestoreThread`` -> ``take_gil`` ->
``PyThread_exit_thread`` -> ``pthread_exit`` -> ``_Unwind_ForcedUnwind`` ->
``std::terminate``.

So the members of a new generation cut the old group's connections once they
all stand in the new one (:func:`~tandem.control.elastic_group.enter_generation`):
each shuts down its own sockets of the old group, and whatever is blocked in
it, on this rank or on a peer, fails at once with "connection closed" while
the process is alive. Nothing still needs the old group then: every member of
the new world got that far, so each has finished (or given up) its collectives
in the old one, and the members that are not in the new world are dead. A
group's sockets are the connected TCP sockets that its creation opened
(:func:`opened_connections`; a group built ahead records them on its build's
thread, as it was built before it was taken), the store's left out; each is recorded with its
inode, so that a number that gloo closed (a dead peer's pair) and the kernel
reused is not touched. The group's listening socket is left alone: gloo's
accept loop aborts the process when accept fails. Sockets are read from
``/proc/self/fd`` (Linux); elsewhere nothing is recorded or cut. A further
group an elastic job builds over every member (fully_shard's reduce-scatter
group, ``new_world_group`` in tandem/control/elastic_group.py) is recorded with the default
group, and cut with it. Other groups (``new_group``, an adopted group) are not
recorded.

"At once" is a moment: the wait that fails must still be scheduled and take
the GIL, and a script that ends right after the world change (its last step)
can reach finalization first, with the same SIGABRT. So the cut also has the
interpreter wait, at exit and for a few seconds at most, for tandem's threaded
waits that were in flight when it was made
(:func:`~tandem.comm.peers.drain_at_exit`): by then they have long
returned, and nothing waits.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Connection", "opened_connections", "sever"]

logger = logging.getLogger(__name__)

_FDS = "/proc/self/fd"


@dataclass(frozen=True)
class Connection:
    """One connected TCP socket of a group, as it was when the group was made."""

    fd: int
    inode: int
    ports: tuple[int, int]
    """This end's port and the peer's."""


def _sockets() -> dict[int, int]:
    """This process's open sockets: file descriptor -> inode."""
    try:
        names = os.listdir(_FDS)
    except OSError:
        return {}
    found = {}
    for name in names:
        try:
            st = os.stat(f"{_FDS}/{name}")
        except OSError:
            continue  # closed since the listing (the listing's own descriptor, too)
        if stat.S_ISSOCK(st.st_mode):
            found[int(name)] = st.st_ino
    return found


def _is_same(connection: Connection) -> bool:
    try:
        st = os.fstat(connection.fd)
    except OSError:
        return False
    return stat.S_ISSOCK(st.st_mode) and st.st_ino == connection.inode


def _connected_tcp(fd: int, inode: int) -> Connection | None:
    """``fd`` as a :class:`Connection` if it is a connected TCP socket."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return None
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return None  # a listener: Note [severing a forgotten group]
        return Connection(fd, inode, (sock.getsockname()[1], sock.getpeername()[1]))
    except OSError:
        return None  # not connected
    finally:
        sock.close()


@contextlib.contextmanager
def opened_connections() -> Iterator[list[Connection]]:
    """The connected TCP sockets opened inside the ``with`` block, appended to
    the list it yields when the block ends: around a gloo group's creation,
    its connections to the other ranks (Note [severing a forgotten group]).
    A block that creates a TCP store too has the store's connections among
    them: leave those out by their port (:attr:`Connection.ports`).
    """
    before = _sockets()
    opened: list[Connection] = []
    yield opened
    for fd, inode in _sockets().items():
        if before.get(fd) != inode:
            connection = _connected_tcp(fd, inode)
            if connection is not None:
                opened.append(connection)


def sever(connections: tuple[Connection, ...]) -> int:
    """Shut down each of ``connections`` that is still the socket it was: what
    is blocked on it, here and on its peer, fails at once (Note [severing a
    forgotten group]). Returns how many were shut down."""
    done = 0
    for connection in connections:
        if not _is_same(connection):
            continue
        try:
            sock = socket.socket(fileno=os.dup(connection.fd))
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError as e:
            if e.errno != errno.ENOTCONN:  # already closed by the peer: nothing to end
                logger.debug("could not shut down socket %d: %s", connection.fd, e)
        finally:
            sock.close()  # the duplicate; gloo's descriptor stays open
    return done
