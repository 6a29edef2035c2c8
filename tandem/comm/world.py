"""Who this process is in the job: rank information, read from a launcher's variables.

:func:`world_from_env` is a pure function of a mapping (pass ``os.environ``, or a
dict in a test) and knows nothing about process groups; :func:`tandem.comm.init`
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
                               script (Note [srun's tasks])
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
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import torch

__all__ = ["Launcher", "LaunchVars", "SLURM_PORT_BASE", "SLURM_PORT_SPAN", "WorldInfo",
           "first_host_of_nodelist", "local_from_env", "parse_tasks_per_node", "slurm_default_port",
           "world_from_env"]

_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_MASTER_VARS = ("MASTER_ADDR", "MASTER_PORT")
_SINGLE_PROCESS_HINT = "or unset all of RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, " \
                       "MASTER_ADDR, MASTER_PORT to run as a single process"
_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")

SLURM_PORT_BASE = 10000
"""Lowest port :func:`slurm_default_port` picks."""
SLURM_PORT_SPAN = 20000
"""How many ports :func:`slurm_default_port` picks from: 10000..29999, below Linux's
ephemeral range (32768 and up), so no outgoing connection on the node holds it."""


@dataclass(frozen=True, kw_only=True)
class WorldInfo:
    """This process's place in an initialised job, as returned by :func:`tandem.comm.init`.

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


class Launcher(Enum):
    """Whose variables described this process."""

    TORCHRUN = "torchrun"
    """``RANK``, ``WORLD_SIZE``, ...: torchrun, ``tandem run``, or anything that sets them."""
    SLURM = "slurm"
    """``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ...: a task that ``srun`` started."""


@dataclass(frozen=True, kw_only=True)
class LaunchVars:
    """The launcher's variables, parsed and checked against each other."""

    rank: int
    """``RANK``: global rank of this process."""
    world_size: int
    """``WORLD_SIZE``: number of processes in the job."""
    local_rank: int
    """``LOCAL_RANK``, or ``rank`` when the launcher set neither local variable."""
    local_world_size: int
    """``LOCAL_WORLD_SIZE``, or ``world_size`` when the launcher set neither local variable."""
    master_addr: str | None
    """``MASTER_ADDR``; None when it was not read (rendezvous other than ``env://``)."""
    master_port: int | None
    """``MASTER_PORT``; None when it was not read (rendezvous other than ``env://``)."""
    launcher: Launcher = Launcher.TORCHRUN
    """Which variables these came from. Under Slurm ``MASTER_ADDR``/``MASTER_PORT`` may
    be derived rather than set, so the group meets at ``tcp://master_addr:master_port``
    instead of ``env://`` (which reads the process's environment)."""

    @property
    def rank_vars(self) -> tuple[str, str]:
        """The names of the variables ``rank`` and ``world_size`` came from, for messages."""
        if self.launcher is Launcher.SLURM:
            return "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"
        return "RANK", "WORLD_SIZE"


