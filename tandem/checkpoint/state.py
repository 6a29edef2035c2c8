"""Everything a resumed run needs to continue exactly where a saved one stopped.

# Note [exact resume]
A run interrupted after step k and resumed from its checkpoint must end with the
parameters an uninterrupted run reaches. That takes more than the model:
- the optimizer's state (Adam's moments), the scheduler's position and the
  gradient scaler's scale and growth tracker;
- the data position: the epoch, and how many samples of it the whole job has
  already consumed, so that the sampler yields exactly the rest of the epoch
  (DistributedSampler.set_epoch(epoch, start=consumed));
- every rank's random number generators (dropout and augmentation draw from
  them), gathered into the file because each rank's differ.
Under ZeRO the optimizer state is sharded; its state_dict() consolidates it in
torch's format, which is also what makes the file loadable at another world size.
A fully-sharded model's parameters and optimizer state are gathered into the
same format (Note [full checkpoints of a sharded model] in full_state.py). That is
the full format; the Trainer saves sharded models without gathering, the loop's
part of this state (loop_state_dict) beside DCP's shards (Note [sharded trainer
checkpoints] in sharded_checkpoint.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.comm.group import GroupComm
from tandem.checkpoint.rng import capture_rng_state, restore_rng_state
from tandem.checkpoint.full_state import full_state_dicts, is_fully_sharded, load_full_state_dicts

__all__ = ["TrainingState"]

logger = logging.getLogger(__name__)

FORMAT = "tandem.training_state/1"
LOOP_FORMAT = "tandem.training_loop/1"  # the loop's part alone, beside a sharded checkpoint


# What it holds, and why: Note [exact resume] at the top of this file.
@dataclass
class TrainingState:
    """The objects and counters of one training run: all a resumed run needs to
    end with the parameters an uninterrupted run reaches (the model, the
    optimizer's, scheduler's and scaler's state, the position in the data, and
    every rank's random number generators).

    ``state_dict()`` is a collective (it gathers every rank's RNG state, a ZeRO
    optimizer's shards, and a fully-sharded model's); it returns the dict on
    rank 0 and None elsewhere, ready for :func:`tandem.save_checkpoint`.
    ``load_state_dict()`` runs on every rank with the whole dict (from
    :func:`tandem.load_checkpoint`).
    """

    model: nn.Module
    """The model, DDP-wrapped, fully sharded or neither: the unwrapped module's
    full state is saved, so a checkpoint loads into any of them."""
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    """A learning-rate scheduler (anything with state_dict/load_state_dict)."""
    scaler: Any = None
    """A torch.amp.GradScaler, when training in fp16."""
    step: int = 0
    """Optimizer steps taken."""
    epoch: int = 0
    """The epoch in progress (or about to start, when ``consumed`` is 0)."""
    consumed: int = 0
    """Samples of ``epoch`` already trained on, by all ranks together."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else to keep (tensors, numbers, strings, containers of them)."""

    def state_dict(self, group: dist.ProcessGroup | None = None, *, rng: bool = True) -> dict[str, Any] | None:
        """The whole training state, on rank 0 (None elsewhere); a collective. Without
        ``rng``, no rank's RNG state: a rank given it keeps its own stream (a state shared
        with a replacement: Note [elastic trainer] in tandem/elastic/run.py)."""
        model: dict[str, Any] | None = None
        optimizer = None
        if is_fully_sharded(self.model):
            model, optimizer = full_state_dicts(self.model, self.optimizer)
        elif self.optimizer is not None:
            optimizer = self.optimizer.state_dict()  # a collective for ZeroOptimizer
        loop = self.loop_state_dict(group, rng=rng)
        if loop is None:
            return None
        return {**loop, "format": FORMAT,
                "model": unwrap_model(self.model).state_dict() if model is None else model,
                "optimizer": optimizer}

    def loop_state_dict(self, group: dist.ProcessGroup | None = None, *, rng: bool = True,
                        ) -> dict[str, Any] | None:
        """Everything but the model and the optimizer: the scheduler, the scaler,
        the counters, every rank's RNG state (unless not ``rng``) and ``extra``. A
        collective when it gathers the RNG states; the dict on rank 0, None
        elsewhere. What goes beside a sharded checkpoint's DCP files."""
        # Note [sharded trainer checkpoints] in tandem/train/sharded_checkpoint.py.
        states = _gather(capture_rng_state(), group) if rng else None
        if _rank(group) != 0:
            return None
        return {
            "format": LOOP_FORMAT,
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "rng": states,
            "extra": self.extra,
        }

    def load_state_dict(self, state: dict[str, Any], group: dist.ProcessGroup | None = None) -> None:
        self.check_loop_state(state, FORMAT)
        if self.optimizer is not None and state["optimizer"] is None:
            raise ValueError("the checkpoint holds no optimizer state, but a optimizer was given; "
                             "resume with the same set-up as the saved run")
        if is_fully_sharded(self.model):  # a collective; each rank keeps its slice
            load_full_state_dicts(self.model, self.optimizer, state["model"], state["optimizer"])
        else:
            unwrap_model(self.model).load_state_dict(state["model"])
            if self.optimizer is not None:
                self.optimizer.load_state_dict(state["optimizer"])
        self.load_loop_state_dict(state, group)

    def check_loop_state(self, state: Any, expected: str = LOOP_FORMAT) -> None:
        """Raise ValueError, before anything is loaded, when ``state`` is not a
        training state of format ``expected`` that fits this run's scheduler and scaler."""
        if not isinstance(state, dict):
            raise ValueError(f"not a tandem training state but {type(state).__name__}; state_dict() "
                             "returns it on rank 0 only: load the checkpoint file on every rank")
        if state.get("format") != expected:
            raise ValueError(f"not a tandem training state (format {state.get('format')!r}, "
                             f"expected {expected!r})")
        for name in ("scheduler", "scaler"):
            if getattr(self, name) is not None and state[name] is None:
                raise ValueError(f"the checkpoint holds no {name} state, but a {name} was given; "
                                 f"resume with the same set-up as the saved run")

    def load_loop_state_dict(self, state: dict[str, Any], group: dist.ProcessGroup | None = None) -> None:
        """Load what :meth:`loop_state_dict` returned (or a whole :meth:`state_dict`)
        on every rank: each rank continues its saved RNG stream."""
        for name in ("scheduler", "scaler"):
            if getattr(self, name) is not None:
                getattr(self, name).load_state_dict(state[name])
        self.step, self.epoch, self.consumed = state["step"], state["epoch"], state["consumed"]
        self.extra = state["extra"]
        if state["rng"] is None:  # shared without: each rank keeps its own stream
            return
        rank, size, saved_ranks = _rank(group), _size(group), len(state["rng"])
        if saved_ranks != size:
            logger.warning("the checkpoint was saved by %d rank(s) and is resumed on %d: random "
                           "streams continue from saved rank (rank mod %d), so the run is not "
                           "an exact continuation", saved_ranks, size, saved_ranks)
        restore_rng_state(state["rng"][rank % saved_ranks])


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP or DataParallel wrapper."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if _initialized() else 0


def _size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if _initialized() else 1


def _gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    if _size(group) == 1:
        return [obj]
    return GroupComm(group).all_gather_object(obj, tag="rng state")
