"""Start and stop this process's membership of the job: :func:`init` and :func:`shutdown`.

A script calls :func:`init` once at the top and works unchanged as one process
(``python train.py``) or many (``torchrun --nproc-per-node 4 train.py``,
``srun --ntasks-per-node 4 python train.py``): with no launcher it gets a real
process group of size one, so collectives still run. Where a process group
already exists (Ray Train, Lightning and user code create one), :func:`init`
adopts it instead of creating one.

The default process group is torch's, and ``torch.distributed.is_initialized()``
says whether there is one. What torch does not record is who created it: that is
tandem's one piece of state about it (Note [who owns the default group] in
group_record.py). Elastic jobs' groups are made in elastic_group.py, which
:func:`init` calls for a replacement worker.
"""

from __future__ import annotations

import datetime
import logging
import os
from urllib.parse import urlsplit

import torch.distributed as dist

from tandem._compat import bind_group_defaults_before_init, default_store
from tandem.control import group_record
from tandem.comm.connections import Connection
from tandem.comm.device import bind_device, default_backend
from tandem.control.elastic_group import JOIN_ENV, below_prefixes, default_group_connections, join_elastic
from tandem.comm.exit import uninstall_clean_exit
from tandem.store.job_secret import MANY_NODES_NEED_A_SECRET, job_secret
from tandem.store.listening_store import listening_store
from tandem.comm.monitor import stop_monitor
from tandem.store.store_address import EtcdAddress
from tandem.comm.timeouts import DEFAULT_TIMEOUT
from tandem.comm.world import Launcher, WorldInfo, local_from_env, world_from_env

__all__ = ["init", "shutdown"]

logger = logging.getLogger(__name__)


