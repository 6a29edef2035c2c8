"""Start and stop this process's membership of the job: :func:`init` and :func:`shutdown`.

The only state is torch's own: ``torch.distributed.is_initialized()`` says whether
:func:`init` has run, and the default process group is the group every collective
uses unless told otherwise. Nothing is cached here.

A script calls :func:`init` once at the top and works unchanged as one process
(``python train.py``) or many (``torchrun --nproc-per-node 4 train.py``): with no
launcher it gets a real process group of size one, so collectives still run.
"""

from __future__ import annotations

import datetime
import logging
import os
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from tandem._compat import bind_group_defaults_before_init
from tandem.comm.exit import install_clean_exit, uninstall_clean_exit
from tandem.comm.monitor import start_monitor, stop_monitor
from tandem.comm.world import WorldInfo, world_from_env

__all__ = ["DEFAULT_TIMEOUT", "init", "shutdown"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
"""How long the rendezvous and each collective may wait for the other ranks.

Ten minutes, like torch's NCCL default and a third of its gloo default: long enough
for a slow rank to load data or a checkpoint, short enough that a hung job fails
while someone is still watching."""


def init(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: datetime.timedelta | float | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
) -> WorldInfo:
    """Join the job: create the default process group and bind this process's device.

    Where the ranks come from depends on ``init_method``:

    - None: from the launcher's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
      ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, as torchrun sets them),
      joined through ``env://``. With none of them set, a world of one: rank 0 of 1
      in a real process group backed by an in-memory store.
    - ``"env://"``: the same variables, which must be set.
    - ``"tcp://host:port"`` or ``"file:///path"``: ``rank`` and ``world_size``
      from the keyword arguments, or else from ``RANK`` and ``WORLD_SIZE``. Local
      rank and size come from ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` when set, and
      otherwise equal the global ones (a job on one node).

    Args:
        backend: process-group backend. None picks ``"nccl"`` when CUDA has a
            device, else ``"gloo"``.
        init_method: rendezvous URL, see above.
        timeout: how long the rendezvous and each collective may wait, as a
            ``timedelta`` or seconds; None means :data:`DEFAULT_TIMEOUT` (10 min).
        rank: this process's rank, only with ``tcp://`` or ``file://``.
        world_size: number of processes, only with ``tcp://`` or ``file://``.

    Returns:
        This process's :class:`WorldInfo`. The device is ``cuda:<local_rank>``
        (made current with ``torch.cuda.set_device``) when the backend includes
        NCCL, otherwise the CPU.

    Raises:
        RuntimeError: torch.distributed is already initialised; call
            :func:`shutdown` first.
        ValueError: the launcher's variables are inconsistent, ``init_method`` is
            not one of the forms above, ``rank``/``world_size`` are missing,
            out of range or contradict the environment, the timeout is not
            positive, NCCL was asked for without CUDA, or ``LOCAL_RANK`` has no
            GPU to bind.
        TypeError: ``timeout``, ``rank`` or ``world_size`` has the wrong type.

    .. warning::
        A ``file://`` store must be a fresh path for every run: a file left over
        from an earlier run (or a crashed one) makes the rendezvous fail or hang
        until the timeout. ``env://`` and ``tcp://`` need a free port on rank 0.
    """
    if dist.is_initialized():
        raise RuntimeError(
            f"torch.distributed is already initialised (rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, backend {dist.get_backend()}); call "
            "tandem.shutdown() before calling tandem.init() again")
    scheme = _scheme(init_method)
    timeout_td = _as_timedelta(timeout)
    _check_rank_args(rank, world_size, scheme, init_method)

    launch = world_from_env(os.environ, require_master=scheme in (None, "env"))
    if scheme == "env" and launch is None:
        raise ValueError(
            "init_method='env://' but none of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT is "
            "set; launch with torchrun, or pass init_method=None for a single process")

    if rank is not None and world_size is not None:
        if launch is not None and (launch.rank, launch.world_size) != (rank, world_size):
            raise ValueError(
                f"rank={rank}, world_size={world_size} contradict the environment's "
                f"RANK={launch.rank}, WORLD_SIZE={launch.world_size}; pass the same values "
                "or leave the keyword arguments out")
        if launch is not None:
            local_rank, local_world_size = launch.local_rank, launch.local_world_size
        else:
            local_rank, local_world_size = rank, world_size
    elif launch is not None:
        rank, world_size = launch.rank, launch.world_size
        local_rank, local_world_size = launch.local_rank, launch.local_world_size
    elif scheme is None:
        rank, world_size, local_rank, local_world_size = 0, 1, 0, 1
    else:
        raise ValueError(
            f"init_method={init_method!r} needs this process's rank and the world size; "
            "pass rank= and world_size=, or set RANK and WORLD_SIZE")

    backend = backend if backend is not None else _default_backend()
    device = _bind_device(backend, local_rank, rank)
    bind_group_defaults_before_init()

    if scheme is None and launch is None:
        # A world of one has nobody to meet: an in-memory store needs no port or file.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout_td)
    else:
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                                world_size=world_size, timeout=timeout_td)

    start_monitor(timeout_s=timeout_td.total_seconds())
    install_clean_exit()  # Note [exit on an uncaught exception] in tandem.comm.exit
    info = WorldInfo(rank=rank, local_rank=local_rank, world_size=world_size,
                     local_world_size=local_world_size, device=device, backend=backend)
    logger.info("tandem: rank %d/%d (local %d/%d), backend %s, device %s", info.rank,
                info.world_size, info.local_rank, info.local_world_size, info.backend,
                info.device)
    return info


