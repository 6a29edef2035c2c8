"""Which process a rank is, and whether it has ended: :class:`ProcessId` and
the launcher's exit notices.

# Note [deaths seen at once]
A heartbeat says a process is gone only after a window of silence (Note [dead
peers] in peers.py), and that window cannot be short: a rank that is only slow
(a pause of seconds, a long batch, a stopped process) must not be counted dead.
But most deaths are not silences. A killed worker's process has ended, and two
parties can tell at once:

- a peer on the same kernel: each rank posts its :class:`ProcessId` (the
  kernel's boot id and pid namespace, the pid, and the process's start time)
  in the job's store when it starts watching; a peer whose id is of this
  kernel is gone when ``/proc/<pid>`` is gone, a zombie, or another process
  (the start time differs: the pid was reused). A stopped process (SIGSTOP,
  state ``T``) is alive;
- its launcher, on any host: ``tandem run --elastic`` polls its workers'
  exit codes every ``--monitor-interval`` (0.1 s), and when one has ended it
  writes an exit notice under :func:`exit_notice_key` (below every prefix of
  the workers' store, where the id's kernel and pid name it).

Each says how the process ended where it can (:func:`exit_words`): a zombie's
exit status is in its ``/proc/<pid>/stat``, and the launcher has the code;
a process already reaped on this kernel has left no status, and then its
launcher's notice, when there is one, says more.

Under ``tandem run --elastic`` the launcher also beats for its node
(:class:`NodeBeat`, under :func:`node_beat_key`): the wall-clock time and the
pids of its workers that have ended, rewritten at once when one ends. Its
workers (``TANDEM_NODE`` names the node) do not beat themselves, so the store
hears one beat per node, not one per rank, and whoever reads the node's beat
learns of a worker's end from it (Note [judge once] in tandem/control/judge.py).

Whoever judges a peer (a collective's wait: :class:`~tandem.comm.peers.PeerWatch`;
an elastic member: :class:`~tandem.control.membership.Membership`) asks these first
and the heartbeat after, so a death is seen within a wait slice or a store poll,
while the heartbeat window only decides the deaths nobody saw: a host lost with
its launcher, a link cut.
"""

from __future__ import annotations

import functools
import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from tandem.comm.cut_off import CUT_OFF_EXITCODE
from tandem.store.job_secret import SignedStore, signed_like

__all__ = ["NODE_ENV", "NodeBeat", "PostedProcesses", "ProcessId", "below_prefixes", "exit_notice", "exit_notice_key",
           "exit_words", "launcher_node", "node_beat_key", "write_exit_notice"]

_NOTICES = "tandem/exited"
_NODE_BEATS = "tandem/node"
NODE_ENV = "TANDEM_NODE"
"""Set by ``tandem run --elastic`` for its workers: the node whose launcher beats for them."""


@functools.cache
def _this_kernel() -> str | None:
    """The boot id and pid namespace of this process: processes with the same
    one see each other's pids (None where /proc cannot tell)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    inode = namespace[namespace.find("[") + 1:namespace.rfind("]")]
    return f"{boot}-{inode}"


def _stat(pid: int) -> tuple[str, int, int] | None:
    """A process's state letter, start time (clock ticks after boot) and exit
    status (as ``waitpid`` gives it: 0 while it runs, or where the kernel does
    not show it), or None if it has none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # after the command name, which may hold spaces
    status = int(fields[49]) if len(fields) > 49 else 0  # field 52, exit_code: Linux 3.5 and later
    return fields[0], int(fields[19]), status


