"""What a ``tandem run`` job is, as plain data: :class:`LaunchConfig`.

Everything here is pure; the rules that turn what the user typed into its
values are in :mod:`tandem.launch.flags`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.launch.flags import STANDALONE_ENDPOINT, split_endpoint

__all__ = ["DEFAULT_RDZV_TIMEOUT_S", "LaunchConfig"]

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
