"""The workers' output on the launcher's console: :class:`RankOutput`.

Each worker writes to its own files (:mod:`tandem.launch.logs`); one thread here
follows them and copies every complete line to the launcher's stdout or stderr
with the worker's global rank in front, flushing after each line::

    [rank 0] step 10 loss 0.52
    [rank 1] step 10 loss 0.49

Under ``tandem run --elastic`` a worker's rank changes with the world (a rank
before it is lost, a replacement admitted last): the prefix follows, read from
the rank the worker's monitor writes in its progress file (Note [progress
without a collective] in watchdog.py), so that ``[rank 1]`` is the process that
``dist.get_rank()`` calls 1 now. The rank filters go by the rank a worker was
launched as (a replacement: the rank of the worker it replaced).

A line is printed only once its newline has arrived, so lines of different
ranks never interleave mid-line (torch's own log tailer prints a half-written
line with a prefix and its rest with another). Output can be limited to chosen
ranks; the log files always hold everything.

# Note [carriage returns]
A progress bar redraws one line with ``\r``. A line is printed as a terminal
would show it, the text after its last ``\r``, so a log or a pipe gets the
bar's final state and the messages written over it, not kilobytes of redraws.
When the launcher's own output is a terminal, each redraw is also shown as it
arrives (``\r`` and the prefix, on the same line), so bars move under
``tandem run`` as they do under ``python``; workers learn that their output
ends on a terminal from ``TANDEM_STDOUT_ISATTY=1``.

# Note [C++ backtraces]
torch logs some C++ warnings with the backtrace of the error behind them: a
store call to a host that is gone prints "[c10d] sendBytes failed ...:
Broken pipe", then "Exception raised from ..." and some twenty ``frame #N``
lines, once for each connection that finds it gone. On the console a rank
that has lost its job would bury the one line that says why under them. So
the console shows each such warning's first line and leaves the backtrace
out (:func:`without_backtraces`); the rank's log keeps every line.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO

from tandem.launch.logs import Attempt, RankLogs

__all__ = ["RankOutput", "is_terminal", "rank_prefix", "split_lines", "visible_text", "without_backtraces"]

_POLL_S = 0.05
_CHUNK = 1 << 16
# A "line" this long without a newline (a progress bar redrawn with \r, say) is
# printed as it is rather than held back without bound.
_MAX_PENDING = 1 << 16


def rank_prefix(rank: int, world_size: int) -> str:
    """``"[rank 3] "``, the rank right-aligned to the width of the largest rank."""
    width = len(str(max(world_size - 1, 0)))
    return f"[rank {rank:>{width}}] "


def split_lines(pending: bytes, chunk: bytes) -> tuple[list[bytes], bytes]:
    """Append ``chunk`` to ``pending``; return the complete lines (without their
    newline) and what is left of an unfinished last line."""
    data = pending + chunk
    *lines, rest = data.split(b"\n")
    return lines, rest


_BACKTRACE_START = re.compile(rb"^(\[rank\d+\]:)?Exception raised from .* \(most recent call first\):$")
_BACKTRACE_LINE = re.compile(rb"^(\[rank\d+\]:)?(frame #\d+: .*|<omitting python frames>)$")


def without_backtraces(lines: list[bytes], inside: bool) -> tuple[list[bytes], bool]:
    """``lines`` without the C++ backtraces torch logs after some warnings (Note
    [C++ backtraces]): from "Exception raised from ..." through its frames and
    the empty line after them. ``inside``: the previous lines ended inside
    one; returns whether these do."""
    kept = []
    for line in lines:
        if inside and _BACKTRACE_LINE.match(line):
            continue
        if inside and not line.strip():
            inside = False
            continue
        inside = bool(_BACKTRACE_START.match(line))
        if not inside:
            kept.append(line)
    return kept, inside


def visible_text(line: bytes) -> bytes:
    """What a terminal shows of ``line``: its last non-empty ``\r`` segment
    (see Note [carriage returns])."""
    for segment in reversed(line.split(b"\r")):
        if segment:
            return segment
    return b""


@dataclass
class _Follow:
    path: Path
    dst: TextIO
    prefix: str
    progress: Path | None = None  # where the worker's current rank is read (elastic)
    world_size: int = 1  # of the launch, for the prefix's width
    progress_read: float = 0.0  # the progress file's mtime when its rank was read
    fp: BinaryIO | None = None
    pending: bytes = b""
    redrawn: bytes = b""  # the redraw last shown live, for a terminal
    in_backtrace: bool = False  # the last line shown was inside a C++ backtrace (Note [C++ backtraces])


class RankOutput:
    """Copies the workers' output to ``stdout``/``stderr`` with rank prefixes.

    Args:
        stdout: where the workers' stdout lines go (the launcher's stdout).
        stderr: where their stderr lines go.
        ranks: only these global ranks are shown; None shows all.
        local_ranks: only these local ranks are shown; None shows all.

    :meth:`follow` is the ``on_attempt`` callback of
    :class:`tandem.launch.logs.WorkerLogs`, :meth:`follow_replacement` its
    ``on_replacement``; call :meth:`start` before the job
    and :meth:`stop` after it, which prints whatever is left.
    """

    def __init__(self, stdout: TextIO, stderr: TextIO, *, ranks: frozenset[int] | None = None,
                 local_ranks: frozenset[int] | None = None) -> None:
        self._stdout = stdout
        self._stderr = stderr
        self._ranks = ranks
        self._local_ranks = local_ranks
        self._lock = threading.Lock()
        self._follows: list[_Follow] = []
        self._retired: list[_Follow] = []
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._broken = False
        self._live: dict[int, _Follow] = {}  # id(dst) -> the follow whose redraw ends it

    def follow(self, attempt: Attempt) -> None:
        """Show ``attempt``'s workers from now on. The previous attempt's workers
        have exited by the time the agent starts the next, so its files are
        read to the end and closed."""
        new = [
            _Follow(path, dst, rank_prefix(rank, attempt.world_size), logs.progress, attempt.world_size)
            for rank, logs in sorted(attempt.ranks.items()) if self._shows(logs)
            for path, dst in ((logs.stdout, self._stdout), (logs.stderr, self._stderr))
        ]
        with self._lock:
            self._retired.extend(self._follows)
            self._follows = new

    def follow_replacement(self, logs: RankLogs, world_size: int) -> None:
        """Show a replacement worker (``tandem run --elastic``) from now on, under
        the rank of the worker it replaces, beside the attempt's other workers;
        the ``on_replacement`` callback of :class:`tandem.launch.logs.WorkerLogs`."""
        if not self._shows(logs):
            return
        prefix = rank_prefix(logs.rank, world_size)
        with self._lock:
            self._follows += [_Follow(logs.stdout, self._stdout, prefix, logs.progress, world_size),
                              _Follow(logs.stderr, self._stderr, prefix, logs.progress, world_size)]

    def _shows(self, logs: RankLogs) -> bool:
        """Whether the rank filters let this worker's output through."""
        return ((self._ranks is None or logs.rank in self._ranks)
                and (self._local_ranks is None or logs.local_rank in self._local_ranks))

    def start(self) -> RankOutput:
        self._thread = threading.Thread(target=self._run, name="tandem-output", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Print everything that is left, unfinished last lines included, and stop."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            follows = self._retired + self._follows
            self._retired, self._follows = [], []
        for f in follows:
            self._drain(f)

    def _run(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                retired, self._retired = self._retired, []
                follows = list(self._follows)
            for f in retired:
                self._drain(f)
            for f in follows:
                _follow_rank(f)
            for f in follows:
                self._pump(f)
            self._stopping.wait(_POLL_S)

    def _pump(self, f: _Follow) -> None:
        if f.fp is None:
            try:
                f.fp = open(f.path, "rb")  # noqa: SIM115 (kept open while the worker writes)
            except FileNotFoundError:
                return  # the worker has not started yet
        for chunk in _read_available(f.fp):
            lines, f.pending = split_lines(f.pending, chunk)
            # Only the latest redraw of an unfinished line matters. (A writer like tqdm
            # writes each redraw in one call, so it is rarely read in halves.)
            cut = f.pending.rfind(b"\r")
            if cut >= 0:
                self._redraw(f, visible_text(f.pending))
                f.pending = f.pending[cut:]
            if len(f.pending) > _MAX_PENDING:
                lines.append(f.pending)
                f.pending = b""
            self._emit(f, lines)

    def _drain(self, f: _Follow) -> None:
        self._pump(f)
        if f.pending:
            self._emit(f, [f.pending])
            f.pending = b""
        if f.fp is not None:
            f.fp.close()
            f.fp = None

    def _redraw(self, f: _Follow, segment: bytes) -> None:
        """Show a progress bar's latest state in place, on a terminal only."""
        if not segment or segment == f.redrawn or not is_terminal(f.dst):
            return
        f.redrawn = segment
        self._write(f, f"\r{f.prefix}{segment.decode(errors='replace')}\x1b[K", live=True)

    def _emit(self, f: _Follow, lines: list[bytes]) -> None:
        lines, f.in_backtrace = without_backtraces(lines, f.in_backtrace)
        if not lines:
            return
        text = "".join(f"{f.prefix}{visible_text(line).decode(errors='replace')}\n" for line in lines)
        if f.redrawn:  # the first line replaces the bar drawn in place
            text = "\r" + text.replace("\n", "\x1b[K\n", 1)
            f.redrawn = b""
        self._write(f, text, live=False)

    def _write(self, f: _Follow, text: str, *, live: bool) -> None:
        if self._broken:
            return
        other = self._live.get(id(f.dst))
        if other is not None and other is not f:
            text = "\n" + text  # leave another rank's bar on a line of its own
            other.redrawn = b""
        if live:
            self._live[id(f.dst)] = f
        else:
            self._live.pop(id(f.dst), None)
        try:
            f.dst.write(text)
            f.dst.flush()
        except (BrokenPipeError, ValueError):
            # The console went away (a closed pipe): the log files still have everything.
            self._broken = True


def _follow_rank(f: _Follow) -> None:
    """Prefix ``f``'s lines with the rank its worker has now (see the module's
    docstring), when its progress file says."""
    if f.progress is None:
        return
    try:
        written = f.progress.stat().st_mtime
        if written == f.progress_read:
            return
        rank = json.loads(f.progress.read_text())["rank"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # not written yet: the prefix stays
    f.progress_read = written
    if isinstance(rank, int):
        f.prefix = rank_prefix(rank, f.world_size)


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal (False for closed or file-less streams)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _read_available(fp: BinaryIO) -> Iterator[bytes]:
    while True:
        chunk = fp.read(_CHUNK)
        if not chunk:
            return
        yield chunk