def exit_words(code: int) -> str:
    """How a process that ended with ``code`` ended, in words: ``code`` as
    ``Popen.returncode`` has it (negative: killed by that signal)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == CUT_OFF_EXITCODE:
        return f"stopped, cut off from the job's store (exit code {code})"
    return f"exited with code {code}"


@dataclass(frozen=True)
class ProcessId:
    """One process, named so that it cannot be mistaken for a later one."""

    kernel: str
    """The boot id and pid namespace it runs in."""
    pid: int
    started: int
    """Its start time, in clock ticks after boot."""

    @classmethod
    def this_process(cls) -> ProcessId | None:
        return cls.of(os.getpid())

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        """The process ``pid`` of this kernel, or None where /proc cannot tell."""
        kernel, stat = _this_kernel(), _stat(pid)
        if kernel is None or stat is None:
            return None
        return cls(kernel, pid, stat[1])

    def encode(self) -> str:
        return f"{self.kernel} {self.pid} {self.started}"

    @classmethod
    def decode(cls, text: str) -> ProcessId:
        kernel, pid, started = text.split()
        return cls(kernel, int(pid), int(started))

    def ended_here(self) -> str | None:
        """Why this process has ended, where this kernel can tell (Note [deaths
        seen at once]); None when it runs, or runs on another kernel."""
        end = self._end_here()
        return end[0] if end is not None else None

    def _end_here(self) -> tuple[str, bool] | None:
        """:meth:`ended_here`, and whether it says how the process ended."""
        if self.kernel != _this_kernel():
            return None
        stat = _stat(self.pid)
        if stat is None or stat[1] != self.started:
            return f"its process (pid {self.pid}) has ended", False  # reaped: no status left
        if stat[0] not in ("Z", "X"):
            return None
        if stat[2] == 0:  # exited with 0, or the kernel does not show this reader
            return f"its process (pid {self.pid}) has exited", False
        return f"its process (pid {self.pid}) {exit_words(os.waitstatus_to_exitcode(stat[2]))}", True

    def ended(self, store: dist.Store) -> str | None:
        """Why this process has ended, from this kernel or from its launcher's
        notice in ``store`` (the job's, below every prefix), whichever says how;
        None when neither says it has."""
        here = self._end_here()
        if here is not None and here[1]:
            return here[0]
        return exit_notice(store, self) or (here[0] if here is not None else None)


def exit_notice_key(kernel: str, pid: int) -> str:
    return f"{_NOTICES}/{kernel}/{pid}"


def exit_notice(store: dist.Store, process: ProcessId) -> str | None:
    """What ``process``'s launcher wrote when it saw the process end, or None."""
    key = exit_notice_key(process.kernel, process.pid)
    if not store.check([key]):
        return None
    return store.get(key).decode()


def write_exit_notice(store: dist.Store, pid: int, what: str) -> None:
    """The launcher's side: its worker ``pid`` (a child, so of this kernel) has ended (``what``)."""
    kernel = _this_kernel()
    if kernel is not None:
        store.set(exit_notice_key(kernel, pid), what)


def launcher_node() -> str | None:
    """The node whose launcher beats for this process (``TANDEM_NODE``), or None."""
    return os.environ.get(NODE_ENV) or None


def node_beat_key(node: str) -> str:
    return f"{_NODE_BEATS}/{node}"


@dataclass(frozen=True)
class NodeBeat:
    """A node launcher's beat: when it beat (wall-clock seconds), and its workers
    that have ended (pid -> how, in words)."""

    at: float
    ended: dict[int, str]

    def encode(self) -> str:
        return json.dumps({"at": self.at, "ended": {str(pid): what for pid, what in self.ended.items()}})

    @classmethod
    def decode(cls, raw: bytes) -> NodeBeat | None:
        """The beat in ``raw``; None for junk (Note [a stranger asks to join] in tandem/control/join_requests.py)."""
        try:
            value = json.loads(bytes(raw).decode())
            return cls(float(value["at"]), {int(pid): str(what) for pid, what in dict(value["ended"]).items()})
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
            return None


def below_prefixes(store: dist.Store) -> dist.Store:
    """The store below every :class:`~torch.distributed.PrefixStore` of ``store``
    (signing as ``store`` does: Note [signed store] in tandem/store/job_secret.py)."""
    base = store.inner if isinstance(store, SignedStore) else store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    return signed_like(store, base)


class PostedProcesses:
    """The :class:`ProcessId` each peer posted in ``store`` under ``key(peer)``,
    read once, when posted, and asked whether it has ended (Note [deaths seen
    at once]): a collective's watch keys them by rank, the membership by member."""

    def __init__(self, store: dist.Store, key: Callable[[Any], str]) -> None:
        self._store = store
        # Exit notices are the launcher's, written below the prefixes, signed under a
        # job secret (Note [signed store] in tandem/store/job_secret.py).
        self._notices = below_prefixes(store)
        self._key = key
        self._posted: dict[Any, ProcessId] = {}

    def ended(self, peer: Any) -> str | None:
        """Why ``peer``'s process has ended, where its kernel or launcher can tell;
        None when it runs, or has posted no id yet."""
        process = self._posted.get(peer)
        if process is None:
            key = self._key(peer)
            if not self._store.check([key]):
                return None
            process = self._posted[peer] = ProcessId.decode(self._store.get(key).decode())
        return process.ended(self._notices)
