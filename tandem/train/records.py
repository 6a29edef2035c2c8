"""The Trainer's records: a window of training steps summed into one record of
``metrics.jsonl``, and the evaluation read back from a record."""

from __future__ import annotations

from typing import Any

import torch

from tandem.data import RunningMean
from tandem.checkpoint.state import TrainingState

__all__ = ["Window", "evaluation_of"]


class Window:
    """Training records accumulate over ``log_every`` steps: loss (reduced across
    ranks when recorded), throughput, the share of time waiting on communication,
    the mean gradient norm before clipping (the same on every rank), the steps
    skipped for NaN/Inf gradients (None when they are not counted), and the ranks
    named slow (``stragglers``, when the ranks compared their steps in the window),
    and the bytes this rank handed to collectives during its steps (``comm_bytes``,
    from the collective ledger; None without one)."""

    def __init__(self) -> None:
        self.loss = RunningMean()
        self.samples = 0
        self.seconds = 0.0
        self.comm_wait: float | None = None
        self.grad_norms: list[torch.Tensor] = []
        self.skipped: int | None = None
        self.steps = 0
        self.comm_bytes: int | None = None
        self.stragglers: list[str] | None = None
        """The ranks named slow at the window's last gather (Note [naming a straggler]); None: no gather yet."""
        self.rank_phases: list[list[float]] | None = None
        """Every rank's mean seconds per step in data, compute, comm and optimizer, at the last gather."""

    def add(self, samples: int, seconds: float, comm_wait: float | None,
            grad_norm: torch.Tensor | None, skipped: bool | None, comm_bytes: int | None = None) -> None:
        self.steps += 1
        if comm_bytes is not None:
            self.comm_bytes = (self.comm_bytes or 0) + comm_bytes
        if skipped is not None:
            self.skipped = (self.skipped or 0) + int(skipped)
        self.samples += samples
        self.seconds += seconds
        if comm_wait is not None:
            self.comm_wait = (self.comm_wait or 0.0) + comm_wait
        if grad_norm is not None:
            self.grad_norms.append(grad_norm)

    def record(self, state: TrainingState, lr: float) -> dict[str, Any]:
        return {"kind": "train", "epoch": state.epoch + 1, "step": state.step,
                "loss": self.loss.compute(), "lr": lr,
                "samples_per_s": self.samples / max(self.seconds, 1e-9),
                "comm_wait_share": None if self.comm_wait is None else
                self.comm_wait / max(self.seconds, 1e-9),
                # One device sync per record, not per step.
                "grad_norm": float(torch.stack(self.grad_norms).float().mean()) if self.grad_norms else None,
                "skipped_steps": self.skipped,
                "comm_bytes_per_step": None if self.comm_bytes is None else self.comm_bytes / max(self.steps, 1),
                **({} if self.stragglers is None else {"stragglers": self.stragglers}),
                **({} if self.rank_phases is None else {"rank_phases": self.rank_phases})}


def evaluation_of(record: dict[str, Any] | None) -> dict[str, float] | None:
    """An eval record's loss and metrics, without its bookkeeping."""
    if record is None:
        return None
    return {k: v for k, v in record.items() if k not in ("kind", "epoch", "step")}
