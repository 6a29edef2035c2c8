"""Who this process is in the job: rank information, read from a launcher's variables.

:func:`world_from_env` is a pure function of a mapping (pass ``os.environ``, or a
dict in a test) and knows nothing about process groups; :func:`tandem.init`
uses it and then builds the group. It reads the variables as ``torchrun`` sets them:

==================  =========================================================
``RANK``            this process's rank in the job, ``0 <= RANK < WORLD_SIZE``
``WORLD_SIZE``      number of processes in the job
``LOCAL_RANK``      this process's rank on its node (selects the GPU)
``LOCAL_WORLD_SIZE`` number of processes on this node
``MASTER_ADDR``     host of rank 0's store, for the ``env://`` rendezvous
``MASTER_PORT``     port of rank 0's store, for the ``env://`` rendezvous
==================  =========================================================

and, when none of torchrun's rank variables is set, as ``srun`` sets Slurm's for
each task it starts (torchrun's win when both are present, as under
``srun ... tandem run``, where each worker has both):

=============================  ==================================================
``SLURM_PROCID``               rank (``srun`` numbers the step's tasks from 0)
``SLURM_STEP_NUM_TASKS``       world size: the tasks of this step; set only by
                               ``srun``, so it also tells a task from a batch
                               script (Note [srun's tasks] in slurm.py)
``SLURM_LOCALID``              local rank
``SLURM_STEP_TASKS_PER_NODE``  local world size, as ``"4"``, ``"2(x3)"`` or
                               ``"4(x2),2"``: one count per node of the step, the
                               entry ``SLURM_NODEID`` picked (then
                               ``SLURM_TASKS_PER_NODE``, then
                               ``SLURM_NTASKS_PER_NODE``, if it is absent)
``SLURM_STEP_NODELIST``        its first host is ``MASTER_ADDR`` unless that is set
                               (then ``SLURM_JOB_NODELIST``, ``SLURM_NODELIST``)
``SLURM_JOB_ID``               ``MASTER_PORT`` unless that is set:
                               :func:`slurm_default_port`
=============================  ==================================================

:func:`local_from_env` answers the narrower question for a process group that
someone else created (Ray Train, Lightning, the user), where the group itself
says the rank and the world size.

Slurm's variables are read in slurm.py; the checks both launchers' values go
through, and :class:`LaunchVars`, are in launch_vars.py. This module re-exports
their public names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tandem.comm.launch_vars import LaunchVars, Launcher, check_local, parse_int, parse_master_addr, \
    parse_master_port
from tandem.comm.slurm import SLURM_PORT_BASE, SLURM_PORT_SPAN, first_host_of_nodelist, parse_tasks_per_node, \
    slurm_default_port, slurm_world, srun_task_of

__all__ = ["Launcher", "LaunchVars", "SLURM_PORT_BASE", "SLURM_PORT_SPAN", "WorldInfo",
           "first_host_of_nodelist", "local_from_env", "parse_tasks_per_node", "slurm_default_port",
           "world_from_env"]

_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_MASTER_VARS = ("MASTER_ADDR", "MASTER_PORT")
_SINGLE_PROCESS_HINT = "or unset all of RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, " \
                       "MASTER_ADDR, MASTER_PORT to run as a single process"


@dataclass(frozen=True, kw_only=True)
class WorldInfo:
    """This process's place in an initialised job, as returned by :func:`tandem.init`.

    Raises:
        ValueError: a field is out of range (``rank >= world_size``, say).
    """

    rank: int
    """Global rank, ``0 <= rank < world_size``; rank 0 is the one that logs and saves."""
    local_rank: int
    """Rank among the processes on this node; selects the GPU to use."""
    world_size: int
    """Number of processes in the job; gradients are averaged over this many."""
    local_world_size: int
    """Number of processes on this node."""
    device: torch.device
    """The device this process computes on: ``cuda:<local_rank>`` (``cuda:0`` for an
    ``srun`` task given its own GPUs), or ``cpu``."""
    backend: str
    """The default process group's backend, ``"nccl"`` or ``"gloo"`` usually."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"WorldInfo.world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"WorldInfo.rank must be in [0, {self.world_size}), got {self.rank}")
        if not 1 <= self.local_world_size <= self.world_size:
            raise ValueError(f"WorldInfo.local_world_size must be in [1, {self.world_size}], "
                             f"got {self.local_world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"WorldInfo.local_rank must be in [0, {self.local_world_size}), "
                             f"got {self.local_rank}")
        if not isinstance(self.device, torch.device):
            raise TypeError(f"WorldInfo.device must be a torch.device, got {self.device!r}")
