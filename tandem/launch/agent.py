"""Run one node's workers under torch's elastic agent: :func:`run_workers`.

torch does the work: ``LocalElasticAgent`` starts, watches, stops and restarts
the worker processes; the rendezvous handler (c10d or static) makes the nodes
meet. tandem builds them from a :class:`~tandem.launch.config.LaunchConfig`, as
``torch.distributed.launcher.api.launch_agent`` does, with three changes:

- each attempt's workers meet in a store of their own (Note [one store per
  attempt] in :mod:`tandem.launch.rendezvous`), so restarts work;
- the workers' output goes to :class:`~tandem.launch.logs.WorkerLogs`, which also
  carries the launcher's variables to the workers alone;
- rendezvous failures (a timeout, a port in use) become a :class:`LaunchError`
  whose message says what to change;
- with a hang timeout, a :class:`~tandem.launch.watchdog.Watchdog` looks at the
  workers' progress each time the agent checks on them, and a hang counts as a
  failure of the group (so ``max_restarts`` restarts it);
- at the end, a node waits only for the nodes still there, not for one lost
  after its workers finished (:class:`~tandem.launch.node_roll.NodeRoll`).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousTimeoutError,
)

from tandem._compat import matches_machine_hostname
from tandem.comm.cut_off import CUT_OFF_EXITCODE, cut_off_after
from tandem.comm.peers import STALE_AFTER_S
from tandem.control.elastic_group import JOIN_ENV
from tandem.store.job_secret import MANY_NODES_NEED_A_SECRET
from tandem.store.store_address import EtcdAddress, describe
from tandem.launch.config import LaunchConfig
from tandem.launch.elastic_agent import ElasticAgent
from tandem.launch.config import split_endpoint
from tandem.launch.logs import WorkerLogs
from tandem.launch.machine import interface_of
from tandem.launch.etcd_plane import EtcdControlPlane
from tandem.launch.node_roll import JoinRunningJob, NodeRoll
from tandem.launch.rendezvous import FreshWorkerStore
from tandem.launch.secret_check import SecretCheck
from tandem.launch.signed_rendezvous import rendezvous_handler
from tandem.launch.spare import Spares, python_target
from tandem.launch.tunnel import TunnelError, Tunnels
from tandem.launch.watchdog import HANG_EXITCODE, Watchdog

__all__ = ["HANG_EXITCODE", "LaunchError", "SignalException", "quiet_torch_launch_logs",
           "run_workers"]

logger = logging.getLogger(__name__)

# The signals elastic's process context turns into SignalException while workers run.
_HANDLED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
                         if hasattr(signal, name))


_TORCH_LAUNCH_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")
# How long the other workers of a node whose first failure was a cut-off get to find it
# too and say so before torch stops them: a worker's next beat finds a closed store at
# once, and its own watch stops it by this silence at the latest, however loaded the host.
_CUT_OFF_TOGETHER_S = cut_off_after(STALE_AFTER_S)


class LaunchError(RuntimeError):
    """The job could not start: the nodes did not meet in time, a port was taken,
    the rendezvous store could not be reached."""




class _NodeAgent(LocalElasticAgent):
    """torch's local agent for a job that is not elastic, with two changes:

    - with a ``watchdog``, its health check also asks it: a hang is reported as
      the group FAILED, and the agent then restarts or stops the workers as for
      any failure (``_monitor_workers`` is the agent's own extension point;
      LocalElasticAgent overrides SimpleElasticAgent's);
    - a worker cut off from the job's store (exit 75, Note [cut off] in
      tandem/comm/cut_off.py) is not the only one: the others' next beat finds
      the store gone too, so they get until the silence that would stop them
      anyway (each one at once, as a rule) to stop with their own line
      before torch stops them;
    - in a job of several nodes (a ``roll``), its exit barrier waits only for
      the nodes still there (Note [nodes of an elastic job] in node_roll.py),
      where torch's would wait the whole ``exit_barrier_timeout`` (300 s) for a
      node lost after its workers finished training, and only if this node
      hosts a store the others use.
    """

    def __init__(self, spec: WorkerSpec, logs: WorkerLogs, *, watchdog: Watchdog | None = None,
                 on_hang: Callable[[str], None] | None = None, roll: NodeRoll | None = None,
                 hosts_endpoint: bool = False, **kwargs: Any) -> None:
        super().__init__(spec, logs, **kwargs)
        self._tandem_logs = logs
        self._watchdog = watchdog
        self._on_hang = on_hang or (lambda _: None)
        self._roll = roll
        self._hosts_endpoint = hosts_endpoint
        self._on_roll = False

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        if self._roll is not None and not self._on_roll:
            self._roll.start()
            self._on_roll = True

    def _exit_barrier(self) -> None:
        if self._roll is None or not self._on_roll:
            super()._exit_barrier()
            return
        self._roll.exit_barrier(self._worker_group.spec.rdzv_handler, self._exit_barrier_timeout,
                                hosts_endpoint=self._hosts_endpoint)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED and _all_cut_off(result):
            result = self._cut_off_together(worker_group, result)
        attempts = self._tandem_logs.attempts
        if self._watchdog is None or result.state != WorkerState.HEALTHY or not attempts:
            return result
        attempt = attempts[-1]
        stalled = self._watchdog.stalled_for(attempt)
        if stalled is None:
            return result
        pids = {w.global_rank: w.id for w in worker_group.workers if w.id is not None}
        address = getattr(worker_group.spec.rdzv_handler, "workers_store", None)
        self._on_hang(self._watchdog.report(attempt, pids, stalled, store_address=address))
        self._watchdog.let_other_nodes_report(attempt)
        failures = {w.global_rank: ProcessFailure(
            local_rank=w.local_rank, pid=w.id, exitcode=HANG_EXITCODE,
            error_file=str(attempt.ranks[w.global_rank].error_file))
            for w in worker_group.workers if w.global_rank in attempt.ranks}
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def _cut_off_together(self, worker_group: WorkerGroup, result: RunResult) -> RunResult:
        """The workers' failures once every one has stopped, or :data:`_CUT_OFF_TOGETHER_S`
        after the first was cut off, whichever comes first."""
        deadline = time.monotonic() + _CUT_OFF_TOGETHER_S
        while len(result.failures) < len(worker_group.workers) and time.monotonic() < deadline:
            time.sleep(0.05)
            again = super()._monitor_workers(worker_group)
            if again.state != WorkerState.FAILED or not _all_cut_off(again):
                return again if again.state == WorkerState.FAILED else result
            result = again
        return result


def _all_cut_off(result: RunResult) -> bool:
    return bool(result.failures) and all(f.exitcode == CUT_OFF_EXITCODE for f in result.failures.values())


def run_workers(config: LaunchConfig, entrypoint: str | Callable[..., Any], args: Sequence[Any],
                logs: WorkerLogs, *, on_hang: Callable[[str], None] | None = None,
                on_event: Callable[[str], None] | None = None) -> RunResult:
    """Run this node's workers until they all finish, one fails for good, or a
    signal stops the launcher.

    Args:
        config: the job.
        entrypoint: a program (each worker runs ``entrypoint *args``) or a
            picklable function (each worker calls ``entrypoint(*args)``).
        args: the workers' arguments.
        logs: where their output goes (its ``worker_env`` reaches every worker);
            with ``config.hang_timeout_s`` it must have been built with
            ``progress=True``.
        on_hang: called with the hang report when the watchdog fires.
        on_event: called with a line at each death and replacement of an
            elastic job (``config.elastic``).

    Returns:
        The agent's result: ``failures`` by global rank, empty when the workers
        succeeded, and ``return_values`` by global rank for a function.

    Raises:
        LaunchError: the rendezvous failed; the message says what to change.
        SignalException: the launcher got SIGTERM, SIGINT, SIGHUP or SIGQUIT
            while the workers ran; they were sent the same signal and have exited.
    """
    options = config.rendezvous_options()
    if config.rdzv_backend == "c10d" and "is_host" not in options and _holds_endpoint(config):
        # Note [the address a node gives] in machine.py: torch decides by the hostname,
        # which in a container may not resolve to the endpoint's address.
        options["is_host"] = True
    params = RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.rdzv_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
        **options)
    logger.info("tandem.launch: %s", config.describe())
    timeout = datetime.timedelta(seconds=config.rdzv_timeout_s)
    plane = _control_plane(config, logs.job_secret(), options)
    tunnels = _tunnels(config, logs.job_secret(), on_event) if plane is None else None
    finished = False
    try:
        result = _launch(config, entrypoint, args, logs, params, options, timeout, tunnels, on_hang, on_event,
                         plane)
        finished = True
        return result
    finally:
        if tunnels is not None:
            tunnels.close()
        if plane is not None:
            plane.close(linger=finished)


def _control_plane(config: LaunchConfig, secret: bytes | None,
                   options: dict[str, Any]) -> EtcdControlPlane | None:
    """The job's stores on etcd, with this node's member started, for
    ``--rdzv-backend etcd`` (Note [a replicated control plane] in etcd_plane.py)."""
    if config.rdzv_backend != "etcd":
        return None
    if secret is None:
        raise LaunchError("--rdzv-backend etcd needs the job secret, from which every node makes its TLS "
                          f"certificates: {MANY_NODES_NEED_A_SECRET}")
    member = options.pop("etcd_member", None)
    try:
        plane = EtcdControlPlane(config.rdzv_endpoint, config.rdzv_id, secret, local_addr=config.local_addr,
                                 member=None if member is None else str(member))
    except (ValueError, RuntimeError) as e:
        raise LaunchError(str(e)) from None
    try:
        plane.start()
    except RuntimeError as e:
        plane.close()
        raise LaunchError(str(e)) from None
    return plane


def _tunnels(config: LaunchConfig, secret: bytes | None,
             on_event: Callable[[str], None] | None) -> Tunnels | None:
    """The node's TLS tunnels for a job of several nodes with a secret, unless
    ``--open-stores`` (Note [stores behind TLS] in tunnel.py)."""
    if config.max_nodes <= 1 or secret is None or config.open_stores:
        return None
    try:
        return Tunnels(secret, on_refused=on_event or (lambda line: logger.warning("%s", line)))
    except TunnelError as e:
        raise LaunchError(str(e)) from None


def _launch(config: LaunchConfig, entrypoint: Any, args: Sequence[Any], logs: WorkerLogs,
            params: RendezvousParameters, options: dict[str, Any], timeout: datetime.timedelta,
            tunnels: Tunnels | None, on_hang: Callable[[str], None] | None,
            on_event: Callable[[str], None] | None, plane: EtcdControlPlane | None) -> RunResult:
    roll = (NodeRoll(config.rdzv_endpoint, config.rdzv_id, _node_id(config), secret=logs.job_secret(),
                     tunnels=tunnels, plane=plane)
            if config.elastic and config.max_nodes > 1 and config.rdzv_backend in ("c10d", "etcd") else None)
    hosts_endpoint = (plane.member is not None if plane is not None
                      else str(options.get("is_host", "")).lower() in ("1", "true", "yes", "y"))
    with _rendezvous_errors(config):
        running = roll.running_job() if roll is not None and not hosts_endpoint else None
    handler: RendezvousHandler
    secret_check: SecretCheck | None = None
    if running is not None:  # Note [nodes of an elastic job] in node_roll.py
        if on_event is not None:
            on_event(f"elastic: a job {config.rdzv_id!r} is running (its workers' store at "
                     f"{describe(running)}); this node's workers join it")
        if tunnels is not None and not isinstance(running, EtcdAddress):
            with _rendezvous_errors(config):
                running = tunnels.reach(*running, "the workers' store", timeout_s=timeout.total_seconds())
        handler = JoinRunningJob(running, config.rdzv_id)
        logs.add_worker_env({JOIN_ENV: "1", **(running.env() if isinstance(running, EtcdAddress) else {})})
    else:
        many_nodes = config.max_nodes > 1
        secret = logs.job_secret()
        # Note [another secret at the rendezvous] in secret_check.py; on etcd, TLS refuses another secret
        if many_nodes and tunnels is None and plane is None:
            secret_check = SecretCheck(config.rdzv_endpoint, config.rdzv_id, _node_id(config), secret,
                                       nodes=config.max_nodes,
                                       on_other=on_event or (lambda line: logger.warning("%s", line)))
        with _rendezvous_errors(config, secret_check, tunnels):
            handler = FreshWorkerStore(rendezvous_handler(params, secret=secret, many_nodes=many_nodes,
                                                          tunnels=tunnels, plane=plane),
                                       timeout=timeout, poll_waiting=many_nodes, many_nodes=many_nodes,
                                       secret=secret, tunnels=tunnels, plane=plane,
                                       give_workers=logs.add_worker_env)
    spec = WorkerSpec(
        role=config.role, local_world_size=config.nproc_per_node, rdzv_handler=handler,
        entrypoint=entrypoint, args=tuple(args),
        # An elastic job is never restarted as a group: its restarts are replacements.
        max_restarts=0 if config.elastic else config.max_restarts,
        monitor_interval=config.monitor_interval_s, master_addr=None, master_port=None,
        local_addr=config.local_addr)
    spares = None
    if (config.elastic and config.spare and config.max_restarts > 0 and isinstance(entrypoint, str)
            and python_target(args) is not None):  # Note [spare workers] in spare.py
        spares = Spares(entrypoint, logs.worker_env(), count=config.max_restarts)
    if config.elastic:
        agent: LocalElasticAgent = ElasticAgent(
            spec, logs, replacements=config.max_restarts, on_event=on_event, roll=roll, spares=spares,
            hosts_endpoint=hosts_endpoint, on_hang=on_hang,
            watchdog=(Watchdog(config.hang_timeout_s, secret=logs.job_secret())
                      if config.hang_timeout_s is not None else None),
            start_method=config.start_method, exit_barrier_timeout=config.exit_barrier_timeout_s)
    else:
        agent = _NodeAgent(
            spec, logs, on_hang=on_hang, start_method=config.start_method,
            exit_barrier_timeout=config.exit_barrier_timeout_s,
            watchdog=(Watchdog(config.hang_timeout_s, secret=logs.job_secret())
                      if config.hang_timeout_s is not None else None),
            roll=(NodeRoll(config.rdzv_endpoint, config.rdzv_id, _node_id(config), secret=logs.job_secret(),
                           tunnels=tunnels, plane=plane)
                  if config.max_nodes > 1 and isinstance(handler, FreshWorkerStore) else None),
            hosts_endpoint=(plane.member is not None if plane is not None else _may_host_endpoint(config, options)))
    close_rendezvous = True
    if secret_check is not None:
        secret_check.start()
    try:
        with _restored_signal_handlers(), _rendezvous_errors(config, secret_check, tunnels):
            result = agent.run()
        # Workers cut off from the job's store (Note [cut off] in tandem/comm/cut_off.py):
        # the rendezvous store is likely out of reach too, and the job goes on elsewhere.
        codes = {int(getattr(f, "exitcode", 0)) for f in (result.failures.values() if result else ())}
        if codes == {CUT_OFF_EXITCODE}:
            close_rendezvous = False
    except SignalException:
        # Like torchrun: a node stopped by a signal leaves the rendezvous open, so
        # that the other nodes see a departure rather than the end of the job.
        close_rendezvous = False
        raise
    finally:
        if spares is not None:
            spares.close()
        if secret_check is not None:
            secret_check.stop()
        if roll is not None:
            roll.leave()
        if close_rendezvous:
            handler.shutdown()
        elif isinstance(handler, FreshWorkerStore):
            handler.stop_polling()   # Note [ending the launcher] in cli.py
    if result is None:
        raise LaunchError(f"this node was not admitted to the job (rendezvous "
                          f"{config.rdzv_endpoint}, id {config.rdzv_id!r}): {config.max_nodes} "
                          "node(s) had already joined; check --nnodes")
    return result


def _node_id(config: LaunchConfig) -> str:
    return f"{config.local_addr or socket.gethostname()}-{os.getpid()}"


def _may_host_endpoint(config: LaunchConfig, options: dict[str, Any]) -> bool:
    """This node may host the rendezvous store: node 0 of the static rendezvous;
    with c10d, the node told so, or any node whose name or address the endpoint
    matches by torch's rule (on one machine, every node: one of them hosts it,
    and each waits at the end as torch's barrier would)."""
    if config.rdzv_backend == "static":
        return config.node_rank == 0
    said = str(options.get("is_host", "")).lower()
    if said:
        return said in ("1", "true", "yes", "y")
    host, _ = split_endpoint(config.rdzv_endpoint, "--rdzv-endpoint")
    return matches_machine_hostname(host) or _holds_endpoint(config)


