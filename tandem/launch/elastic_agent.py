"""``tandem run --elastic``: torch's local agent, told not to stop the group when
one worker dies: :class:`ElasticAgent`.

# Note [elastic launch]
torch's agent treats any worker's failure as the group's: it stops every worker
and, under ``--max-restarts``, starts them all again, and they reload the last
checkpoint. An elastic job (Note [elastic trainer] in tandem.elastic.run)
needs the survivors left running, so this agent changes three things in its
health check (``_monitor_workers``, the extension point tandem's hang watchdog
uses too), and nothing else:

- it reads the workers' exit codes itself, before torch's process context
  would see a failure and close the others;
- it tells the workers at once (an exit notice in their store: Note [deaths
  seen at once] in tandem/comm/process_id.py);
- a worker that died is replaced, up to ``--max-restarts`` times (not one that
  stopped because it was cut off from the job's store: a replacement could not
  reach it either; Note [cut off] in tandem/comm/cut_off.py): a new process
  with the same command and environment plus ``TANDEM_ELASTIC_JOIN=1`` (its
  ``tandem.init()`` then asks to join, and the members admit it at their next
  step boundary; one that finds every member gone, the job finished, exits
  with ``NOTHING_TO_JOIN_EXITCODE`` and is not replaced in turn). It is started
  through torch's own subprocess handler and put
  in the dead worker's place, so torch's process context watches it, forwards
  signals to it and stops it as it does the others. Its output goes to
  ``stdout.join<k>.log`` / ``stderr.join<k>.log`` beside the dead worker's logs.

It beats for its node's workers in their store and names a worker that ended
in the beat at once (:class:`~tandem.launch.node_reports.NodeReports`), so that
the workers do not beat themselves and the store hears one beat per node.

In a job of several nodes it also keeps this node on the job's roll (Note
[nodes of an elastic job] in node_roll.py): it publishes the workers' store
when this node hosts it, and its exit barrier waits only for nodes that are
still there.

The group has succeeded when every worker has exited and at least one exited
with 0 (the job finished on the survivors); it has failed when none did, or
when a worker crashed after it had finished (Note [a crash after finishing]).

# Note [a hung rank under --elastic]
With ``--hang-timeout``, the watchdog (Note [progress without a collective] in
watchdog.py) also watches an elastic job. A rank that is stuck but alive (a
deadlock in its data loader, a wait on a dead file system) keeps beating, so
nobody counts it dead, and the others wait for it in their next collective
for good. When no worker of this node has progressed for the timeout, the
agent writes the hang report as without ``--elastic``, and then stops the
workers that hold the others up: those in no collective while another waits
in one (:func:`~tandem.launch.hang.stuck_ranks`). Each is SIGKILLed, which
makes it a loss like any other: the members see it at once, shrink and go on,
and a replacement is started. The watchdog then counts from zero again. A hang
with no one to blame (every rank waits, in collectives that do not match) is
no loss: the job fails with the report, as it does without ``--elastic``.

# Note [a crash after finishing]
A worker that dies while the others train is a loss: they go on without it. One
that dies after it finished training (its process aborted in the interpreter's
teardown, exit -6) is not: nobody went on without it, and counting it as a loss
would let the job end "finished" with exit 0. The agent
tells them apart by the worker's last word: under ``--elastic`` every worker
writes its progress file (:class:`tandem.launch.logs.WorkerLogs`), and a
monitor that stops because its rank left on purpose (``tandem.shutdown()``, or
the process's exit) marks it ``finished_at`` (Note [finishing] in
watchdog.py). A worker killed by a signal (SIGABRT, SIGSEGV: a negative exit
code) with that mark crashed after finishing: it is not replaced, and the job
fails once the others are done. An uncaught exception also marks the progress
finished (its exit hook leaves on purpose, Note [exit on an uncaught
exception] in tandem/comm/exit.py) but exits with 1: a loss, as before.
The workers' store is the agent's (Note [one store per attempt] in
rendezvous.py): it outlives every worker, rank 0 included.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler

from tandem.comm.cut_off import CUT_OFF_EXITCODE
from tandem.control.elastic_group import JOIN_ENV, NOTHING_TO_JOIN_EXITCODE
from tandem.comm.process_id import NODE_ENV, exit_words
from tandem.launch.node_reports import NodeReports
from tandem.launch.hang import stuck_ranks
from tandem.launch.logs import WorkerLogs
from tandem.launch.node_roll import NodeRoll
from tandem.launch.spare import Spares
from tandem.launch.watchdog import HANG_EXITCODE, Watchdog

__all__ = ["ElasticAgent"]

logger = logging.getLogger(__name__)


class ElasticAgent(LocalElasticAgent):
    """torch's local agent, which lets the survivors of a dead worker go on and
    starts replacements (see Note [elastic launch]).

    Args:
        spec, logs: torch's worker spec, and where the workers' output goes
            (a replacement's too: :meth:`WorkerLogs.replaced`).
        replacements: how many replacement workers this node may start.
        on_event: called with a line for the launcher's output at each death
            and replacement.
        roll: the job's roll of nodes, in a job of several nodes.
        hosts_endpoint: this node hosts the rendezvous store.
        watchdog: with ``--hang-timeout``: a hung worker is stopped, a loss like
            any other (Note [a hung rank under --elastic]).
        on_hang: called with the hang report when the watchdog fires.
    """

    def __init__(self, spec: Any, logs: WorkerLogs, *args: Any, replacements: int, on_event: Any = None,
                 roll: NodeRoll | None = None, hosts_endpoint: bool = False, watchdog: Watchdog | None = None,
                 on_hang: Callable[[str], None] | None = None, spares: Spares | None = None,
                 **kwargs: Any) -> None:
        super().__init__(spec, logs, *args, **kwargs)
        self._logs = logs
        self._roll = roll
        self._hosts_endpoint = hosts_endpoint
        self._on_roll = False
        self._replacements_left = replacements
        self._started = 0
        self._dead: dict[int, int] = {}   # local rank -> exit code of a death already handled
        self._crashed: dict[int, int] = {}  # local rank -> exit code: Note [a crash after finishing]
        self._on_event = on_event or (lambda line: None)
        # This node's launcher beats for its workers and reports their exits (Note [deaths seen at
        # once] in tandem/comm/process_id.py); its workers, which inherit this environment, read
        # whose beat is theirs here.
        self._reports = NodeReports.of_this_node(logs.job_secret())
        os.environ[NODE_ENV] = self._reports.node
        self._watchdog = watchdog
        self._on_hang = on_hang or (lambda report: None)
        self._hung = False  # a hang with no worker to blame: the job fails
        self._spares = spares

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        context = self._pcontext
        handlers = getattr(context, "subprocess_handlers", None)
        if handlers is None:  # function workers (tandem.spawn): torch's behaviour
            return super()._monitor_workers(worker_group)
        codes = {local: h.proc.poll() for local, h in handlers.items()}
        for local, code in codes.items():
            if code not in (None, 0) and self._dead.get(local) != handlers[local].proc.pid:
                self._dead[local] = handlers[local].proc.pid
                worker = worker_group.workers[local]
                pid = handlers[local].proc.pid
                self._reports.post(getattr(worker_group.spec.rdzv_handler, "workers_store", None), pid,
                                   f"its process (pid {pid}) {exit_words(code)}, seen by its launcher")
                if code == NOTHING_TO_JOIN_EXITCODE:
                    self._on_event(f"elastic: replacement pid {handlers[local].proc.pid} for local rank "
                                   f"{local} found the job finished; nothing to replace")
                    continue
                if code == CUT_OFF_EXITCODE:
                    self._on_event(f"elastic: worker {worker.global_rank} (local {local}, pid "
                                   f"{handlers[local].proc.pid}) was cut off from the job's store and "
                                   "stopped; not replaced (a replacement could not reach the store either)")
                    continue
                if code < 0 and self._finished(local):  # Note [a crash after finishing]
                    self._crashed[local] = code
                    self._on_event(f"elastic: worker {worker.global_rank} (local {local}, pid "
                                   f"{handlers[local].proc.pid}) crashed with {code} after it finished "
                                   "training; the job fails")
                    continue
                self._on_event(f"elastic: worker {worker.global_rank} (local {local}, "
                               f"pid {handlers[local].proc.pid}) exited with {code}; the others go on")
                if self._replacements_left > 0:
                    self._replace(local, worker_group)
                    codes[local] = None
        if any(code is None for code in codes.values()):
            if self._watchdog is not None and self._stop_hung(worker_group):
                return RunResult(state=WorkerState.FAILED, failures=self._failures(
                    worker_group, {local: HANG_EXITCODE for local, code in codes.items() if code is None}))
            return RunResult(state=WorkerState.HEALTHY)
        if self._crashed:
            return RunResult(state=WorkerState.FAILED, failures=self._failures(worker_group, self._crashed))
        if any(code == 0 for code in codes.values()):
            # Only the workers that finished are returned: the launcher's last line counts
            # them, and a worker lost on the way (not replaced) is not one of them; torch's
            # agent wants every worker in one of the two.
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values={worker_group.workers[local].global_rank: None
                                            for local, code in codes.items() if code == 0},
                             failures=self._failures(worker_group, {i: c for i, c in codes.items() if c != 0}))
        return RunResult(state=WorkerState.FAILED, failures=self._failures(worker_group, codes))

    def _failures(self, worker_group: WorkerGroup, codes: Mapping[int, int | None]) -> dict[int, ProcessFailure]:
        """torch's failure records of the workers at local ranks ``codes`` (their exit codes), by global rank."""
        context: Any = self._pcontext
        return {worker_group.workers[local].global_rank: ProcessFailure(
            local_rank=local, pid=context.subprocess_handlers[local].proc.pid, exitcode=int(code or 1),
            error_file=context.error_files[local]) for local, code in codes.items()}

    def _stop_hung(self, worker_group: WorkerGroup) -> bool:
        """Ask the watchdog; SIGKILL the workers that hold the others up (Note [a
        hung rank under --elastic]). Returns whether the job has hung with no
        worker to blame, and fails."""
        attempts = self._logs.attempts
        assert self._watchdog is not None
        stalled = self._watchdog.stalled_for(attempts[-1]) if attempts else None
        if stalled is None:
            return False
        attempt = attempts[-1]
        handlers: Any = self._pcontext.subprocess_handlers  # type: ignore[union-attr]
        pids = {w.global_rank: handlers[w.local_rank].proc.pid for w in worker_group.workers}
        address = getattr(worker_group.spec.rdzv_handler, "workers_store", None)
        report = self._watchdog.report(attempt, pids, stalled, store_address=address)
        # A replacement's own snapshot, not its predecessor's (they share the file).
        snapshots = {rank: snap for rank, snap in self._watchdog.snapshots(attempt).items()
                     if snap is not None and snap.get("pid") == pids.get(rank)}
        stuck = [rank for rank in stuck_ranks(snapshots) if rank in pids]
        self._on_hang(report)
        if not stuck:
            self._on_event("elastic: the job hung and no worker of this node holds the others up; the job fails")
            return True
        for rank in stuck:
            self._on_event(f"elastic: worker {rank} (pid {pids[rank]}) hung: it is in no collective while "
                           f"the others have waited {stalled:.0f} s; stopped, a loss like any other")
            try:
                os.kill(pids[rank], signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._watchdog.rearm()
        return False

    def _finished(self, local: int) -> bool:
        """Whether local rank ``local``'s worker marked its progress finished
        (Note [a crash after finishing])."""
        attempts = self._logs.attempts
        logs = next((r for r in attempts[-1].ranks.values() if r.local_rank == local), None) if attempts else None
        if logs is None:
            return False
        try:
            return "finished_at" in json.loads(logs.progress.read_text())
        except (OSError, ValueError):
            return False

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        self._reports.beat_in(getattr(worker_group.spec.rdzv_handler, "workers_store", None))
        if self._roll is None:
            return
        if not self._on_roll:
            self._roll.start()
            self._on_roll = True
        hosted = getattr(worker_group.spec.rdzv_handler, "hosted", None)
        if hosted is not None:
            self._roll.publish(hosted)

    def _exit_barrier(self) -> None:
        if self._roll is None:
            super()._exit_barrier()
            return
        self._roll.exit_barrier(self._worker_group.spec.rdzv_handler, self._exit_barrier_timeout,
                                hosts_endpoint=self._hosts_endpoint)

    def _replace(self, local: int, worker_group: WorkerGroup) -> None:
        """Start a replacement in the place of local rank ``local`` (Note [elastic launch])."""
        context: Any = self._pcontext
        self._replacements_left -= 1
        self._started += 1
        env = dict(context.envs[local])
        env[JOIN_ENV] = "1"
        stdout, stderr = (_beside(path, f"join{self._started}") for path in
                          (context.stdouts[local], context.stderrs[local]))
        handler: Any = None
        if self._spares is not None:  # Note [spare workers] in spare.py
            handler = self._spares.take(context.args[local], {**os.environ, **env}, stdout, stderr, local)
        how = "the spare" if handler is not None else "a new process"
        if handler is None:
            handler = get_subprocess_handler(entrypoint=context.entrypoint, args=context.args[local],
                                             env=env, stdout=stdout, stderr=stderr, local_rank_id=local)
        context.subprocess_handlers[local] = handler
        worker_group.workers[local].id = handler.proc.pid
        if stdout and stderr:  # its output on the console too, under the rank it replaces
            self._logs.replaced(local, Path(stdout), Path(stderr))
        where = f"on the console, and in {stdout}" if stdout else "on the console"
        self._on_event(f"elastic: started replacement {self._started} (pid "
                       f"{handler.proc.pid}, {how}) for local rank {local}; it joins at the next step "
                       f"boundary or the regroup under way ({self._replacements_left} replacement(s) "
                       f"left); its output: {where}")


def _beside(path: str | None, tag: str) -> str:
    if not path:
        return ""
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{tag}{p.suffix}"))