def world_from_env(environ: Mapping[str, str], *, require_master: bool = True) -> LaunchVars | None:
    """Read a launcher's rank variables from ``environ``: torchrun's, else Slurm's.

    torchrun's: ``RANK`` and ``WORLD_SIZE`` are set together or not at all.
    ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are set together (torchrun sets both) or
    not at all, which means a job on one node: local rank and size equal the global
    ones.

    Slurm's, read when none of ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE`` is set and ``SLURM_PROCID`` is (``srun python train.py``):
    see the module's table. ``MASTER_ADDR`` and ``MASTER_PORT`` are used when set;
    otherwise the address is the first host of the step's node list (``srun``
    places task 0 there) and the port is :func:`slurm_default_port` of
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
    if not any(n in environ for n in _RANK_VARS) and "SLURM_PROCID" in environ:
        return _slurm_world(environ, require_master)
    names = _RANK_VARS + (_MASTER_VARS if require_master else ())
    present = [n for n in names if n in environ]
    if not present:
        return None

    for name in ("RANK", "WORLD_SIZE"):
        if name not in environ:
            raise ValueError(
                f"{_describe(environ, present)} set but {name} is not; a launcher sets RANK "
                f"and WORLD_SIZE together (torchrun does). Set {name}, {_SINGLE_PROCESS_HINT}")
    rank = _parse_int(environ, "RANK")
    world_size = _parse_int(environ, "WORLD_SIZE")
    if world_size < 1:
        raise ValueError(f"WORLD_SIZE={world_size} must be at least 1; set it to the number "
                         "of processes in the job")
    if rank >= world_size:
        raise ValueError(f"RANK={rank} is not less than WORLD_SIZE={world_size}; ranks run from "
                         f"0 to {world_size - 1}, check how the launcher assigns them")

    has_local = ["LOCAL_RANK" in environ, "LOCAL_WORLD_SIZE" in environ]
    if all(has_local):
        local_rank = _parse_int(environ, "LOCAL_RANK")
        local_world_size = _parse_int(environ, "LOCAL_WORLD_SIZE")
    elif any(has_local):
        given, missing = (("LOCAL_RANK", "LOCAL_WORLD_SIZE") if has_local[0]
                          else ("LOCAL_WORLD_SIZE", "LOCAL_RANK"))
        raise ValueError(
            f"{given}={environ[given]!r} is set but {missing} is not; set both (torchrun does) "
            "or neither (a job on one node, where local rank and size equal the global ones)")
    else:
        local_rank, local_world_size = rank, world_size
    _check_local(local_rank, local_world_size, world_size, ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),
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
        if name in environ and _parse_int(environ, name) != value:
            raise ValueError(
                f"{name}={environ[name].strip()} but the existing process group has {what} "
                f"{value}: the launcher's variables describe another job, so this process's "
                "place on its node is unknown; unset RANK, WORLD_SIZE, LOCAL_RANK and "
                "LOCAL_WORLD_SIZE, or set them to agree with the group")
    local_rank = _parse_int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else None
    local_size = (_parse_int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ
                  else None)
    rank_name, size_name = "LOCAL_RANK", "LOCAL_WORLD_SIZE"
    task = _srun_task_of(environ, rank, world_size) if None in (local_rank, local_size) else None
    if local_rank is None:
        local_rank, rank_name = ((task.local_rank, "SLURM_LOCALID") if task is not None
                                 else (rank, "the rank (no LOCAL_RANK: one node)"))
    if local_size is None:
        local_size, size_name = ((task.local_world_size, "Slurm's tasks on this node")
                                 if task is not None
                                 else (world_size, "the world size (no LOCAL_WORLD_SIZE: one node)"))
    _check_local(local_rank, local_size, world_size, (rank_name, size_name), "the group's world size",
                 "set LOCAL_RANK and LOCAL_WORLD_SIZE to this process's place on its node")
    return local_rank, local_size


# ------------------------------------------------------------------------------- Slurm

def slurm_default_port(job_id: int) -> int:
    """The rendezvous port of Slurm job ``job_id`` when ``MASTER_PORT`` is not set:
    ``SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN`` (10000..29999).

    Every task of the job computes the same port without talking to the others,
    and two jobs that share a first node get different ports unless their ids
    differ by a multiple of 20000; set ``MASTER_PORT`` to choose one yourself.
    """
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def parse_tasks_per_node(text: str, *, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Expand Slurm's compressed per-node counts: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Slurm writes a count repeated on consecutive nodes once, followed by
    ``(xN)``; plain ``"4"`` is one node (or, for ``SLURM_NTASKS_PER_NODE``, every
    node).

    Raises:
        ValueError: ``text`` is not of that form or a count is zero; the message
            names ``name`` and the value.
    """
    counts: list[int] = []
    for entry in text.split(","):
        match = _COUNT.fullmatch(entry.strip())
        if match is None or int(match.group(1)) < 1 or (match.group(2) and int(match.group(2)) < 1):
            raise ValueError(
                f"{name}={text!r} is not a list of task counts per node: expected entries like "
                f"'4' or '2(x3)' (2 tasks on each of 3 nodes), separated by commas, but found "
                f"{entry!r}; unset it to let srun set it")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_HOST = re.compile(r"[A-Za-z0-9._-]+")


