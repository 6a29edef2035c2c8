"""tandem under Ray Train: the Ray example (tandem/examples/ray_digits.py), run by
TorchTrainer on a local Ray cluster of two CPU workers, trains DigitNet to the
same parameters as the digits example under `tandem run` with two ranks.

Skipped, with the reason, where Ray Train or scikit-learn is not installed or a
local Ray cluster cannot start."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    import ray
    import ray.train  # raises ImportError without the [train] extra's pandas, pyarrow, ...
except ImportError as e:
    pytest.skip(f"Ray Train is not importable ({e}): pip install 'tandem[ray]'", allow_module_level=True)
pytest.importorskip("sklearn", reason="the digits dataset ships with scikit-learn: pip install scikit-learn")

from tandem.examples import ray_digits  # noqa: E402
from tandem.examples.digits import DigitNet  # noqa: E402

# Ray Train imports Ray Data, whose configuration warns about its own deprecated options.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")

EPOCHS = 2
STEPS = EPOCHS * 23  # 1437 images, 719 per rank, batches of 32
DEADLINE_S = 240     # a Ray run that never ends fails the test instead of hanging CI


@pytest.fixture(scope="module")
def local_ray():
    """A Ray cluster of this machine's two CPUs (one per worker), stopped after the module."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        env.setenv("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")  # each worker line once in the log
        env.setenv("OMP_NUM_THREADS", "1")  # as the reference's ranks: the same sums, bit for bit
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False)
        except Exception as e:  # the reasons vary: no shared memory, no ports, sandboxing
            pytest.skip(f"a local Ray cluster could not start here: {type(e).__name__}: {e}")
        try:
            yield
        finally:
            ray.shutdown()


def _within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``, or a failure once ``seconds`` have passed (the stuck thread is a daemon)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as e:  # re-raised in the test's thread
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"the Ray run did not finish within {seconds} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _start_tandem_run(output_dir: Path) -> subprocess.Popen:
    """The reference: the digits example under `tandem run` with two ranks, started
    in the background so that its start-up overlaps Ray's."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"  # as each Ray worker (one CPU each): the same sums, bit for bit
    argv = [sys.executable, "-m", "tandem", "run", "--nproc-per-node", "2", "-m", "tandem.examples.digits",
            "--no-progress", "--epochs", str(EPOCHS), "--output-dir", str(output_dir)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _final_weights(proc: subprocess.Popen, output_dir: Path) -> dict[str, torch.Tensor]:
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert f"trained {EPOCHS} epoch(s), {STEPS} steps, over 2 rank(s)" in stdout, stdout[-3000:]
    state = torch.load(output_dir / "checkpoints" / f"step-{STEPS:08d}.pt", weights_only=False)
    return state["model"]


def test_ray_workers_train_like_tandem_run(local_ray, tmp_path):
    tandem_run = _start_tandem_run(tmp_path / "tandem-run")
    args = ray_digits.parse_args(["--num-workers", "2", "--epochs", str(EPOCHS), "--no-plot",
                                  "--output-dir", str(tmp_path / "ray")])
    try:
        result = _within(DEADLINE_S, lambda: ray_digits.run(args))
        reference = _final_weights(tandem_run, tmp_path / "tandem-run")
    finally:
        if tandem_run.poll() is None:  # the Ray run failed first: stop the launcher and its ranks
            tandem_run.terminate()
            tandem_run.wait(timeout=30)

    assert result.metrics["world_size"] == 2 and result.metrics["steps"] == STEPS, result.metrics
    assert result.checkpoint is not None
    with result.checkpoint.as_directory() as d:
        ray_model = torch.load(Path(d) / ray_digits.MODEL_FILE, weights_only=True)
    torch.manual_seed(0)
    initial = DigitNet().state_dict()
    assert ray_model.keys() == reference.keys()
    for name, expected in reference.items():
        assert not torch.equal(expected, initial[name]), f"{name} did not train"
        # The same ranks, data, seeds and one thread per rank: the same arithmetic, bit for bit
        # (with more threads, a convolution may sum in another order).
        diff = (ray_model[name] - expected).abs().max().item()
        assert diff == 0.0, f"{name}: Ray run differs from `tandem run` by {diff:.3g}"
