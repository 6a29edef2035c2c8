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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["LaunchVars", "WorldInfo", "world_from_env"]

_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_MASTER_VARS = ("MASTER_ADDR", "MASTER_PORT")
_SINGLE_PROCESS_HINT = "or unset all of RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, " \
                       "MASTER_ADDR, MASTER_PORT to run as a single process"


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
    """The device this process computes on: ``cuda:<local_rank>`` or ``cpu``."""
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


def world_from_env(environ: Mapping[str, str], *, require_master: bool = True) -> LaunchVars | None:
    """Read a launcher's rank variables from ``environ``.

    ``RANK`` and ``WORLD_SIZE`` are set together or not at all. ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` are set together (torchrun sets both) or not at all, which
    means a job on one node: local rank and size equal the global ones.

    Args:
        environ: the variables, ``os.environ`` or a plain dict.
        require_master: whether ``MASTER_ADDR`` and ``MASTER_PORT`` are read and
            required, as the ``env://`` rendezvous needs them. With False they are
            ignored (for ``tcp://`` and ``file://``, which carry their own address).

    Returns:
        The parsed variables, or None when none of the variables is set: no
        launcher, a world of one.

    Raises:
        ValueError: a variable is not a non-negative integer, one of a pair is
            missing, or the values contradict each other (``RANK >= WORLD_SIZE``,
            ``LOCAL_RANK >= LOCAL_WORLD_SIZE``, ``LOCAL_WORLD_SIZE > WORLD_SIZE``,
            ``MASTER_PORT`` outside 1..65535). The message names the variable, its
            value and what to set instead.
    """
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
    if local_world_size < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={local_world_size} must be at least 1; set it to "
                         "the number of processes on this node")
    if local_world_size > world_size:
        raise ValueError(f"LOCAL_WORLD_SIZE={local_world_size} exceeds WORLD_SIZE={world_size}; "
                         "a node cannot hold more processes than the job, check the launcher")
    if local_rank >= local_world_size:
        raise ValueError(f"LOCAL_RANK={local_rank} is not less than LOCAL_WORLD_SIZE="
                         f"{local_world_size}; local ranks run from 0 to {local_world_size - 1}, "
                         "check how the launcher assigns them")

    master_addr: str | None = None
    master_port: int | None = None
    if require_master:
        master_addr, master_port = _parse_master(environ)
    return LaunchVars(rank=rank, world_size=world_size, local_rank=local_rank,
                      local_world_size=local_world_size, master_addr=master_addr,
                      master_port=master_port)


def _describe(environ: Mapping[str, str], present: list[str]) -> str:
    shown = ", ".join(f"{n}={environ[n]!r}" for n in present)
    return f"{shown} {'is' if len(present) == 1 else 'are'}"


def _parse_int(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; set it to a non-negative "
                         "integer, as torchrun does") from None
    if value < 0:
        raise ValueError(f"{name}={value} is negative; set it to a non-negative integer, "
                         "as torchrun does")
    return value


def _parse_master(environ: Mapping[str, str]) -> tuple[str, int]:
    for name in _MASTER_VARS:
        if name not in environ:
            raise ValueError(
                f"{name} is not set; the env:// rendezvous needs MASTER_ADDR and MASTER_PORT "
                "(the host and a free port of rank 0, torchrun sets both). Set them, or pass "
                "init_method='tcp://host:port' or 'file:///shared/path'")
    addr = environ["MASTER_ADDR"].strip()
    if not addr:
        raise ValueError("MASTER_ADDR='' is empty; set it to the host name or IP address "
                         "of rank 0's machine")
    raw_port = environ["MASTER_PORT"]
    try:
        port = int(raw_port.strip())
    except ValueError:
        raise ValueError(f"MASTER_PORT={raw_port!r} is not an integer; set it to a free "
                         "TCP port on rank 0's machine, 1..65535") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"MASTER_PORT={port} is outside 1..65535; set it to a free TCP port "
                         "on rank 0's machine")
    return addr, port
