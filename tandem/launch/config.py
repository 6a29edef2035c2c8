"""What a ``tandem run`` job is, as plain data (:class:`LaunchConfig`), and the
rules that turn what the user typed on the command line into its values: how
many workers, how many threads each, which ranks to show, how the nodes meet.

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

__all__ = ["AUTO_MAX_CPU_WORKERS", "bracket", "DEFAULT_RDZV_TIMEOUT_S", "LaunchConfig", "NprocChoice",
           "parse_nnodes", "parse_rank_list", "parse_rdzv_conf", "RendezvousChoice", "resolve_nproc",
           "resolve_rendezvous", "split_endpoint", "STANDALONE_ENDPOINT", "threads_per_worker"]

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

DEFAULT_RDZV_TIMEOUT_S = 600.0
"""How long the nodes may take to meet (torchrun's c10d default): long enough for a
cluster scheduler to start the last node, short enough to notice a node that
was never started."""

_FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """One node's share of a job: how many workers, where the nodes meet, how
    failures are handled and what the workers' output looks like.

    Raises:
        ValueError: a field is out of range; the message names the flag.
    """

    nproc_per_node: int
    """Workers this node starts (``--nproc-per-node``, resolved)."""
    min_nodes: int = 1
    """The job starts once this many nodes have met (``--nnodes MIN:MAX``)."""
    max_nodes: int = 1
    """No more nodes than this join the job."""
    node_rank: int = 0
    """This node's rank for the static rendezvous (``--node-rank``)."""
    rdzv_backend: str = "c10d"
    """``"c10d"`` or ``"static"`` (see :func:`resolve_rendezvous`)."""
    rdzv_endpoint: str = STANDALONE_ENDPOINT
    """``host:port`` where the nodes meet; port 0: a free one, one node only."""
    rdzv_id: str = "none"
    """Names the job in the rendezvous store, equal on every node."""
    rdzv_timeout_s: float = DEFAULT_RDZV_TIMEOUT_S
    """The launcher fails, saying so, if the nodes have not met within this."""
    rdzv_options: tuple[tuple[str, str], ...] = ()
    """Extra rendezvous settings (``--rdzv-conf``); they win over the ones derived here."""
    max_restarts: int = 0
    """After a worker fails, the whole group is restarted up to this many times."""
    monitor_interval_s: float = 0.1
    """How often the agent checks its workers: a failure tears the job down this fast."""
    hang_timeout_s: float | None = None
    """When no worker completes a collective or starts a step for this long, the
    launcher reports where each rank is, stops them and counts a failure
    (``--hang-timeout``); None: no watchdog."""
    elastic: bool = False  # Note [elastic launch] in elastic_agent.py
    """A dead worker does not stop the others (``--elastic``): a script training with
    tandem.Trainer shrinks and goes on, and up to ``max_restarts`` replacements
    (new processes with the same command) join it; the workers get
    ``TANDEM_ELASTIC=1``."""
    spare: bool = True
    """Under ``elastic`` with replacements, keep a spare worker that has imported
    torch and tandem, to become the next replacement (Note [spare workers] in
    spare.py); False (``--no-spare``): each replacement starts when a worker dies."""
    open_stores: bool = False
    """A job of several nodes leaves its stores open to the network, as torchrun's
    are (``--open-stores``), instead of behind TLS keyed by the job secret (Note
    [stores behind TLS] in tunnel.py)."""
    debug_collectives: bool = False
    """The workers compare every collective before issuing it (``--debug-collectives``,
    ``TANDEM_DEBUG=collectives``): a mismatch raises on every rank at once."""
    omp_num_threads: int | None = None
    """OMP_NUM_THREADS given to each worker; None leaves the inherited value."""
    output_ranks: frozenset[int] | None = None
    """Only these global ranks' output reaches the console (None: all); the log
    files always have everything."""
    output_local_ranks: frozenset[int] | None = None
    """Only these local ranks' output reaches the console (torchrun's
    ``--local-ranks-filter``)."""
    log_dir: str | None = None
    """Where the workers' logs go; None: a temporary directory, removed after a
    job that succeeds."""
    local_addr: str | None = None
    """This node's address as the other nodes should see it (``--local-addr``)."""
    role: str = "default"
    """The workers' role name (``ROLE_NAME``)."""
    start_method: str = "spawn"
    """How function workers (``tandem.spawn``) are started: spawn, fork or forkserver."""
    exit_barrier_timeout_s: float = 300.0
    """How long a node whose workers finished waits for the other nodes' workers."""
    nproc_reason: str = "as asked"
    """Where ``nproc_per_node`` came from, for the summary line."""
    rdzv_reason: str = ""
    """How the rendezvous was chosen, for the summary line."""

    def __post_init__(self) -> None:
        _check(self.nproc_per_node >= 1, "--nproc-per-node", self.nproc_per_node, "at least 1")
        _check(1 <= self.min_nodes <= self.max_nodes, "--nnodes",
               f"{self.min_nodes}:{self.max_nodes}", "1 <= MIN <= MAX")
        _check(self.max_restarts >= 0, "--max-restarts", self.max_restarts, "0 or more")
        _check(self.monitor_interval_s > 0, "--monitor-interval", self.monitor_interval_s,
               "a positive number of seconds")
        _check(self.rdzv_timeout_s > 0, "--rdzv-timeout", self.rdzv_timeout_s,
               "a positive number of seconds")
        _check(self.hang_timeout_s is None or self.hang_timeout_s > 0, "--hang-timeout",
               self.hang_timeout_s, "a positive number of seconds")
        _check(self.exit_barrier_timeout_s > 0, "exit_barrier_timeout_s",
               self.exit_barrier_timeout_s, "a positive number of seconds")
        _check(self.omp_num_threads is None or self.omp_num_threads >= 1, "omp_num_threads",
               self.omp_num_threads, "at least 1, or None")
        _check(self.start_method in ("spawn", "fork", "forkserver"), "--start-method",
               self.start_method, "spawn, fork or forkserver")
        _check(self.rdzv_backend != "" and self.rdzv_endpoint != "", "--rdzv-backend/--rdzv-endpoint",
               f"{self.rdzv_backend!r} {self.rdzv_endpoint!r}", "non-empty")
        if self.rdzv_backend == "static":
            _check(self.min_nodes == self.max_nodes, "--nnodes", f"{self.min_nodes}:{self.max_nodes}",
                   "a fixed number with the static rendezvous (--master-port); use "
                   "--rdzv-endpoint for a range of nodes")
            _check(0 <= self.node_rank < self.max_nodes, "--node-rank", self.node_rank,
                   f"in 0..{self.max_nodes - 1} for --nnodes {self.max_nodes}")
            split_endpoint(self.rdzv_endpoint, "--master-addr/--master-port")
        if self.rdzv_endpoint.endswith(":0"):
            _check(self.max_nodes == 1, "--nnodes", self.max_nodes,
                   "1 with a rendezvous on a free local port")

    @property
    def first_endpoint(self) -> str:
        """``--rdzv-endpoint``'s first ``host:port`` (etcd's takes one per member)."""
        return self.rdzv_endpoint.split(",")[0].strip()

    @property
    def worker_env(self) -> dict[str, str]:
        """Variables the launcher adds to each worker's environment, on top of
        torchrun's (RANK, WORLD_SIZE, ...) which the elastic agent sets."""
        env: dict[str, str] = {}
        if self.omp_num_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.omp_num_threads)
        # Python workers flush every write, so each line reaches the console as it is printed.
        env.setdefault("PYTHONUNBUFFERED", "1")
        # torchrun (2.6 and later) leaves this in its own environment for the workers to
        # inherit: the signals the agent forwards.
        env.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", _FORWARDED_SIGNALS)
        if self.debug_collectives:
            env["TANDEM_DEBUG"] = "collectives"
        if self.elastic:
            env["TANDEM_ELASTIC"] = "1"
        return env

    def rendezvous_options(self) -> dict[str, object]:
        """Settings for torch's rendezvous handler: the timeout under the name the
        backend reads, the node rank for static (an int: the static handler
        compares it with 0), then ``--rdzv-conf``."""
        opts: dict[str, object] = {}
        timeout = max(1, round(self.rdzv_timeout_s))
        if self.rdzv_backend == "static":
            opts["rank"] = self.node_rank
            opts["timeout"] = timeout
        else:
            opts["join_timeout"] = timeout
        opts.update(dict(self.rdzv_options))
        return opts

    def describe(self) -> str:
        """The one line the launcher prints before it starts."""
        if self.omp_num_threads is None:
            threads = "OMP_NUM_THREADS as inherited"
        else:
            threads = f"OMP_NUM_THREADS={self.omp_num_threads} each"
        if self.max_nodes == 1:
            nodes = ""
        elif self.min_nodes == self.max_nodes:
            nodes = f"{self.max_nodes} nodes (waiting up to {self.rdzv_timeout_s:g} s for them), "
        else:
            nodes = (f"{self.min_nodes} to {self.max_nodes} nodes (waiting up to "
                     f"{self.rdzv_timeout_s:g} s for {self.min_nodes}), ")
        if nodes and self.local_addr:
            nodes += f"this node at {self.local_addr}, "
        restarts = f", up to {self.max_restarts} restart(s)" if self.max_restarts else ""
        hang = (f", hang watchdog {self.hang_timeout_s:g} s" if self.hang_timeout_s is not None
                else "")
        debug = ", collectives checked (debug)" if self.debug_collectives else ""
        return (f"{self.nproc_per_node} worker(s) on this node ({self.nproc_reason}), {threads}; "
                f"{nodes}{self.rdzv_reason or self.rdzv_backend}{restarts}{hang}{debug}")


def _check(ok: bool, flag: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"{flag} {value} is invalid: it must be {expected}")
