"""A ``tandem run`` per namespace node running the job of _cluster_faults.py
(:class:`Node`), and the checks of its records: every rank ends at the
parameters of one process on the same global batches, and every sample of the
epoch is trained once (tests/launch/test_cluster_faults.py,
tests/launch/test_etcd_plane.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.testing import Cluster
from tandem.testing.replay import world_sizes

sys.path.insert(0, str(Path(__file__).parent))
from _cluster_faults import BATCH, N, global_batches, reference  # noqa: E402

JOB = str(Path(__file__).parent / "_cluster_faults.py")


class Node:
    """One ``tandem run`` on a node, its output collected (with the time of each line) as it comes."""

    def __init__(self, cluster: Cluster, node: int, out: Path, flags: list[str], env: dict[str, str], *,
                 nproc: int = 2, rendezvous: list[str] | None = None) -> None:
        rendezvous = rendezvous or ["--rdzv-endpoint", f"{cluster.address(0)}:29400"]
        argv = [sys.executable, "-m", "tandem", "run", "--nnodes", flags[0], "--nproc-per-node", str(nproc),
                *rendezvous, "--rdzv-id", "faults",
                "--local-addr", cluster.address(node), "--rdzv-timeout", "60", *flags[1:], JOB]
        self.lines: list[tuple[float, str]] = []
        self.proc = cluster.popen(node, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, "OUT": str(out), **env})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def finish(self, timeout: float = 180) -> tuple[int, str]:
        """Its exit status and output; a launcher still running after ``timeout`` fails the test with its output."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"this node's tandem run still ran after {timeout:g} s; its output:\n"
                                 + "".join(line for _, line in self.lines)[-6000:]) from None
        self._reader.join(timeout=10)
        return code, "".join(line for _, line in self.lines)

    def first(self, text: str) -> float | None:
        """When a line with ``text`` came (monotonic), or None."""
        return next((t for t, line in self.lines if text in line), None)


def await_until(check: Callable[[], bool], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def await_paused(out: Path, ranks: int) -> None:
    """Until ``ranks`` ranks wait at the step of PAUSE_AT: the job cannot end before the test acts."""
    await_until(lambda: len(list(out.glob("paused-*"))) == ranks, f"{ranks} ranks paused")


def resume(out: Path) -> None:
    """Let the ranks waiting at PAUSE_AT's step go on."""
    (out / "resume").touch()


def records(out: Path) -> list[dict]:
    return [torch.load(p) for p in sorted(out.glob("done-*.pt"))]


def finished_processes(out: Path) -> set[str]:
    return {p.stem.split("-", 1)[1] for p in out.glob("done-*.pt")}


def used_samples(out: Path, cutoff: int) -> list[int]:
    """Every sample index of a committed step: per process, the last record of
    each step (a step dropped is redone under its number); a process that did
    not finish committed only the steps before ``cutoff``."""
    finished = finished_processes(out)
    used: list[int] = []
    for path in out.glob("samples-*.jsonl"):
        last: dict[int, list[int]] = {}
        for line in path.read_text().splitlines():
            record = json.loads(line)
            last[record["step"]] = record["idx"]
        for step, idx in last.items():
            if path.stem.split("-", 1)[1] not in finished and step >= cutoff:
                continue
            used += idx
    return sorted(used)


def schedule(changes: list[dict], start_world: int = 4) -> list[int]:
    """World size per step: ``start_world`` until each change's step, then its new size."""
    return world_sizes(changes, start_world=start_world, samples=N, batch=BATCH)


def check_result(done: list[dict], world: int, start_world: int = 4) -> list[int]:
    """Every finished rank ends at the same parameters, those of one process on
    the global batches of the world sizes the run went through; returns the
    samples of those batches."""
    assert len(done) == world and {d["world_size"] for d in done} == {world}, done
    changes = done[0]["changes"]
    for d in done[1:]:
        for a, b in zip(done[0]["params"], d["params"]):
            assert torch.equal(a, b), "the replicas differ"
    for a, b in zip(done[0]["params"], reference(schedule(changes, start_world))):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    return sorted(i for batch in global_batches(schedule(changes, start_world)) for i in batch)


