"""Sharded model (and optimizer) state through torch.distributed.checkpoint, in
committed step directories: for ``tandem.fully_shard`` models, whose state
dicts hold DTensors, and any model DCP can save.

DCP writes its own files (``__{rank}_{i}.distcp`` per rank, ``.metadata`` from
the coordinator) and runs its own collectives; tandem adds the commit around
it (Note [committed step directories] in commit.py): each rank measures an
equal share of the directory's files once DCP has returned everywhere, and
rank 0 writes the marker last. DCP reshards at load, so a checkpoint saved on N
ranks loads on M.

At load, the model's keys and shapes are checked against DCP's metadata first,
so that a mismatch raises on every rank naming the key (DCP itself would name
one key at a time, or ignore keys of the checkpoint that the model lacks).
Optimizer state may be partial: a parameter that never had a gradient has no
state in the checkpoint and keeps the fresh state that ``get_state_dict`` makes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict, \
    set_state_dict

from tandem.checkpoint.agree import agree, group_comm
from tandem.checkpoint.commit import CheckpointError, load_committed, save_committed

__all__ = ["KIND", "load_sharded_checkpoint", "save_sharded_checkpoint"]

KIND = "dcp"
"""The ``kind`` recorded in the commit marker of these checkpoints."""


def save_sharded_checkpoint(root: str | os.PathLike[str], model: nn.Module,
                            optimizer: torch.optim.Optimizer | None = None, *, step: int,
                            keep: int | None = None, group: dist.ProcessGroup | None = None) -> Path:
    """Save ``model``'s (and ``optimizer``'s) sharded state with
    torch.distributed.checkpoint into ``root/step-{step:08d}/`` and commit it. A
    collective: call it on every rank.

    Args:
        root: the directory of step directories.
        model: a model after ``tandem.fully_shard`` (or any model DCP can save).
        optimizer: its optimizer, or None for the model alone.
        step: the training step saved.
        keep: keep the newest ``keep`` committed steps (None: all).
        group: the process group (default: the default group).

    Returns:
        The committed step directory.

    Raises:
        CheckpointError: on every rank, when a rank failed to write or the ranks
            passed different steps (see :func:`tandem.checkpoint.save_committed`).
    """
    state = _state_dicts(model, optimizer)
    comm = group_comm(group)
    rank, world = (comm.rank, comm.size) if comm else (0, 1)

    def write(directory: Path) -> list[str]:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(directory), process_group=group,
                 no_dist=comm is None)
        # DCP's last collective follows the coordinator's .metadata: every rank
        # now lists the same files, and vouches for every world-th of them.
        names = sorted(p.name for p in directory.iterdir() if p.is_file())
        return names[rank::world]

    return save_committed(root, step, write, kind=KIND, keep=keep, group=group)


def load_sharded_checkpoint(root: str | os.PathLike[str], model: nn.Module,
                            optimizer: torch.optim.Optimizer | None = None, *, step: int | None = None,
                            group: dist.ProcessGroup | None = None) -> int:
    """Load the newest committed checkpoint under ``root`` (or ``step``'s) that
    :func:`save_sharded_checkpoint` wrote into ``model`` (and ``optimizer``), at
    any world size. A collective: call it on every rank.

    Returns:
        The step loaded.

    Raises:
        FileNotFoundError: on every rank, when ``root`` holds no committed step.
        CheckpointError: on every rank: a missing, truncated or corrupt file
            (named); a key of the model missing from the checkpoint, a key of the
            checkpoint missing from the model, or a shape that differs (named);
            ranks that would load different steps.
    """
    ckpt = load_committed(root, step=step, kind=KIND, group=group)
    comm = group_comm(group)
    state = _state_dicts(model, optimizer)
    reader = dcp.FileSystemReader(ckpt.directory)
    where = f"the checkpoint {ckpt.directory} (step {ckpt.step})"

    def check() -> None:
        problems = _mismatches(reader.read_metadata().state_dict_metadata, state)
        if problems:
            raise CheckpointError(f"rank {comm.rank if comm else 0}: {where} does not fit the model: "
                                  + "; ".join(problems))

    agree(check, what="checking the keys and shapes", error_type=CheckpointError, group=group)
    # The model's keys are checked above; partial only for optimizer state.
    agree(lambda: dcp.load(state, storage_reader=reader, process_group=group, no_dist=comm is None,
                           planner=DefaultLoadPlanner(allow_partial_load=True)),
          what=f"loading {where}", error_type=CheckpointError, group=group)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return ckpt.step


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _mismatches(saved: dict[str, Any], state: dict[str, Any]) -> list[str]:
    """What differs between DCP's metadata (flat keys: ``model.<fqn>``,
    ``optim.state.<fqn>.<key>``) and the state dicts to load into."""
    problems = []
    model_keys = {f"model.{k}" for k in state["model"]}
    for key in sorted(model_keys - saved.keys()):
        problems.append(f"'{key[len('model.'):]}' is in the model but not in the checkpoint")
    for key in sorted(k for k in saved if k.startswith("model.") and k not in model_keys):
        problems.append(f"'{key[len('model.'):]}' is in the checkpoint but not in the model")
    if "optim" in state and not any(k.startswith("optim.") for k in saved):
        problems.append("it holds no optimizer state (saved without an optimizer): pass optimizer=None")
    tensors = {f"model.{k}": (f"'{k}'", v) for k, v in state["model"].items()}
    for fqn, values in state.get("optim", {}).get("state", {}).items():
        tensors.update({f"optim.state.{fqn}.{k}": (f"the optimizer's '{k}' of '{fqn}'", v)
                        for k, v in values.items()})
    for key, (label, value) in sorted(tensors.items()):
        size = getattr(saved.get(key), "size", None)
        if torch.is_tensor(value) and size is not None and tuple(size) != tuple(value.shape):
            problems.append(f"{label} has shape {tuple(size)} in the checkpoint, "
                            f"{tuple(value.shape)} in the model")
    return problems
