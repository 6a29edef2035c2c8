"""A launcher's variables, parsed: whose they are (:class:`Launcher`), what they
say (:class:`LaunchVars`), and the checks every launcher's values go through.
world.py reads torchrun's, slurm.py Slurm's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

__all__ = ["LaunchVars", "Launcher", "check_local", "parse_int", "parse_master_addr", "parse_master_port"]


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


def check_local(local_rank: int, local_world_size: int, world_size: int, names: tuple[str, str],
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


def parse_int(environ: Mapping[str, str], name: str, setter: str = "torchrun") -> int:
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


def parse_master_addr(environ: Mapping[str, str]) -> str:
    addr = environ["MASTER_ADDR"].strip()
    if not addr:
        raise ValueError("MASTER_ADDR='' is empty; set it to the host name or IP address "
                         "of rank 0's machine")
    return addr


def parse_master_port(environ: Mapping[str, str]) -> int:
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
