"""The loss plot at the end of a run (matplotlib, an optional dependency)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_losses"]


def plot_losses(train: list[dict[str, Any]], evaluation: list[dict[str, Any]], path: Path) -> Path | None:
    """Write a PNG of training and evaluation loss against optimizer steps.

    Returns:
        The path written, or None when matplotlib is not installed.
    """
    try:
        # A Figure of its own, not pyplot's: no global state, no display needed.
        from matplotlib.figure import Figure
    except ImportError:
        return None

    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.subplots()
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="training loss")
    if evaluation:
        ax.plot([r["step"] for r in evaluation], [r["loss"] for r in evaluation], "o-",
                label="evaluation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