def world_from_env(environ: Mapping[str, str], *, require_master: bool = True) -> LaunchVars | None:
    """Read a launcher's rank variables from ``environ``: torchrun's, else Slurm's.

    torchrun's: ``RANK`` and ``WORLD_SIZE`` are set together or not at all.
    ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are set together (torchrun sets both) or
    not at all, which means a job on one node: local rank and size equal the global
    ones.

    Slurm's, read when none of ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE`` is set and ``SLURM_PROCID`` is (``srun python train.py``):
    the rank is ``SLURM_PROCID``, the world size ``SLURM_STEP_NUM_TASKS``, the
    local rank ``SLURM_LOCALID`` and the local world size this node's count in
    ``SLURM_STEP_TASKS_PER_NODE``. ``MASTER_ADDR`` and ``MASTER_PORT`` are used
    when set; otherwise the address is the first host of the step's node list
    (``srun`` places task 0 there) and the port is derived from
    ``SLURM_JOB_ID``, the same on every task of the job without any
    communication. A step of one task is a world of one (None).

    Args:
        environ: the variables, ``os.environ`` or a plain dict.
        require_master: whether ``MASTER_ADDR`` and ``MASTER_PORT`` are read and
            required, as the ``env://`` rendezvous needs them. With False they are
            ignored (for ``tcp://`` and ``file://``, which carry their own address).

    Returns:
        The parsed variables, or None when no launcher's variables are set: a
        world of one.

    Raises:
        ValueError: a variable is not a non-negative integer, one of a pair is
            missing, or the values contradict each other (``RANK >= WORLD_SIZE``,
            ``LOCAL_RANK >= LOCAL_WORLD_SIZE``, ``LOCAL_WORLD_SIZE > WORLD_SIZE``,
            ``MASTER_PORT`` outside 1..65535, a Slurm node list or tasks-per-node
            count that does not parse or does not add up); or Slurm's variables
            say several tasks but this process is not one that ``srun`` started
            (a batch script running ``python train.py`` itself). The message
            names the variable, its value and what to set instead.
    """
    # Slurm's variables: the table at the top of this file (the port: slurm_default_port).
    if not any(n in environ for n in _RANK_VARS) and "SLURM_PROCID" in environ:
        return slurm_world(environ, require_master)
    names = _RANK_VARS + (_MASTER_VARS if require_master else ())
    present = [n for n in names if n in environ]
    if not present:
        return None

    for name in ("RANK", "WORLD_SIZE"):
        if name not in environ:
            raise ValueError(
                f"{_describe(environ, present)} set but {name} is not; a launcher sets RANK "
                f"and WORLD_SIZE together (torchrun does). Set {name}, {_SINGLE_PROCESS_HINT}")
    rank = parse_int(environ, "RANK")
    world_size = parse_int(environ, "WORLD_SIZE")
    if world_size < 1:
        raise ValueError(f"WORLD_SIZE={world_size} must be at least 1; set it to the number "
                         "of processes in the job")
    if rank >= world_size:
        raise ValueError(f"RANK={rank} is not less than WORLD_SIZE={world_size}; ranks run from "
                         f"0 to {world_size - 1}, check how the launcher assigns them")

    has_local = ["LOCAL_RANK" in environ, "LOCAL_WORLD_SIZE" in environ]
    if all(has_local):
        local_rank = parse_int(environ, "LOCAL_RANK")
        local_world_size = parse_int(environ, "LOCAL_WORLD_SIZE")
    elif any(has_local):
        given, missing = (("LOCAL_RANK", "LOCAL_WORLD_SIZE") if has_local[0]
                          else ("LOCAL_WORLD_SIZE", "LOCAL_RANK"))
        raise ValueError(
            f"{given}={environ[given]!r} is set but {missing} is not; set both (torchrun does) "
            "or neither (a job on one node, where local rank and size equal the global ones)")
    else:
        local_rank, local_world_size = rank, world_size
    check_local(local_rank, local_world_size, world_size, ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),
                 "WORLD_SIZE", "check the launcher")

    master_addr: str | None = None
    master_port: int | None = None
    if require_master:
        master_addr, master_port = _parse_master(environ)
    return LaunchVars(rank=rank, world_size=world_size, local_rank=local_rank,
                      local_world_size=local_world_size, master_addr=master_addr,
                      master_port=master_port)


