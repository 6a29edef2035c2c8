"""The rules that turn what the user typed on ``tandem run``'s command line into
a job's values: how many workers, how many threads each, which ranks to show,
how the nodes meet.

Everything here is pure. The machine's CPU and GPU counts and the launcher's
environment are arguments, so every rule can be tested on a grid of made-up
machines in one process; :mod:`tandem.launch.cli` measures the real ones.

# Note [free port]
A job on one node needs no port from the user. Its rendezvous store is created
on ``localhost:0``: the operating system picks an unused port at the moment the
store binds it, so two jobs on one machine never collide. Probing for a free port
and passing its number on would leave a window in which another job can take it.
The store each attempt's workers meet in is made the same way, on port 0 (see
:mod:`tandem.launch.rendezvous`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["AUTO_MAX_CPU_WORKERS", "NprocChoice", "RendezvousChoice", "STANDALONE_ENDPOINT", "bracket",
           "parse_nnodes", "parse_rank_list", "parse_rdzv_conf", "resolve_nproc", "resolve_rendezvous",
           "split_endpoint", "threads_per_worker"]

AUTO_MAX_CPU_WORKERS = 8
"""``--nproc-per-node auto`` on a machine without GPUs starts one worker per core up
to this many; the cores left over become each worker's OpenMP threads. Every
extra process holds another replica of the model and adds a peer to every
all-reduce, while threads inside one process share both."""

STANDALONE_ENDPOINT = "localhost:0"
"""Where a job on one node meets: a free local port (Note [free port])."""


@dataclass(frozen=True)
class NprocChoice:
    """How many workers this node starts, and why (for the one line the launcher prints)."""

    nproc: int
    """Workers on this node."""
    reason: str
    """What the number came from, e.g. ``"auto: 2 CPU cores, no GPU"``."""


def resolve_nproc(value: str, *, cpus: int, gpus: int) -> NprocChoice:
    """Turn ``--nproc-per-node`` into a number of workers.

    Args:
        value: a positive integer, ``"auto"`` (one per GPU; without GPUs one per
            CPU core up to :data:`AUTO_MAX_CPU_WORKERS`), ``"cpu"`` (one per CPU
            core, as torchrun) or ``"gpu"`` (one per GPU).
        cpus: CPU cores this process may run on.
        gpus: visible CUDA devices.

    Raises:
        ValueError: ``value`` is not one of those, is not positive, or asks for
            GPUs on a machine without any.
    """
    text = str(value).strip()
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is not None:
        if n < 1:
            raise ValueError(f"--nproc-per-node {text}: the number of workers per node must be "
                             "at least 1; pass a positive number, or auto, cpu or gpu")
        return NprocChoice(n, "as asked")
    if text == "gpu":
        if gpus < 1:
            raise ValueError("--nproc-per-node gpu: this machine has no CUDA device; pass a "
                             "number, cpu, or auto (which falls back to CPU workers)")
        return NprocChoice(gpus, f"gpu: {gpus} GPU(s)")
    if text == "cpu":
        return NprocChoice(cpus, f"cpu: {cpus} CPU core(s)")
    if text == "auto":
        if gpus > 0:
            return NprocChoice(gpus, f"auto: {gpus} GPU(s)")
        n = max(1, min(cpus, AUTO_MAX_CPU_WORKERS))
        return NprocChoice(n, f"auto: {cpus} CPU core(s), no GPU")
    raise ValueError(f"--nproc-per-node {text!r} is not supported; pass a positive number, "
                     "auto, cpu or gpu")


def threads_per_worker(nproc: int, *, cpus: int, environ: Mapping[str, str]) -> int | None:
    """OMP_NUM_THREADS for each worker, or None to leave the user's own value alone.

    The node's cores are shared out evenly (at least one thread each), so that
    ``nproc`` workers never run more threads than there are cores. torchrun sets
    1 whatever the core count, which leaves cores idle when there are fewer
    workers than cores.
    """
    if "OMP_NUM_THREADS" in environ:
        return None
    return max(1, cpus // max(1, nproc))


def parse_nnodes(value: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` to ``(min_nodes, max_nodes)``.

    Raises:
        ValueError: not of that form, or not ``1 <= MIN <= MAX``.
    """
    parts = str(value).strip().split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"--nnodes {value!r} must be a number of nodes N or a range MIN:MAX, "
                         "as in --nnodes 2 or --nnodes 1:4") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"--nnodes {value!r} must satisfy 1 <= MIN <= MAX")
    return lo, hi