def _holds_endpoint(config: LaunchConfig) -> bool:
    """This node holds the c10d endpoint's address (so it hosts the store)."""
    host, _ = split_endpoint(config.rdzv_endpoint, "--rdzv-endpoint")
    if host == "localhost" or host.startswith("127."):
        return False  # torch's own rule already says yes
    return host == config.local_addr or interface_of(host) is not None


@contextlib.contextmanager
def _rendezvous_errors(config: LaunchConfig, secret_check: SecretCheck | None = None,
                       tunnels: Tunnels | None = None) -> Iterator[None]:
    """Turn the rendezvous' failures into a :class:`LaunchError` that says what to
    do; a node seen with another job secret is named first (Note [another
    secret at the rendezvous] in secret_check.py, Note [stores behind TLS] in
    tunnel.py)."""
    where = f"{config.rdzv_backend} rendezvous at {config.rdzv_endpoint}"
    nodes = (f"{config.max_nodes} node(s)" if config.min_nodes == config.max_nodes
             else f"{config.min_nodes} node(s)")

    def secret_first() -> str:
        other = secret_check.other if secret_check is not None else None
        if other is None and tunnels is not None:
            other = tunnels.other_secret
        return f"{other}. Then: " if other else ""

    def timed_out() -> LaunchError:
        return LaunchError(
            f"{secret_first()}the {where} did not complete within {config.rdzv_timeout_s:g} s: fewer than "
            f"{nodes} joined. Start every node with the same --nnodes, rendezvous flags and job secret, "
            "check that this node can reach the address, or raise --rdzv-timeout")

    try:
        yield
    except TunnelError as e:  # Note [stores behind TLS] in tunnel.py: the secret differs, or no answer
        raise LaunchError(str(e)) from e
    except RendezvousTimeoutError as e:
        raise timed_out() from e
    except RendezvousClosedError as e:
        raise LaunchError(f"{secret_first()}the {where} was closed by another node: the job has ended or "
                          "was stopped; start a new one with a new --rdzv-id") from e
    except RendezvousError as e:
        raise LaunchError(f"{secret_first()}the {where} failed: {_cause(e)}. Check the address and that "
                          "the node hosting it is running") from e
    except RuntimeError as e:
        text = str(e)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise LaunchError(
                f"port {config.rdzv_endpoint.rpartition(':')[2]} is already in use on this "
                "machine, so the rendezvous store cannot listen on it. Pass another "
                "--master-port, or leave it out on a single node to get a free one") from e
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise timed_out() from e
        if isinstance(e, dist.DistNetworkError):
            raise LaunchError(f"{secret_first()}the {where} lost its connection to the rendezvous store "
                              f"({_cause(e)}): the node hosting it has stopped or cannot be reached. "
                              "Check that node's output, and start the job again") from e
        raise


def _cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {e}".strip()


@contextlib.contextmanager
def quiet_torch_launch_logs() -> Iterator[None]:
    """Silence torch's elastic agent and process starter for the duration.

    They log every step of a failure at WARNING and ERROR (each worker's
    traceback, every SIGTERM sent); the launcher reports the failure itself, in
    a few lines. The loggers are restored on exit.
    """
    loggers = [logging.getLogger(name) for name in _TORCH_LAUNCH_LOGGERS]
    saved = [(lg, lg.propagate, list(lg.handlers)) for lg in loggers]
    for lg in loggers:
        lg.addHandler(logging.NullHandler())
        lg.propagate = False
    try:
        yield
    finally:
        for lg, propagate, handlers in saved:
            lg.handlers[:] = handlers
            lg.propagate = propagate


@contextlib.contextmanager
def _restored_signal_handlers() -> Iterator[None]:
    """Put the process's signal handlers back after the agent replaced them.

    elastic installs handlers that raise SignalException while workers run and
    leaves them installed; a notebook calling ``tandem.spawn`` should get its
    Ctrl-C back as KeyboardInterrupt afterwards.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in _HANDLED_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
