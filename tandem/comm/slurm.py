"""Slurm: who this process is among the tasks ``srun`` started, from Slurm's
variables (table in world.py's docstring), and the pure parsers of Slurm's
compressed lists (per-node task counts, node lists) and its default port."""

from __future__ import annotations

import re
from collections.abc import Mapping

from tandem.comm.launch_vars import LaunchVars, Launcher, check_local, parse_int, parse_master_addr, \
    parse_master_port

__all__ = ["SLURM_PORT_BASE", "SLURM_PORT_SPAN", "first_host_of_nodelist", "parse_tasks_per_node",
           "slurm_default_port", "slurm_world", "srun_task_of"]

_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")

SLURM_PORT_BASE = 10000
"""Lowest port :func:`slurm_default_port` picks."""
SLURM_PORT_SPAN = 20000
"""How many ports :func:`slurm_default_port` picks from: 10000..29999, below Linux's
ephemeral range (32768 and up), so no outgoing connection on the node holds it."""


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

def slurm_world(environ: Mapping[str, str], require_master: bool) -> LaunchVars | None:
    if "SLURM_STEP_NUM_TASKS" not in environ:
        if "SLURM_NTASKS" in environ and parse_int(environ, "SLURM_NTASKS", "Slurm") > 1:
            raise ValueError(
                f"SLURM_NTASKS={environ['SLURM_NTASKS'].strip()} and SLURM_PROCID="
                f"{environ['SLURM_PROCID'].strip()} are set but SLURM_STEP_NUM_TASKS is not: this "
                "process was not started by srun (a batch script or salloc shell running Python "
                "itself), so it is one process, not one of SLURM_NTASKS tasks. Start the tasks "
                "with `srun python train.py` (or one `tandem run` per node), or run a single "
                "process with `srun --ntasks 1 python train.py`")
        return None  # one process in a Slurm allocation: a world of one
    rank = parse_int(environ, "SLURM_PROCID", "srun")
    world_size = parse_int(environ, "SLURM_STEP_NUM_TASKS", "srun")
    if world_size < 1:
        raise ValueError(f"SLURM_STEP_NUM_TASKS={world_size} must be at least 1; it is the number "
                         "of tasks srun started, unset it if you set it yourself")
    if rank >= world_size:
        raise ValueError(f"SLURM_PROCID={rank} is not less than SLURM_STEP_NUM_TASKS={world_size}; "
                         "srun numbers its tasks from 0, unset them if you set them yourself")
    if "SLURM_LOCALID" not in environ:
        raise ValueError(f"SLURM_PROCID={rank} is set but SLURM_LOCALID is not; srun sets both, "
                         "set SLURM_LOCALID to this task's index on its node")
    local_rank = parse_int(environ, "SLURM_LOCALID", "srun")
    local_world_size, source = _slurm_tasks_on_node(environ, world_size)
    check_local(local_rank, local_world_size, world_size, ("SLURM_LOCALID", source),
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
        node = parse_int(environ, "SLURM_NODEID", "srun")
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
        addr = parse_master_addr(environ)
    else:
        lists = [n for n in _NODELIST_VARS if n in environ]
        if not lists:
            raise ValueError("MASTER_ADDR is not set and neither is any of "
                             f"{', '.join(_NODELIST_VARS)} to take rank 0's host from; set "
                             "MASTER_ADDR to the host of the task with SLURM_PROCID=0")
        addr = first_host_of_nodelist(environ[lists[0]], name=lists[0])
    if "MASTER_PORT" in environ:
        return addr, parse_master_port(environ)
    for name in ("SLURM_JOB_ID", "SLURM_JOBID"):
        if name in environ:
            return addr, slurm_default_port(parse_int(environ, name, "Slurm"))
    raise ValueError("MASTER_PORT is not set and neither is SLURM_JOB_ID to derive one from; set "
                     "MASTER_PORT to a free TCP port on rank 0's host, the same for every task")


def srun_task_of(environ: Mapping[str, str], rank: int, world_size: int) -> LaunchVars | None:
    """Slurm's view of this process when it is task ``rank`` of an srun step of
    ``world_size`` tasks; None otherwise, or when Slurm's variables do not parse
    (Note [local rank of an adopted group] in world.py)."""
    if "SLURM_PROCID" not in environ or "SLURM_STEP_NUM_TASKS" not in environ:
        return None
    try:
        task = slurm_world(environ, require_master=False)
    except ValueError:
        return None
    if task is None or (task.rank, task.world_size) != (rank, world_size):
        return None  # a step of one task (one node, as assumed anyway), or another world
    return task