def first_host_of_nodelist(nodelist: str, *, name: str = "SLURM_JOB_NODELIST") -> str:
    """The first host of a Slurm host list: ``"node[01-04,07],gpu5"`` -> ``"node01"``.

    Understands the forms Slurm writes: hosts separated by commas, each with any
    number of bracketed lists of numbers and ranges (``"rack[1-2]-n[003-010]"`` ->
    ``"rack1-n003"``; zero padding is kept). Parsed here, without ``scontrol``.

    Raises:
        ValueError: the list is empty, has unbalanced or nested brackets, or a
            bracket holds something other than numbers and ranges; the message
            names ``name`` and the value.
    """
    def bad(why: str) -> ValueError:
        return ValueError(f"{name}={nodelist!r} is not a Slurm host list ({why}); expected a form "
                          "like 'node[01-04,07],gpu5'. Set MASTER_ADDR to rank 0's host instead")

    text = nodelist.strip()
    depth, end = 0, len(text)
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise bad("nested '['")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise bad("']' without '['")
        elif char == "," and depth == 0:
            end = i
            break
    if depth != 0:
        raise bad("'[' without ']'")
    entry = text[:end]
    parts, pos = [], 0
    for bracket in re.finditer(r"\[([^\]]*)\]", entry):
        first = bracket.group(1).split(",")[0].strip()
        numbers = _RANGE.fullmatch(first)
        if numbers is None or (numbers.group(2) and int(numbers.group(2)) < int(numbers.group(1))):
            raise bad(f"[{bracket.group(1)}] does not start with a number or a range LOW-HIGH")
        parts += [entry[pos:bracket.start()], numbers.group(1)]
        pos = bracket.end()
    host = "".join(parts) + entry[pos:]
    if not _HOST.fullmatch(host):
        raise bad(f"its first host {host!r} is not a host name" if host else "no host")
    return host


# Note [srun's tasks]
# A batch script (sbatch) and an salloc shell see SLURM_PROCID=0 and SLURM_NTASKS,
# the number of tasks the allocation may run, just as srun's tasks do; a
# `python train.py` started there directly is one process, not task 0 of
# SLURM_NTASKS, and would wait at the rendezvous for tasks that never come. Only
# srun sets the step variables (SLURM_STEP_NUM_TASKS, SLURM_STEP_TASKS_PER_NODE,
# SLURM_STEP_NODELIST, Slurm's env_array_for_step), so their presence is what
# says "srun started me". They are also the step's own values: SLURM_NTASKS and
# SLURM_TASKS_PER_NODE are the job's under `srun --preserve-env`, and
# SLURM_JOB_NODELIST is the job's, whose first node may not be in the step.

