"""The Trainer's records as TensorBoard scalars: :class:`TensorBoardLog`.

Each record the Trainer writes to ``metrics.jsonl`` goes, on rank 0, to a
TensorBoard event file under ``output_dir/tensorboard`` too, at its optimizer
step, under the names Lightning users write with ``self.log("train/loss")``:
``train/loss``, ``train/lr``, ``train/samples_per_s``, ``train/comm_wait_share``,
``train/grad_norm``, ``eval/loss`` and ``eval/<metric>``, and ``elastic/world_size``
at each change of an elastic world. ``tensorboard --logdir output_dir`` shows
them. It needs ``torch.utils.tensorboard``'s writer, which needs the
``tensorboard`` package (``pip install 'tandem[train]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TensorBoardLog", "require_tensorboard"]

_TRAIN = ("loss", "lr", "samples_per_s", "comm_wait_share", "grad_norm")


def require_tensorboard() -> None:
    """Fail now, not at the first record, where the writer cannot be made.

    Raises:
        ImportError: the ``tensorboard`` package is not installed; the message says how to install it.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as e:
        raise ImportError("TrainerConfig(tensorboard=True) needs the tensorboard package: "
                          "pip install tensorboard (or 'tandem[train]')") from e


class TensorBoardLog:
    """Writes records as scalars to an event file in ``directory``.

    Raises:
        ImportError: the ``tensorboard`` package is not installed; the message says how to install it.
    """

    def __init__(self, directory: Path) -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.directory = directory
        self._writer = SummaryWriter(log_dir=str(directory))

    def write(self, record: dict[str, Any]) -> None:
        """One record of ``metrics.jsonl``, as scalars at its step."""
        step = record.get("step")
        kind = record.get("kind")
        if kind == "train":
            names = {f"train/{k}": record.get(k) for k in _TRAIN}
        elif kind == "eval":
            names = {f"eval/{k}": v for k, v in record.items() if k not in ("kind", "epoch", "step")}
        elif kind == "elastic":
            names = {"elastic/world_size": record.get("world_size")}
        else:
            return
        for name, value in names.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(name, float(value), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
