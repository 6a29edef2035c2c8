"""The README's main job runs to completion, under torchrun and as one process,
and exits cleanly (a gloo group kept alive past shutdown used to abort ~1 run in 3)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CMD = ["-m", "tandem.examples.ddp_regression", "--steps", "60", "--log-every", "20"]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("attempt", range(2))
def test_example_under_torchrun_exits_cleanly(attempt: int) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = _run(torchrun + CMD)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "over 2 rank(s)" in proc.stdout
    assert "terminate called" not in proc.stderr


def test_example_as_one_process() -> None:
    proc = _run([sys.executable] + CMD)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "over 1 rank(s)" in proc.stdout