def _slurm_world(environ: Mapping[str, str], require_master: bool) -> LaunchVars | None:
    if "SLURM_STEP_NUM_TASKS" not in environ:
        if "SLURM_NTASKS" in environ and _parse_int(environ, "SLURM_NTASKS", "Slurm") > 1:
            raise ValueError(
                f"SLURM_NTASKS={environ['SLURM_NTASKS'].strip()} and SLURM_PROCID="
                f"{environ['SLURM_PROCID'].strip()} are set but SLURM_STEP_NUM_TASKS is not: this "
                "process was not started by srun (a batch script or salloc shell running Python "
                "itself), so it is one process, not one of SLURM_NTASKS tasks. Start the tasks "
                "with `srun python train.py` (or one `tandem run` per node), or run a single "
                "process with `srun --ntasks 1 python train.py`")
        return None  # one process in a Slurm allocation: a world of one
    rank = _parse_int(environ, "SLURM_PROCID", "srun")
    world_size = _parse_int(environ, "SLURM_STEP_NUM_TASKS", "srun")
    if world_size < 1:
        raise ValueError(f"SLURM_STEP_NUM_TASKS={world_size} must be at least 1; it is the number "
                         "of tasks srun started, unset it if you set it yourself")
    if rank >= world_size:
        raise ValueError(f"SLURM_PROCID={rank} is not less than SLURM_STEP_NUM_TASKS={world_size}; "
                         "srun numbers its tasks from 0, unset them if you set them yourself")
    if "SLURM_LOCALID" not in environ:
        raise ValueError(f"SLURM_PROCID={rank} is set but SLURM_LOCALID is not; srun sets both, "
                         "set SLURM_LOCALID to this task's index on its node")
    local_rank = _parse_int(environ, "SLURM_LOCALID", "srun")
    local_world_size, source = _slurm_tasks_on_node(environ, world_size)
    _check_local(local_rank, local_world_size, world_size, ("SLURM_LOCALID", source),
                 "SLURM_STEP_NUM_TASKS", "check the srun options")
    if world_size == 1:
        return None  # `srun -n 1`: nobody to meet, no port needed
    master_addr: str | None = None
    master_port: int | None = None
    if require_master:
        master_addr, master_port = _slurm_master(environ)
    return LaunchVars(rank=rank, world_size=world_size, local_rank=local_rank,
                      local_world_size=local_world_size, master_addr=master_addr,
                      master_port=master_port, launcher=Launcher.SLURM)


def _slurm_tasks_on_node(environ: Mapping[str, str], world_size: int) -> tuple[int, str]:
    """The number of the step's tasks on this node, and where it came from (for messages)."""
    for name in _TASKS_PER_NODE_VARS + ("SLURM_NTASKS_PER_NODE",):
        if name not in environ:
            continue
        counts = parse_tasks_per_node(environ[name], name=name)
        exact = name in _TASKS_PER_NODE_VARS  # the layout srun made; the last is the request
        if exact and sum(counts) != world_size:
            raise ValueError(f"{name}={environ[name]!r} places {sum(counts)} tasks but "
                             f"SLURM_STEP_NUM_TASKS={world_size}; they come from the same srun, "
                             "unset the one you set yourself")
        source = f"this node's entry of {name}={environ[name]!r}"
        if len(set(counts)) == 1:
            return counts[0], source
        # Different counts on different nodes (srun -n 6 over 4 nodes: "2(x2),1(x2)"):
        # the entry of this node, by its index in the step's node list.
        if "SLURM_NODEID" not in environ:
            raise ValueError(f"{name}={environ[name]!r} differs between nodes, and SLURM_NODEID "
                             "(this node's index in the step, which picks the entry) is not set; "
                             "srun sets it")
        node = _parse_int(environ, "SLURM_NODEID", "srun")
        if node >= len(counts):
            raise ValueError(f"SLURM_NODEID={node} but {name}={environ[name]!r} lists "
                             f"{len(counts)} node(s); they come from the same srun, unset the one "
                             "you set yourself")
        return counts[node], source
    raise ValueError(f"SLURM_PROCID={environ['SLURM_PROCID'].strip()} is set but none of "
                     "SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE is; "
                     "srun sets the first two. Set SLURM_NTASKS_PER_NODE to the tasks per node, "
                     "or LOCAL_RANK/LOCAL_WORLD_SIZE with RANK/WORLD_SIZE")