def init(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: datetime.timedelta | float | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
) -> WorldInfo:
    """Join the job: create (or adopt) the default process group and bind this
    process's device.

    Where the ranks come from depends on ``init_method``:

    - None: from the launcher's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
      ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, as torchrun sets them),
      joined through ``env://``. Without them, from Slurm's, as ``srun`` sets them
      for each task (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``,
      ...; see :func:`tandem.comm.world_from_env`), joined through
      ``tcp://`` at the first host of the step's node list (or ``MASTER_ADDR``) and
      a port derived from ``SLURM_JOB_ID`` (or ``MASTER_PORT``). With none of them
      set, a world of one: rank 0 of 1 in a real process group backed by an
      in-memory store.
    - ``"env://"``: the same variables, which must be set.
    - ``"tcp://host:port"`` or ``"file:///path"``: ``rank`` and ``world_size``
      from the keyword arguments, or else from ``RANK`` and ``WORLD_SIZE`` (or
      Slurm's). Local rank and size come from ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``
      (or Slurm's) when set, and otherwise equal the global ones (a job on one node).

    When torch.distributed is initialised already (Ray Train, Lightning, or the
    script called ``torch.distributed.init_process_group`` itself), :func:`init`
    adopts that group: rank and world size are the group's, the backend is
    ``dist.get_backend()``, local rank and size come from the variables above where
    they describe this group and otherwise assume one node, and the device is bound
    as below. :func:`shutdown` then leaves the group to its creator. Arguments
    passed while a group exists must agree with it; calling :func:`init` again with
    nothing contradicting returns the same :class:`WorldInfo`.

    Args:
        backend: process-group backend. None picks ``"nccl"`` when CUDA has a
            device, else ``"gloo"`` (or, for an existing group, takes its backend).
        init_method: rendezvous URL, see above.
        timeout: how long the rendezvous and each collective may wait, as a
            ``timedelta`` or seconds; None means :data:`DEFAULT_TIMEOUT` (10 min).
            An existing group keeps the timeout it was created with.
        rank: this process's rank, only with ``tcp://`` or ``file://``.
        world_size: number of processes, only with ``tcp://`` or ``file://``.

    Returns:
        This process's :class:`WorldInfo`. The device is ``cuda:<local_rank>``
        (made current with ``torch.cuda.set_device``) when the backend includes
        NCCL, otherwise the CPU. An ``srun`` task that sees fewer GPUs than its
        node has tasks (``--gpus-per-task``) gets ``cuda:0``, its own GPU.

    Raises:
        ValueError: the launcher's variables are inconsistent (or Slurm's say
            several tasks in a process that ``srun`` did not start),
            ``init_method`` is not one of the forms above, ``rank``/``world_size``
            are missing, out of range or contradict the environment, the timeout
            is not positive, NCCL was asked for without CUDA, or ``LOCAL_RANK``
            has no GPU to bind. With a group initialised already: ``backend``,
            ``rank``/``world_size``, ``init_method`` or (for a group :func:`init`
            created) ``timeout`` differ from the group's; the message names both
            values. Leave the argument out, or end the group first
            (:func:`shutdown` for one :func:`init` created).
        TypeError: ``timeout``, ``rank`` or ``world_size`` has the wrong type.

    Warning:
        A ``file://`` store must be a fresh path for every run: a file left over
        from an earlier run (or a crashed one) makes the rendezvous fail or hang
        until the timeout. ``env://`` and ``tcp://`` need a free port on rank 0.
    """
    scheme = _scheme(init_method)
    timeout_td = _as_timedelta(timeout)
    _check_rank_args(rank, world_size, scheme, init_method)
    if dist.is_initialized():
        return _join_existing(backend, init_method, scheme, timeout, timeout_td, rank, world_size)
    if os.environ.get(JOIN_ENV) == "1":
        return join_elastic(backend, init_method, timeout_td)

    launch = world_from_env(os.environ, require_master=scheme in (None, "env"))
    if scheme == "env" and launch is None:
        raise ValueError(
            "init_method='env://' but none of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (nor "
            "srun's SLURM_PROCID) is set; launch with torchrun or srun, or pass init_method=None "
            "for a single process")

    if rank is not None and world_size is not None:
        if launch is not None and (launch.rank, launch.world_size) != (rank, world_size):
            rank_var, size_var = launch.rank_vars
            raise ValueError(
                f"rank={rank}, world_size={world_size} contradict the environment's "
                f"{rank_var}={launch.rank}, {size_var}={launch.world_size}; pass the same values "
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

    backend = backend if backend is not None else default_backend()
    device = bind_device(backend, local_rank, rank, local_world_size=local_world_size,
                          slurm_task=launch is not None and launch.launcher is Launcher.SLURM)
    bind_group_defaults_before_init()

    connections: list[Connection] = []  # Note [severing a forgotten group] in tandem/comm/connections.py
    if scheme is None and launch is None:
        # A world of one has nobody to meet: an in-memory store needs no port or file.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout_td)
    else:
        url = init_method or "env://"
        if launch is not None and launch.launcher is Launcher.SLURM and scheme in (None, "env"):
            # Slurm's address and port may be derived, not in the environment that
            # env:// reads; tandem never writes os.environ, so the URL carries them.
            assert launch.master_addr is not None and launch.master_port is not None
            url = _tcp_url(launch.master_addr, launch.master_port)
            logger.debug("tandem: srun task %d of %d meets at %s", rank, world_size, url)
        many_nodes = local_world_size < world_size
        if many_nodes and job_secret() is None:  # Note [signed store] in tandem/store/job_secret.py
            raise ValueError(f"rank {rank}: {MANY_NODES_NEED_A_SECRET}")
        etcd = EtcdAddress.from_env() if scheme in (None, "env") else None
        hosted = (etcd.store(timeout_td) if etcd is not None   # Note [the workers' store on etcd]
                  else _hosted_store(url, rank, world_size, timeout_td, many_nodes=many_nodes))
        with default_group_connections(backend) as connections:
            if hosted is None:
                dist.init_process_group(backend, init_method=url, rank=rank, world_size=world_size,
                                        timeout=timeout_td)
            else:  # as torch's env:// and tcp:// do, with the store on the job's address
                dist.init_process_group(backend, store=dist.PrefixStore("default_pg", hosted), rank=rank,
                                        world_size=world_size, timeout=timeout_td)

    info = WorldInfo(rank=rank, local_rank=local_rank, world_size=world_size,
                     local_world_size=local_world_size, device=device, backend=backend)
    group_record.start_watch(info, timeout_td, owned=True, timeout=timeout_td, connections=tuple(connections))
    logger.info("tandem: rank %d/%d (local %d/%d), backend %s, device %s", info.rank,
                info.world_size, info.local_rank, info.local_world_size, info.backend,
                info.device)
    return info


def shutdown() -> None:
    """Leave the job: destroy the default process group if :func:`init` created it.

    A group that :func:`init` adopted (or one it never saw) is left initialised for
    its creator to destroy; only the monitor and the exit hook that :func:`init`
    added are removed. A no-op when there is no group. After it, :func:`init` may
    be called again (with a fresh ``file://`` path).
    """
    member = group_record.forget()
    if member is not None and member.elastic is not None:
        member.elastic.stop()  # its beat thread: Note [threads at exit] in group_record.py
    stop_monitor()
    uninstall_clean_exit()
    if not dist.is_initialized():
        return
    if member is not None and member.owned and member.is_current():
        dist.destroy_process_group()
    else:
        logger.debug("tandem: rank %d leaves the process group to its creator", dist.get_rank())


def _join_existing(backend: str | None, init_method: str | None, scheme: str | None,
                   timeout: datetime.timedelta | float | None, timeout_td: datetime.timedelta,
                   rank: int | None, world_size: int | None) -> WorldInfo:
    """:func:`init` with a default group in place: check the arguments against it,
    then return what an earlier :func:`init` returned, or adopt the group."""
    member = group_record.current()
    group_rank, group_size, group_backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    conflicts = []
    if backend is not None and backend.replace(" ", "").lower() != str(group_backend).lower():
        conflicts.append(f"backend={backend!r}, but the group's backend is {str(group_backend)!r}")
    if rank is not None and (rank, world_size) != (group_rank, group_size):
        conflicts.append(f"rank={rank}, world_size={world_size}, but the group has rank "
                         f"{group_rank} of {group_size}")
    store_conflict = _store_conflict(scheme, init_method)
    if store_conflict is not None:
        conflicts.append(store_conflict)
    if (timeout is not None and member is not None and member.timeout is not None
            and timeout_td != member.timeout):
        conflicts.append(f"timeout={timeout_td}, but the group was created with {member.timeout}")
    if conflicts:
        end = ("call tandem.shutdown() first to create another" if member is not None and member.owned
               else "destroy it first with torch.distributed.destroy_process_group() (its creator's "
                    "to destroy)")
        raise ValueError(
            f"rank {group_rank}: tandem.init() was asked for a different process group than the "
            f"one that is initialised: {'; '.join(conflicts)}. Leave these arguments out to use "
            f"the existing group, or {end}")
    if member is not None:
        return member.info
    return _adopt(timeout_td, timeout_given=timeout is not None)


def _adopt(timeout_td: datetime.timedelta, *, timeout_given: bool) -> WorldInfo:
    """Take the default group someone else created as this job's (Note [who owns the
    default group] in group_record.py); the environment gives only the local placement (Note [local
    rank of an adopted group] in tandem.comm.world)."""
    rank, world_size, backend = dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
    local_rank, local_world_size = local_from_env(os.environ, rank=rank, world_size=world_size)
    device = bind_device(backend, local_rank, rank)
    if timeout_given:
        logger.warning("tandem: rank %d: timeout=%s is not applied to the existing process group, "
                       "which keeps the timeout it was created with", rank, timeout_td)
    info = WorldInfo(rank=rank, local_rank=local_rank, world_size=world_size,
                     local_world_size=local_world_size, device=device, backend=backend)
    group_record.start_watch(info, timeout_td, owned=False, timeout=None)
    logger.info("tandem: rank %d/%d (local %d/%d), backend %s, device %s; adopted the existing "
                "process group (tandem.shutdown() leaves it to its creator)", info.rank,
                info.world_size, info.local_rank, info.local_world_size, info.backend, info.device)
    return info


def _store_conflict(scheme: str | None, init_method: str | None) -> str | None:
    """How the existing group's store contradicts ``init_method``, or None.

    torch keeps no rendezvous URL, but the store the group met through has the
    same address: a file's path, or a TCP port (hosts are not compared: one
    machine has many names)."""
    if scheme is None or init_method is None:
        return None
    store: object = below_prefixes(default_store())
    asked = f"init_method={init_method!r}"
    if isinstance(store, dist.HashStore):
        return f"{asked}, but the group was created with an in-memory store (a world of one)"
    if isinstance(store, dist.FileStore):
        path: str = getattr(store, "path", "")  # FileStore.path: torch >= 2.1, not in its stubs
        if scheme != "file" or (path and os.path.abspath(urlsplit(init_method).path)
                                != os.path.abspath(path)):
            return f"{asked}, but the group met through the file store 'file://{path}'"
        return None
    if isinstance(store, dist.TCPStore):
        if scheme == "file":
            return f"{asked}, but the group met through a TCP store on port {store.port}"
        port: int | None = urlsplit(init_method).port if scheme == "tcp" else None
        if scheme == "env":
            raw = os.environ.get("MASTER_PORT", "").strip()
            port = int(raw) if raw.isdigit() else None
        if port is not None and port != store.port:
            return f"{asked} means port {port}, but the group met through a TCP store on port {store.port}"
    return None


def _hosted_store(url: str, rank: int, world_size: int, timeout: datetime.timedelta, *,
                  many_nodes: bool) -> dist.Store | None:
    """Rank 0's store for an ``env://`` or ``tcp://`` rendezvous that no launcher
    hosts, listening on the job's address (Note [a store on the job's address] in
    tandem/store/listening_store.py); None where torch makes or reaches the store itself
    (another rank, ``file://``, or torchrun's and tandem run's agent store)."""
    if rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    parts = urlsplit(url)
    if parts.scheme == "env":
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    elif parts.scheme == "tcp" and parts.hostname and parts.port is not None:
        host, port = parts.hostname, parts.port
    else:
        return None
    return listening_store(host, port, timeout=timeout, world_size=world_size, wait_for_workers=True,
                           multi_tenant=True, many_nodes=many_nodes)


def _tcp_url(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"


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