def shutdown() -> None:
    """Leave the job: destroy the default process group. A no-op when there is none.

    After it, :func:`init` may be called again (with a fresh ``file://`` path).
    """
    if dist.is_initialized():
        stop_monitor()
        uninstall_clean_exit()
        dist.destroy_process_group()


def _scheme(init_method: str | None) -> str | None:
    if init_method is None:
        return None
    if not isinstance(init_method, str):
        raise TypeError(f"init_method must be a str or None, got {init_method!r}")
    parts = urlsplit(init_method)
    if parts.scheme == "env":
        return "env"
    if parts.scheme == "tcp":
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            raise ValueError(f"init_method={init_method!r} needs a host and a port, as in "
                             "'tcp://10.0.0.1:29500'")
        return "tcp"
    if parts.scheme == "file":
        if not parts.path:
            raise ValueError(f"init_method={init_method!r} needs a path, as in "
                             "'file:///shared/tmp/job-store'")
        return "file"
    raise ValueError(f"init_method={init_method!r} is not supported; use None (the launcher's "
                     "variables), 'env://', 'tcp://host:port' or 'file:///path'")


def _as_timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        td = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        td = datetime.timedelta(seconds=timeout)
    else:
        raise TypeError(f"timeout must be a datetime.timedelta or seconds as a number, "
                        f"got {timeout!r}")
    if td <= datetime.timedelta(0):
        raise ValueError(f"timeout must be positive, got {td}; pass None for the default "
                         f"({DEFAULT_TIMEOUT})")
    return td


def _check_rank_args(rank: int | None, world_size: int | None, scheme: str | None,
                     init_method: str | None) -> None:
    if rank is None and world_size is None:
        return
    if scheme not in ("tcp", "file"):
        raise ValueError(
            f"rank={rank}, world_size={world_size} were given with init_method={init_method!r}, "
            "where the launcher's RANK and WORLD_SIZE are used; leave them out, or pass "
            "init_method='tcp://host:port' or 'file:///path'")
    if rank is None or world_size is None:
        missing = "rank" if rank is None else "world_size"
        raise ValueError(f"rank={rank}, world_size={world_size}: pass both or neither "
                         f"({missing} is missing)")
    for name, value in (("rank", rank), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in 0..{world_size - 1} for world_size={world_size}")


def _default_backend() -> str:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return "nccl"
    return "gloo"


def _bind_device(backend: str, local_rank: int, rank: int) -> torch.device:
    # "nccl" or a per-device spec such as "cpu:gloo,cuda:nccl": the job computes on GPUs.
    if "nccl" not in backend:
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"rank {rank}: backend {backend!r} needs CUDA, but "
                         "torch.cuda.is_available() is False; pass backend='gloo' or None")
    if local_rank >= count:
        raise ValueError(
            f"rank {rank}: LOCAL_RANK={local_rank} but this node has {count} CUDA device(s); "
            f"start at most {count} processes per node (torchrun --nproc-per-node {count}), "
            "or set LOCAL_RANK and LOCAL_WORLD_SIZE if the launcher did not")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)
