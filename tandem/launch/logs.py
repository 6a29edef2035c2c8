"""Where each worker's output goes: :class:`WorkerLogs`, one directory per attempt
and global rank::

    <root>/attempt_0/rank_0/stdout.log
                           /stderr.log
                           /error.json    (written by workers that use elastic's @record)
                           /progress.json (with a watchdog: the rank's ledger, see
                           /stacks.txt     tandem.comm.monitor, and its Python stacks)
    <root>/attempt_1/...                  (after a restart)

The console view (rank prefixes, rank filters) is :mod:`tandem.launch.output`,
which follows these files; the failure summary (:mod:`tandem.launch.summary`)
reads them.

# Note [worker environment]
torch's elastic agent builds each worker's environment (RANK, WORLD_SIZE, ...)
and hands it to ``LogsSpecs.reify`` before it starts the processes; torch's own
``DefaultLogsSpecs`` adds ``TORCHELASTIC_ERROR_FILE`` there. :class:`WorkerLogs`
adds the launcher's own variables (OMP_NUM_THREADS, PYTHONUNBUFFERED) at the same
point, so they reach the workers alone. torchrun instead writes OMP_NUM_THREADS
into its own ``os.environ``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

from tandem.store.job_secret import job_secret

__all__ = ["Attempt", "RankLogs", "WorkerLogs"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankLogs:
    """One worker's files in one attempt."""

    rank: int
    """Global rank."""
    local_rank: int
    """Rank on this node."""
    stdout: Path
    """Everything the worker wrote to stdout."""
    stderr: Path
    """Everything the worker wrote to stderr (tracebacks land here)."""
    error_file: Path
    """Where elastic's ``@record`` writes the worker's exception, if it uses it."""
    progress: Path
    """Where the worker's monitor writes its progress, when the launcher watches it."""
    stacks: Path
    """Where the worker dumps its Python stacks on SIGUSR1, when the launcher watches it."""


@dataclass(frozen=True)
class Attempt:
    """One start of this node's workers (the first, or one after a restart)."""

    number: int
    """``TORCHELASTIC_RESTART_COUNT`` of this attempt: 0 for the first."""
    world_size: int
    """Workers in the whole job."""
    ranks: Mapping[int, RankLogs]
    """This node's workers by global rank."""


class WorkerLogs(LogsSpecs):
    """Tells torch's elastic agent to send each worker's stdout and stderr to files
    under ``root`` (see the module docstring), and adds ``worker_env`` to each
    worker's environment (see Note [worker environment]).

    Args:
        root: the job's log directory; created if missing.
        worker_env: variables for every worker, on top of the agent's.
        on_attempt: called with each :class:`Attempt` as its workers are about
            to start (from the agent's thread).
        progress: ask each worker to write its progress and, on SIGUSR1, its
            stacks to its directory (for the hang watchdog).
        on_replacement: called with a replacement worker's :class:`RankLogs`
            and the world size when ``tandem run --elastic`` starts one
            (:meth:`replaced`).
    """

    def __init__(self, root: str | os.PathLike, *, worker_env: Mapping[str, str] | None = None,
                 on_attempt: Callable[[Attempt], None] | None = None,
                 progress: bool = False,
                 on_replacement: Callable[[RankLogs, int], None] | None = None) -> None:
        super().__init__(log_dir=str(root))
        self._root = Path(root)
        self._root.mkdir(parents=True, exist_ok=True)
        self._worker_env = dict(worker_env or {})
        self._on_attempt = on_attempt
        self._progress = progress
        self._on_replacement = on_replacement
        self._lock = threading.Lock()
        self._attempts: list[Attempt] = []

    def replaced(self, local_rank: int, stdout: Path, stderr: Path) -> None:
        """A replacement for local rank ``local_rank`` of the last attempt writes to
        ``stdout`` and ``stderr`` (beside the worker it replaces)."""
        with self._lock:
            attempt = self._attempts[-1]
        old = next(logs for logs in attempt.ranks.values() if logs.local_rank == local_rank)
        if self._on_replacement is not None:
            self._on_replacement(dataclasses.replace(old, stdout=stdout, stderr=stderr), attempt.world_size)

    def worker_env(self) -> dict[str, str]:
        """What every worker's environment adds to the launcher's."""
        return dict(self._worker_env)

    def add_worker_env(self, env: Mapping[str, str]) -> None:
        """Give every worker started from now on ``env`` too."""
        self._worker_env.update(env)

    def job_secret(self) -> bytes | None:
        """The job secret the workers get: the one added here, or the launcher's
        own (Note [signed store] in tandem/store/job_secret.py)."""
        return job_secret({**os.environ, **self._worker_env})

    @property
    def root_log_dir(self) -> str:
        return str(self._root)

    @property
    def attempts(self) -> list[Attempt]:
        """The attempts started so far, first to last."""
        with self._lock:
            return list(self._attempts)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        # Called by the agent once per attempt, with every local worker's environment.
        if not envs:
            raise ValueError("the elastic agent passed no worker environments to reify")
        first = envs[min(envs)]
        number = int(first.get("TORCHELASTIC_RESTART_COUNT", "0"))
        attempt_dir = self._root / f"attempt_{number}"
        ranks: dict[int, RankLogs] = {}
        for local_rank, env in sorted(envs.items()):
            rank = int(env.get("RANK", local_rank))
            rank_dir = attempt_dir / f"rank_{rank}"
            rank_dir.mkdir(parents=True, exist_ok=True)
            logs = RankLogs(rank=rank, local_rank=local_rank, stdout=rank_dir / "stdout.log",
                            stderr=rank_dir / "stderr.log", error_file=rank_dir / "error.json",
                            progress=rank_dir / "progress.json", stacks=rank_dir / "stacks.txt")
            for stale in (logs.stdout, logs.stderr, logs.error_file, logs.progress, logs.stacks):
                stale.unlink(missing_ok=True)
            ranks[rank] = logs
            # Note [worker environment]: the agent's variables win over the launcher's.
            for key, value in self._worker_env.items():
                env.setdefault(key, value)
            env["TORCHELASTIC_ERROR_FILE"] = str(logs.error_file)
            if self._progress:
                env["TANDEM_PROGRESS_FILE"] = str(logs.progress)
                env["TANDEM_STACKS_FILE"] = str(logs.stacks)
        attempt = Attempt(number=number, world_size=int(first.get("WORLD_SIZE", len(envs))),
                          ranks=ranks)
        with self._lock:
            self._attempts.append(attempt)
        logger.debug("attempt %d: logs in %s", number, attempt_dir)
        if self._on_attempt is not None:
            self._on_attempt(attempt)
        by_local = {r.local_rank: r for r in ranks.values()}
        return LogsDest(
            stdouts={lr: str(r.stdout) for lr, r in by_local.items()},
            stderrs={lr: str(r.stderr) for lr, r in by_local.items()},
            tee_stdouts={}, tee_stderrs={},
            error_files={lr: str(r.error_file) for lr, r in by_local.items()},
        )
