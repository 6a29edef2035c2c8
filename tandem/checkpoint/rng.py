"""Seeding every random number generator a training script touches, and
capturing their states for checkpoints.

Two kinds of randomness live in a data-parallel job:

- randomness that must be *identical* on every rank: model initialisation (DDP
  broadcasts rank 0's parameters anyway, but a model built under identical seeds
  is identical without relying on that), or anything a rank decides alone that
  must agree with the others;
- randomness that must *differ* between ranks: data augmentation, dropout masks.
  Two ranks that draw the same crop for different images waste nothing, but two
  ranks that draw the same dropout mask for the same shape correlate their
  gradient noise, and ranks seeded alike with one sample each see one mask.

:func:`seed_everything` does either, for Python's ``random``, numpy's global
generator (when numpy is installed) and torch (CPU and every CUDA device)::

    tandem.seed_everything(0)                  # identical: build the model
    model = Net()
    tandem.seed_everything(0, per_rank=True)   # per rank: dropout, augmentation
"""

from __future__ import annotations

import hashlib
import os
import random
from typing import Any, cast

import torch
import torch.distributed as dist

try:
    import numpy as _np
except ImportError:  # numpy is optional for this module
    _np = None  # type: ignore[assignment]  # the optional-import idiom

__all__ = ["capture_rng_state", "rank_seed", "restore_rng_state", "seed_everything"]

_MAX_SEED = 2**63 - 1


def rank_seed(seed: int, rank: int) -> int:
    """A seed for ``rank`` derived from ``seed``, different for every rank.

    A hash rather than ``seed + rank``, so that the streams of rank 1 under seed 0
    and rank 0 under seed 1 are not the same stream.
    """
    digest = hashlib.sha256(f"tandem.rank_seed:{int(seed)}:{int(rank)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & _MAX_SEED


def seed_everything(seed: int, *, per_rank: bool = False, rank: int | None = None) -> int:
    """Seed Python's ``random``, numpy's global generator and torch (CPU and CUDA).

    Args:
        seed: the job's seed, the same on every rank.
        per_rank: False seeds every rank identically (model initialisation); True
            gives each rank a stream of its own, derived from ``seed`` and the rank
            by :func:`rank_seed` (data augmentation, dropout).
        rank: the rank to derive the per-rank stream for; by default this process's
            rank in torch.distributed's default group, or ``RANK`` from the launcher
            when the group is not initialised yet, or 0.

    Returns:
        The seed applied to this process (``seed`` itself unless ``per_rank``).

    Raises:
        ValueError: ``seed`` is negative or does not fit in 63 bits.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    applied = rank_seed(seed, _this_rank() if rank is None else rank) if per_rank else seed
    random.seed(applied)
    if _np is not None:
        _np.random.seed(applied % 2**32)  # numpy's legacy seeding takes 32 bits
    torch.manual_seed(applied)  # seeds every CUDA device too
    return applied


def _this_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def capture_rng_state() -> dict[str, Any]:
    """The state of every generator :func:`seed_everything` seeds, on this process.

    Stored as tensors, tuples and ints only, so that a checkpoint holding it loads
    with ``torch.load(weights_only=True)``.
    """
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if _np is not None:
        # The legacy (default) form: a tuple, as the global RandomState is an MT19937.
        kind, keys, pos, has_gauss, cached = cast("tuple[str, Any, int, int, float]",
                                                  _np.random.get_state())
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss),
                          float(cached))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` captured (on this process).

    A state captured without numpy or without CUDA leaves those generators as
    they are.
    """
    random.setstate(_as_python_state(state["python"]))
    torch.set_rng_state(state["torch"].cpu())
    if _np is not None and "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        _np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _as_python_state(value: Any) -> tuple:
    """``random.setstate`` wants tuples; a state that went through a serialiser
    may come back with lists."""
    version, internal, gauss = value
    return (version, tuple(internal), gauss)