def _slurm_master(environ: Mapping[str, str]) -> tuple[str, int]:
    if "MASTER_ADDR" in environ:
        addr = _parse_master_addr(environ)
    else:
        lists = [n for n in _NODELIST_VARS if n in environ]
        if not lists:
            raise ValueError("MASTER_ADDR is not set and neither is any of "
                             f"{', '.join(_NODELIST_VARS)} to take rank 0's host from; set "
                             "MASTER_ADDR to the host of the task with SLURM_PROCID=0")
        addr = first_host_of_nodelist(environ[lists[0]], name=lists[0])
    if "MASTER_PORT" in environ:
        return addr, _parse_master_port(environ)
    for name in ("SLURM_JOB_ID", "SLURM_JOBID"):
        if name in environ:
            return addr, slurm_default_port(_parse_int(environ, name, "Slurm"))
    raise ValueError("MASTER_PORT is not set and neither is SLURM_JOB_ID to derive one from; set "
                     "MASTER_PORT to a free TCP port on rank 0's host, the same for every task")


def _srun_task_of(environ: Mapping[str, str], rank: int, world_size: int) -> LaunchVars | None:
    """Slurm's view of this process when it is task ``rank`` of an srun step of
    ``world_size`` tasks; None otherwise, or when Slurm's variables do not parse
    (Note [local rank of an adopted group])."""
    if "SLURM_PROCID" not in environ or "SLURM_STEP_NUM_TASKS" not in environ:
        return None
    try:
        task = _slurm_world(environ, require_master=False)
    except ValueError:
        return None
    if task is None or (task.rank, task.world_size) != (rank, world_size):
        return None  # a step of one task (one node, as assumed anyway), or another world
    return task


# ------------------------------------------------------------------------------- helpers

def _check_local(local_rank: int, local_world_size: int, world_size: int, names: tuple[str, str],
                 world_name: str, fix: str) -> None:
    rank_name, size_name = names
    if local_world_size < 1:
        raise ValueError(f"{size_name}={local_world_size} must be at least 1; it is the number "
                         f"of processes on this node, {fix}")
    if local_world_size > world_size:
        raise ValueError(f"{size_name}={local_world_size} exceeds {world_name}={world_size}; "
                         f"a node cannot hold more processes than the job, {fix}")
    if local_rank >= local_world_size:
        raise ValueError(f"{rank_name}={local_rank} is not less than {size_name}="
                         f"{local_world_size}; local ranks run from 0 to {local_world_size - 1}, "
                         f"{fix}")


def _describe(environ: Mapping[str, str], present: list[str]) -> str:
    shown = ", ".join(f"{n}={environ[n]!r}" for n in present)
    return f"{shown} {'is' if len(present) == 1 else 'are'}"


def _parse_int(environ: Mapping[str, str], name: str, setter: str = "torchrun") -> int:
    raw = environ[name]
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; set it to a non-negative "
                         f"integer, as {setter} does") from None
    if value < 0:
        raise ValueError(f"{name}={value} is negative; set it to a non-negative integer, "
                         f"as {setter} does")
    return value


def _parse_master(environ: Mapping[str, str]) -> tuple[str, int]:
    for name in _MASTER_VARS:
        if name not in environ:
            raise ValueError(
                f"{name} is not set; the env:// rendezvous needs MASTER_ADDR and MASTER_PORT "
                "(the host and a free port of rank 0, torchrun sets both). Set them, or pass "
                "init_method='tcp://host:port' or 'file:///shared/path'")
    return _parse_master_addr(environ), _parse_master_port(environ)


def _parse_master_addr(environ: Mapping[str, str]) -> str:
    addr = environ["MASTER_ADDR"].strip()
    if not addr:
        raise ValueError("MASTER_ADDR='' is empty; set it to the host name or IP address "
                         "of rank 0's machine")
    return addr


def _parse_master_port(environ: Mapping[str, str]) -> int:
    raw_port = environ["MASTER_PORT"]
    try:
        port = int(raw_port.strip())
    except ValueError:
        raise ValueError(f"MASTER_PORT={raw_port!r} is not an integer; set it to a free "
                         "TCP port on rank 0's machine, 1..65535") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"MASTER_PORT={port} is outside 1..65535; set it to a free TCP port "
                         "on rank 0's machine")
    return port
