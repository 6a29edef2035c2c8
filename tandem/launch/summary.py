"""The few lines the launcher ends with when a worker fails: :func:`failure_summary`.

Which rank failed first, on which host, how it ended (exit code or signal), the
last lines of its traceback and where its full log is; the ranks that went down
with it on one line. Not the elastic agent's pages of records.

The rank that failed first is the one that stopped writing first: a rank that
raises prints its traceback and exits, and only then do its peers notice
("connection closed by peer") and write theirs, or get stopped by the agent
with SIGTERM. So failures are ordered by "stopped by the launcher" and then by
the time of the last write to their stderr.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.comm.cut_off import CUT_OFF_EXITCODE
from tandem.launch.logs import Attempt

__all__ = ["Failure", "collect_failures", "failure_summary", "format_summary", "in_order_of_failure",
           "traceback_tail"]

TRACEBACK_LINES = 8
"""At most this many lines of the failing rank's traceback are shown."""
_OTHERS_SHOWN = 4
_TORCH_RANK_PREFIX = re.compile(r"(?m)^\[rank\d+\]: ?")
_LINE_CHARS = 400


@dataclass(frozen=True, kw_only=True)
class Failure:
    """One worker that did not exit with 0."""

    rank: int
    """Global rank."""
    local_rank: int
    """Rank on its node."""
    host: str
    """The node it ran on."""
    exitcode: int
    """Its exit status; negative: killed by that signal."""
    text: str
    """Its whole last traceback (from its error file or stderr), or its stderr
    when it printed none."""
    log: Path | None
    """Its full stderr log."""
    last_write: float
    """When it last wrote to stderr (seconds since the epoch; 0 if never)."""

    @property
    def traceback(self) -> tuple[str, ...]:
        """The last lines of :attr:`text` (see :func:`traceback_tail`)."""
        return traceback_tail(self.text)

    @property
    def how(self) -> str:
        """``"exit code 1"`` or ``"signal SIGKILL"``."""
        if self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            return f"signal {name}"
        if self.exitcode == CUT_OFF_EXITCODE:
            return f"exit code {self.exitcode} (cut off from the job's store)"
        return f"exit code {self.exitcode}"

    @property
    def stopped_by_launcher(self) -> bool:
        """SIGTERM: how the agent stops the rest of the group after a failure."""
        return self.exitcode == -signal.SIGTERM


def traceback_tail(text: str, max_lines: int = TRACEBACK_LINES) -> tuple[str, ...]:
    """The last ``max_lines`` lines of the last Python traceback in ``text``; with
    no traceback, the last few non-empty lines (a crash message, say)."""
    lines = [line.rstrip()[:_LINE_CHARS] for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call")]
    block = lines[starts[-1]:] if starts else [line for line in lines if line.strip()]
    while block and not block[-1].strip():
        block.pop()
    if starts and len(block) > max_lines:
        return (block[0], "  ...", *block[-(max_lines - 2):])
    return tuple(block[-max_lines:])


def collect_failures(failures: Mapping[int, Any], attempt: Attempt | None, *,
                     host: str) -> list[Failure]:
    """Turn the elastic agent's failures (global rank to ``ProcessFailure``; only
    ``exitcode`` and ``local_rank`` are read) into :class:`Failure` records, with
    the traceback from the rank's error file (written by elastic's ``@record``)
    or else its stderr log."""
    out = []
    for rank, pf in sorted(failures.items()):
        logs = attempt.ranks.get(rank) if attempt is not None else None
        text, last_write, log = "", 0.0, None
        if logs is not None:
            log = logs.stderr
            text = _callstack(_read_json(logs.error_file))
            try:
                last_write = logs.stderr.stat().st_mtime
                text = text or logs.stderr.read_text(errors="replace")
            except OSError:
                pass
        out.append(Failure(rank=rank, local_rank=int(getattr(pf, "local_rank", -1)), host=host,
                           exitcode=int(pf.exitcode), text=_last_traceback(text), log=log,
                           last_write=last_write))
    return out


def in_order_of_failure(failures: Sequence[Failure]) -> list[Failure]:
    """Root cause first (see the module docstring): failures the launcher did not
    cause before those it did (SIGTERM), then by the last write to stderr, then rank."""
    return sorted(failures, key=lambda f: (f.stopped_by_launcher, f.last_write, f.rank))


def format_summary(failures: Sequence[Failure], *, attempts: int, max_restarts: int,
                   log_root: str | None) -> str:
    """The summary text, root cause first (see the module docstring)."""
    if not failures:
        return "the job failed, but no worker reported a failure"
    first, *others = in_order_of_failure(failures)
    lines = [f"rank {first.rank} (local rank {first.local_rank} on {first.host}) failed "
             f"first, with {first.how}"]
    lines += [f"    {line}" for line in first.traceback or ("(it wrote nothing to stderr)",)]
    if first.log is not None:
        lines.append(f"  full log: {first.log}")
    if others:
        shown = ", ".join(f"rank {f.rank} ({'stopped by the launcher' if f.stopped_by_launcher else f.how})"
                          for f in others[:_OTHERS_SHOWN])
        more = f" and {len(others) - _OTHERS_SHOWN} more" if len(others) > _OTHERS_SHOWN else ""
        lines.append(f"  then: {shown}{more}")
    if max_restarts:
        lines.append(f"  gave up after {attempts} attempt(s) (--max-restarts {max_restarts})")
    if log_root:
        lines.append(f"  all logs: {log_root}")
    return "\n".join(lines)


def failure_summary(failures: Mapping[int, Any], attempts: Sequence[Attempt], *, host: str,
                    max_restarts: int, log_root: str | None) -> str:
    """:func:`collect_failures` for the last attempt, then :func:`format_summary`."""
    last = attempts[-1] if attempts else None
    return format_summary(collect_failures(failures, last, host=host), attempts=len(attempts),
                          max_restarts=max_restarts, log_root=log_root)


def _last_traceback(text: str, keep_lines: int = 40) -> str:
    # torch prefixes an uncaught exception's lines with "[rankN]: " once a process
    # group exists; the summary names the rank itself.
    text = _TORCH_RANK_PREFIX.sub("", text)
    start = text.rfind("Traceback (most recent call")
    if start >= 0:
        return text[start:]
    return "\n".join(text.splitlines()[-keep_lines:])


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _callstack(data: Any) -> str:
    # elastic's @record writes {"message": {"message": "...", "extraInfo": {"py_callstack": ...}}}.
    if not isinstance(data, dict):
        return ""
    message = data.get("message")
    if isinstance(message, dict):
        extra = message.get("extraInfo") or {}
        stack = extra.get("py_callstack") if isinstance(extra, dict) else None
        if isinstance(stack, str) and stack.strip():
            return stack
        text = message.get("message")
        return text if isinstance(text, str) else json.dumps(message)
    return message if isinstance(message, str) else ""
