"""One checkpoint write at a time on a thread of its own, its outcome reported
on the caller's thread (Note [saves in the background] in
tandem/train/background_saves.py says what runs where).

The pair is :meth:`BackgroundWrite.launch` / :meth:`BackgroundWrite.finish`:
``launch`` starts a write, ``finish`` joins it and raises its error, on every
rank when several ranks launched together (the outcome is agreed in one small
gather, on the caller's thread, so that a write that failed on rank 0 alone
fails every rank at the same point). A launch while a write is unfinished is a
wrong call order: the caller finishes first, which is what keeps at most one
write in flight.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from enum import Enum, auto
from pathlib import Path

import torch
import torch.distributed as dist

from tandem.checkpoint.agree import describe, gather, group_comm, raise_failures
from tandem.checkpoint.steps import CheckpointError

__all__ = ["BackgroundWrite", "WriteState", "WRITER_THREAD"]

logger = logging.getLogger(__name__)

WRITER_THREAD = "tandem-checkpoint-writer"
"""The writer thread's name (what a stack dump shows, and what tests look for)."""


class WriteState(Enum):
    IDLE = auto()       # nothing launched since the last finish
    WRITING = auto()    # launched: the thread may still be writing
    FINISHED = auto()   # joined; its outcome not yet reported by finish()


class BackgroundWrite:
    """At most one write in flight, on a thread named :data:`WRITER_THREAD`.

    Args:
        rank: this rank, for messages.
        group: the group whose ranks launch together and agree on the outcome
            in :meth:`finish` (None: the default group; none needed without
            torch.distributed).
    """

    def __init__(self, rank: int, group: dist.ProcessGroup | None = None) -> None:
        self.rank, self._group = rank, group
        self.state = WriteState.IDLE
        self.path: Path | None = None
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None

    def launch(self, path: Path, write: Callable[[], None] | None) -> None:
        """Start ``write()`` on the writer thread; ``path`` names what it writes.
        None: this rank has nothing to write (another rank writes ``path``), but
        it still agrees on the outcome in :meth:`finish`.

        Raises:
            RuntimeError: a write is launched and not finished.
        """
        self._expect(WriteState.IDLE)
        self.path, self._error, self.state = path, None, WriteState.WRITING
        if write is None:
            return
        self._thread = threading.Thread(target=self._run, args=(write,), name=WRITER_THREAD, daemon=True)
        self._thread.start()
        logger.debug("rank %d: writing %s in the background", self.rank, path)

    def join(self) -> None:
        """Wait for the write in flight, if any, without reporting its outcome
        (no communication: safe on an error path)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.state is WriteState.WRITING:
            self.state = WriteState.FINISHED

    def finish(self) -> Path | None:
        """Wait for the write in flight and agree on its outcome with the other
        ranks (a collective when something was launched: call it on every rank
        at the same point). Returns the path written, None when nothing was
        launched.

        Raises:
            CheckpointError: on every rank when any rank's write failed, naming
                the path, the rank and its error (a rank whose own write failed
                raises that, as the cause).
        """
        if self.state is WriteState.IDLE:
            return None
        self.join()
        path, error = self.path, self._error
        self.state, self.path, self._error = WriteState.IDLE, None, None
        own = None if error is None else CheckpointError(
            f"rank {self.rank}: the background save of {path} failed: {describe(error)}")
        if own is not None:
            own.__cause__ = error
        comm = group_comm(self._group)
        if comm is not None and comm.size > 1:
            # One flag, not the messages: the messages are gathered only when a write failed.
            failed = torch.tensor([0 if error is None else 1], device=comm.device)
            comm.all_reduce(failed, tag="background checkpoint")
            if failed.item():
                outcomes = gather(comm, {"error": describe(error)}, "background checkpoint errors")
                raise_failures(self.rank, outcomes, own, f"the background save of {path} failed", CheckpointError)
        if own is not None:
            raise own
        return path

    def abandon(self) -> None:
        """On an error path: wait for the write in flight, log (not raise) its
        error, and forget it. No communication."""
        if self.state is WriteState.IDLE:
            return
        self.join()
        if self._error is not None:
            logger.warning("rank %d: the background save of %s failed too: %s", self.rank, self.path,
                           describe(self._error))
        self.state, self.path, self._error = WriteState.IDLE, None, None

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as e:  # reported on the caller's thread by finish()
            self._error = e if isinstance(e, Exception) else RuntimeError(f"{type(e).__name__} in the writer")
            logger.debug("rank %d: the background save of %s failed: %s", self.rank, self.path, e)

    def _expect(self, *allowed: WriteState) -> None:
        if self.state not in allowed:
            raise RuntimeError(f"rank {self.rank}: the background write of {self.path} is {self.state.name}, "
                               f"expected {'/'.join(s.name for s in allowed)}; call finish() before the "
                               "next launch()")
