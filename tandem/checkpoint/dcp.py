"""Sharded model (and optimizer) state through torch.distributed.checkpoint, in
committed step directories: for ``tandem.fully_shard`` models, whose state
dicts hold DTensors, and any model DCP can save. The writer and the loader are
also the Trainer's (tandem/train/sharded_checkpoint.py), whose state dicts may
hold a ZeroOptimizer's flat shards (Note [flat shards in DCP] in flat.py): the
planners here are DCP's default ones, extended to those.

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict, \
    set_state_dict

from tandem.checkpoint.agree import agree, group_comm
from tandem.checkpoint.commit import Writer, load_committed, save_committed
from tandem.checkpoint.steps import CheckpointError, CommittedCheckpoint
from tandem.checkpoint.flat import FlatLoadPlanner, FlatSavePlanner
from tandem.comm.watched_call import watched

__all__ = ["KIND", "dcp_state_dicts", "dcp_writer", "load_dcp_files", "load_dcp_into", "load_sharded_checkpoint",
           "read_dcp_metadata", "save_sharded_checkpoint"]

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
    write = dcp_writer(dcp_state_dicts(model, optimizer), group)
    return save_committed(root, step, write, kind=KIND, keep=keep, group=group)


def dcp_writer(state: dict[str, Any], group: dist.ProcessGroup | None,
               before: Callable[[Path], None] | None = None) -> Writer:
    """The writer, for :func:`tandem.checkpoint.save_committed`, of ``state`` through
    ``dcp.save`` (DTensors, plain tensors, :class:`~tandem.checkpoint.flat.FlatShard` values and other
    objects); ``before(directory)`` writes this rank's own further files first.
    Every rank vouches for an equal share of the directory's files."""
    comm = group_comm(group)
    rank, world = (comm.rank, comm.size) if comm else (0, 1)

    def write(directory: Path) -> list[str]:
        if before is not None:  # agreed: a rank failing here must not leave the others inside dcp.save
            agree(lambda: before(directory), what=f"writing the own files of {directory}",
                  error_type=CheckpointError, group=group)
        _watched_dcp(f"dcp.save into {directory}", group, dcp.save, state,
                     storage_writer=dcp.FileSystemWriter(directory), planner=FlatSavePlanner(),
                     process_group=group, no_dist=comm is None)
        # DCP's last collective follows the coordinator's .metadata: every rank
        # now lists the same files, and vouches for every world-th of them.
        names = sorted(p.name for p in directory.iterdir() if p.is_file())
        return names[rank::world]

    return write


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
    load_dcp_into(ckpt, model, optimizer, group)
    return ckpt.step


def load_dcp_into(ckpt: CommittedCheckpoint, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                  group: dist.ProcessGroup | None) -> None:
    """Load ``ckpt``'s DCP files into ``model`` (and ``optimizer``) through torch's
    state-dict API, which reshards them to this model's layout."""
    state = dcp_state_dicts(model, optimizer)
    load_dcp_files(ckpt, state, group)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def read_dcp_metadata(ckpt: CommittedCheckpoint) -> Metadata:
    """The DCP metadata of a committed checkpoint (its keys, shapes and dtypes)."""
    return dcp.FileSystemReader(ckpt.directory).read_metadata()


def load_dcp_files(ckpt: CommittedCheckpoint, state: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """Load the DCP files of the checked checkpoint ``ckpt`` into ``state`` (in
    place where its values are tensors or :class:`~tandem.checkpoint.flat.FlatShard`), once the keys and
    shapes of ``state["model"]`` and ``state["optim"]`` are found to fit. A
    collective.

    Raises:
        CheckpointError: on every rank, naming the keys that do not fit, or the
            failure of any rank's read.
    """
    comm = group_comm(group)
    reader = dcp.FileSystemReader(ckpt.directory)
    where = f"the checkpoint {ckpt.directory} (step {ckpt.step})"

    def check() -> None:
        problems = _mismatches(reader.read_metadata().state_dict_metadata, state)
        if problems:
            raise CheckpointError(f"rank {comm.rank if comm else 0}: {where} does not fit the model: "
                                  + "; ".join(problems))

    agree(check, what="checking the keys and shapes", error_type=CheckpointError, group=group)
    # The model's keys are checked above; partial only for optimizer state.
    agree(lambda: _watched_dcp(f"dcp.load of {where}", group, dcp.load, state, storage_reader=reader,
                               process_group=group, no_dist=comm is None,
                               planner=FlatLoadPlanner(allow_partial_load=True)),
          what=f"loading {where}", error_type=CheckpointError, group=group)


def dcp_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` from torch's ``get_state_dict`` (sharded
    where the model is: DTensors), the state dict that DCP saves and loads."""
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
        shape = getattr(value, "shape", None)  # a tensor's, a DTensor's or a FlatShard's whole shape
        if shape is not None and size is not None and tuple(size) != tuple(shape):
            problems.append(f"{label} has shape {tuple(size)} in the checkpoint, "
                            f"{tuple(value.shape)} in the model")
    return problems


def _watched_dcp(what: str, group: dist.ProcessGroup | None, fn: Callable[..., Any], *args: Any,
                 **kwargs: Any) -> Any:
    """``dcp.save`` or ``dcp.load`` over the default group, waited on watching the
    peers (Note [watched object collectives] in tandem/comm/watched_call.py): DCP
    gathers and scatters its plans with torch's own collectives, and a rank whose
    ring neighbour is alive but left for a regroup (it saw another rank die) would
    otherwise wait in them until the group's timeout. A
    subgroup's (an HSDP replica's) is called as it is."""
    if group is not None:
        return fn(*args, **kwargs)
    return watched(what, fn, *args, **kwargs)
