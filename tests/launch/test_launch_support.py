"""Helpers for the launcher tests (no tests here): run ``tandem run`` or any
command as a subprocess with a deadline that kills it and everything it started,
write tiny worker scripts, find leftover processes.

Workers started by torch's elastic agent live in sessions of their own, so
killing the launcher's process group does not reach them. Every process of a
test is therefore recognised by a marker in its environment
(``TANDEM_TEST_MARKER``, inherited by the launcher's workers and spawned
processes) and killed by pid if it outlives the test.
"""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

TANDEM = [sys.executable, "-m", "tandem", "run"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "LOGLEVEL")


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any launcher's variables, and
    without GPUs: the launcher tests are CPU jobs on gloo, also on a machine with
    one GPU (where two NCCL workers could not each bind a device)."""
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCH_VARS and not k.startswith(("TORCHELASTIC_", "PET_", "TANDEM_TEST", "TANDEM_JOB_SECRET"))}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_mentioning(marker: str) -> list[int]:
    """Pids of live processes (not zombies, not this one) whose environment has
    ``TANDEM_TEST_MARKER=marker``."""
    needle = f"TANDEM_TEST_MARKER={marker}\0".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes() + b"\0"
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle in environ:
            pids.append(int(entry))
    return pids


def kill_leftovers(marker: str) -> list[int]:
    """SIGKILL every live process mentioning ``marker``; return their pids."""
    pids = processes_mentioning(marker)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    orphans: list[int]
    """Processes of this run still alive after the launcher exited (killed since)."""

    def __str__(self) -> str:
        return (f"exit {self.returncode} after {self.seconds:.1f}s\n--- stdout\n{self.stdout[-3000:]}"
                f"\n--- stderr\n{self.stderr[-5000:]}")


class Job:
    """A command started in the background; :meth:`finish` waits with a deadline."""

    def __init__(self, argv: list[str], *, cwd: Path, marker: str | None = None,
                 env: dict[str, str] | None = None):
        self.marker = marker or uuid.uuid4().hex
        self.start = time.monotonic()
        env = dict(env or clean_env(), TANDEM_TEST_MARKER=self.marker)
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        self._ended: float | None = None  # when the process exited, whenever finish is called
        threading.Thread(target=self._note_exit, daemon=True).start()

    def _note_exit(self) -> None:
        self.proc.wait()
        self._ended = time.monotonic()

    def finish(self, timeout: float) -> Run:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill()
            out, err = self.proc.communicate()
            leftovers = kill_leftovers(self.marker)
            pytest.fail(f"{self.proc.args!r} did not finish within {timeout:.0f}s and was killed "
                        f"(and {len(leftovers)} leftover process(es))\n--- stdout\n{out[-3000:]}"
                        f"\n--- stderr\n{err[-5000:]}")
        seconds = (self._ended or time.monotonic()) - self.start
        orphans = _wait_gone(self.marker, 3.0)
        kill_leftovers(self.marker)
        return Run(self.proc.returncode, out, err, seconds, orphans)

    def _kill(self) -> None:
        # The launcher forwards SIGTERM to its workers; give it a moment, then force it.
        try:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(5)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def finish_all(jobs: dict[str, Job], timeout: float) -> dict[str, Run]:
    """Finish every job of ``jobs``, each within ``timeout``. A job that fails
    its test (pytest.fail: it overran and was killed) does not leave the others
    running: they are still finished, or killed, before the first failure is raised."""
    runs: dict[str, Run] = {}
    failure: BaseException | None = None
    for name, job in jobs.items():
        try:
            runs[name] = job.finish(timeout)
        except BaseException as e:  # noqa: BLE001 - raised below, once every job is done
            failure = failure or e
    if failure is not None:
        raise failure
    return runs


def run(argv: list[str], *, cwd: Path, timeout: float = 60.0, env: dict[str, str] | None = None,
        marker: str | None = None) -> Run:
    """Run ``argv`` in ``cwd`` to completion within ``timeout`` (else fail the test,
    killing everything it started)."""
    return Job(argv, cwd=cwd, marker=marker, env=env).finish(timeout)


def tandem(args: list[str], *, cwd: Path, timeout: float = 60.0, **kw) -> Run:
    return run(TANDEM + args, cwd=cwd, timeout=timeout, **kw)


def _wait_gone(marker: str, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while True:
        pids = processes_mentioning(marker)
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.05)


def lines_with(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def elastic_demo_steps(stdout: str) -> tuple[int, int]:
    """tandem.examples.elastic's steps: those its run line gives, and those it must
    give where the replacement was admitted (its "admitted j1 ... going on with
    step K" line). 120 samples, 4 per rank a step: steps 1-2 at world 3, step 3
    on at world 2, from step K at world 3 again, the last step's batch short. A
    spare may ask to join before the loss's regroup ends: then both are one
    regroup ("admitted j1 -> world 3 -> 3", K = 3), and the world never is 2."""
    run = re.search(r"trained 1 epoch\(s\), (\d+) steps, over 3 -> (?:2 -> )?3 rank\(s\)", stdout)
    admitted = re.search(r"admitted j1 -> world \d -> 3 \(generation \d+\), going on with step (\d+)", stdout)
    assert run and admitted, stdout
    k = int(admitted.group(1))
    return int(run.group(1)), (k - 1) + math.ceil((120 - 2 * 12 - (k - 3) * 8) / 12)