# Note [local rank of an adopted group]
# The group says the rank and the world size; nothing in torch says which ranks
# share a node, so the launcher's variables are read, leniently, since the
# group's creator may set only some of them (Lightning sets LOCAL_RANK and
# WORLD_SIZE but not RANK or LOCAL_WORLD_SIZE):
# - LOCAL_RANK and LOCAL_WORLD_SIZE, each when set (torchrun, Ray Train);
# - what is missing, from Slurm's variables when this process is the task of an
#   srun step of the same rank and size (a batch script's own variables, or ones
#   describing another world, are ignored, as are ones that do not parse);
# - what is still missing: one node, local_rank = rank, local_world_size = world_size.
# No collective (an all-gather of host names would know better): a second
# tandem.init() on one rank alone must not hang.

def local_from_env(environ: Mapping[str, str], *, rank: int, world_size: int) -> tuple[int, int]:
    """``(local_rank, local_world_size)`` of a process whose default process group
    someone else created, as rank ``rank`` of ``world_size``: from ``LOCAL_RANK``
    and ``LOCAL_WORLD_SIZE``, else Slurm's, else one node (Note [local rank of an
    adopted group]).

    Raises:
        ValueError: ``RANK`` or ``WORLD_SIZE`` is set and differs from the group
            (the variables describe another job), a local variable is not a
            non-negative integer, or the local values are out of range.
    """
    for name, value, what in (("RANK", rank, "rank"), ("WORLD_SIZE", world_size, "world size")):
        if name in environ and parse_int(environ, name) != value:
            raise ValueError(
                f"{name}={environ[name].strip()} but the existing process group has {what} "
                f"{value}: the launcher's variables describe another job, so this process's "
                "place on its node is unknown; unset RANK, WORLD_SIZE, LOCAL_RANK and "
                "LOCAL_WORLD_SIZE, or set them to agree with the group")
    local_rank = parse_int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else None
    local_size = (parse_int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ
                  else None)
    rank_name, size_name = "LOCAL_RANK", "LOCAL_WORLD_SIZE"
    task = srun_task_of(environ, rank, world_size) if None in (local_rank, local_size) else None
    if local_rank is None:
        local_rank, rank_name = ((task.local_rank, "SLURM_LOCALID") if task is not None
                                 else (rank, "the rank (no LOCAL_RANK: one node)"))
    if local_size is None:
        local_size, size_name = ((task.local_world_size, "Slurm's tasks on this node")
                                 if task is not None
                                 else (world_size, "the world size (no LOCAL_WORLD_SIZE: one node)"))
    check_local(local_rank, local_size, world_size, (rank_name, size_name), "the group's world size",
                 "set LOCAL_RANK and LOCAL_WORLD_SIZE to this process's place on its node")
    return local_rank, local_size


def _describe(environ: Mapping[str, str], present: list[str]) -> str:
    shown = ", ".join(f"{n}={environ[n]!r}" for n in present)
    return f"{shown} {'is' if len(present) == 1 else 'are'}"


def _parse_master(environ: Mapping[str, str]) -> tuple[str, int]:
    for name in _MASTER_VARS:
        if name not in environ:
            raise ValueError(
                f"{name} is not set; the env:// rendezvous needs MASTER_ADDR and MASTER_PORT "
                "(the host and a free port of rank 0, torchrun sets both). Set them, or pass "
                "init_method='tcp://host:port' or 'file:///shared/path'")
    return parse_master_addr(environ), parse_master_port(environ)
