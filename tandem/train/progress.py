"""What rank 0 shows while training: a progress bar (tqdm, when installed, on a
terminal) or a line per record (in logs and pipes, where a bar's redraws are
noise). Every other rank shows nothing.

This is the Trainer's one way to the console: ``Progress.say`` prints on rank 0
only and does not tear the bar.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["Progress"]

try:
    from tqdm.auto import tqdm as _tqdm
except ImportError:  # optional: pip install tandem[train]
    _tqdm = None


class Progress:
    """Rank 0's view of a run of ``total`` optimizer steps."""

    def __init__(self, *, enabled: bool, bar: bool, total: int, initial: int) -> None:
        self.enabled = enabled
        self._bar = None
        if enabled and bar and _tqdm is not None and _on_terminal():
            self._bar = _tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                              file=sys.stdout, mininterval=0.5)
        self._plain = enabled and self._bar is None

    def say(self, message: str) -> None:
        """Print one line on rank 0."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stdout)
        else:
            print(message, flush=True)

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def show(self, record: dict[str, Any]) -> None:
        """Show a training record: in the bar's postfix, or as a line."""
        if not self.enabled:
            return
        fields = _fields(record)
        if self._bar is not None:
            self._bar.set_postfix_str(", ".join(f"{k} {v}" for k, v in fields.items()), refresh=False)
        elif self._plain:
            print("  ".join(f"{k} {v}" for k, v in fields.items()), flush=True)

    def set_enabled(self, enabled: bool) -> None:
        """Print from now on, or stop: an elastic job's rank 0 is another process
        after a world change. A process that takes over prints plain lines."""
        if enabled != self.enabled:
            self.close()
            self.enabled = self._plain = enabled

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _on_terminal() -> bool:
    """Whether our output ends on a terminal, directly or through ``tandem run``
    (which says so in TANDEM_STDOUT_ISATTY, see Note [carriage returns] there)."""
    return sys.stdout.isatty() or os.environ.get("TANDEM_STDOUT_ISATTY") == "1"


def _fields(record: dict[str, Any]) -> dict[str, str]:
    out = {"epoch": str(record["epoch"]), "step": str(record["step"]),
           "loss": f"{record['loss']:.4f}", "samples/s": f"{record['samples_per_s']:.0f}"}
    if record.get("comm_wait_share") is not None:
        out["comm wait"] = f"{100 * record['comm_wait_share']:.0f}%"
    if record.get("comm_bytes_per_step"):
        out["sent"] = f"{_size(record['comm_bytes_per_step'])}/step"
    if record.get("stragglers"):
        out["straggler"] = "; ".join(record["stragglers"])
    return out


def _size(nbytes: float) -> str:
    """``12.1 MiB``, ``640 KiB``, ``96 B``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"