def parse_rank_list(value: str, *, flag: str) -> frozenset[int]:
    """``"0,2-3"`` to ``{0, 2, 3}``.

    Raises:
        ValueError: not a comma-separated list of ranks and ``A-B`` ranges.
    """
    ranks: set[int] = set()
    for item in str(value).split(","):
        item = item.strip()
        try:
            if "-" in item:
                a, b = (int(x) for x in item.split("-", 1))
                if a > b or a < 0:
                    raise ValueError
                ranks.update(range(a, b + 1))
            else:
                r = int(item)
                if r < 0:
                    raise ValueError
                ranks.add(r)
        except ValueError:
            raise ValueError(f"{flag} {value!r} must be a comma-separated list of ranks and "
                             "ranges, as in 0 or 0,2-3") from None
    return frozenset(ranks)


def parse_rdzv_conf(value: str) -> tuple[tuple[str, str], ...]:
    """torchrun's ``--rdzv-conf key1=value1,key2=value2`` to pairs.

    Raises:
        ValueError: an item is not ``key=value``.
    """
    pairs = []
    for item in str(value).split(","):
        if not item.strip():
            continue
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--rdzv-conf {value!r}: {item!r} is not key=value, as in "
                             "--rdzv-conf join_timeout=900")
        pairs.append((key.strip(), val.strip()))
    return tuple(pairs)


@dataclass(frozen=True)
class RendezvousChoice:
    """Where the nodes meet, chosen by :func:`resolve_rendezvous`."""

    backend: str
    """``"c10d"`` (one node hosts a store, nodes may come and go) or ``"static"``
    (fixed node ranks, node 0 hosts the store on ``--master-port``)."""
    endpoint: str
    """``host:port`` of the rendezvous store; port 0 means a free one (one node)."""
    run_id: str
    """Names the job in the store; equal on every node."""
    reason: str
    """One phrase for the launcher's summary line."""


def resolve_rendezvous(*, standalone: bool, max_nodes: int, rdzv_backend: str | None,
                       rdzv_endpoint: str | None, rdzv_id: str | None, master_addr: str | None,
                       master_port: int | None) -> RendezvousChoice:
    """Decide how the nodes meet, from torchrun's flags.

    - ``--standalone``, or one node and no ``--master-port``/``--rdzv-endpoint``:
      c10d on a free local port and a fresh run id (see Note [free port]).
    - ``--rdzv-endpoint host:port``: c10d unless ``--rdzv-backend`` says otherwise
      (torchrun defaults to static here, which then needs ``--node-rank`` on every
      node); nodes get their ranks in the order they arrive.
    - ``--master-port`` (and ``--master-addr``, default 127.0.0.1): static, node
      ranks from ``--node-rank``.

    Raises:
        ValueError: the flags contradict each other or a multi-node job has no
            address to meet at.
    """
    backend = rdzv_backend.strip() if rdzv_backend else None
    if standalone:
        if max_nodes > 1:
            raise ValueError(f"--standalone starts a job on this node only, but --nnodes asks for "
                             f"up to {max_nodes} nodes; drop --standalone and pass --rdzv-endpoint "
                             "host:port (or --master-addr/--master-port with --node-rank)")
        return RendezvousChoice("c10d", STANDALONE_ENDPOINT, uuid.uuid4().hex,
                                "standalone, rendezvous on a free local port")
    if rdzv_endpoint:
        backend = backend or "c10d"
        if backend == "static":
            host, port = split_endpoint(rdzv_endpoint, "--rdzv-endpoint")
            return RendezvousChoice("static", f"{host}:{port}", rdzv_id or "none",
                                    f"static rendezvous at {host}:{port}")
        return RendezvousChoice(backend, rdzv_endpoint.strip(), rdzv_id or "none",
                                f"{backend} rendezvous at {rdzv_endpoint.strip()}")
    if backend not in (None, "static", "c10d"):
        raise ValueError(f"--rdzv-backend {backend} needs --rdzv-endpoint host:port")
    if master_port is not None and backend != "c10d":
        addr = master_addr or "127.0.0.1"
        return RendezvousChoice("static", f"{bracket(addr)}:{master_port}", rdzv_id or "none",
                                f"static rendezvous at {addr}:{master_port}")
    if max_nodes == 1:
        return RendezvousChoice("c10d", STANDALONE_ENDPOINT, uuid.uuid4().hex,
                                "one node, rendezvous on a free local port")
    raise ValueError(f"a job on up to {max_nodes} nodes needs a place to meet: pass "
                     "--rdzv-endpoint host:port (the same on every node), or --master-addr, "
                     "--master-port and a different --node-rank on each node")


def bracket(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


def split_endpoint(endpoint: str, flag: str) -> tuple[str, int]:
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not host:
        raise ValueError(f"{flag} {endpoint!r} must be host:port, as in 10.0.0.1:29500")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"{flag} {endpoint!r}: port {port!r} is not a number") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"{flag} {endpoint!r}: port {number} is outside 0..65535")
    return host, number
