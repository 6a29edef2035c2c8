"""The README's main job: the digits example reaches the accuracy the README
states, writes its checkpoint and plot, resumes exactly, and runs under
`tandem run`, plain torchrun and as one process. The plain-DDP example exits
cleanly under torchrun (a gloo group kept alive past shutdown used to abort ~1
run in 3)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
TANDEM_RUN = [sys.executable, "-m", "tandem", "run", "--nproc-per-node", "2"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
DIGITS = ["-m", "tandem.examples.digits", "--no-progress"]


def _start(argv: list[str], cwd: Path | None = None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)


def _finish(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{proc.args!r} did not finish within 240 s\n{out[-3000:]}{err[-4000:]}") from None
    assert proc.returncode == 0, out[-3000:] + err[-4000:]
    assert "terminate called" not in err
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _run(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return _finish(_start(argv, cwd))


def _stop(proc: subprocess.Popen) -> None:
    """Stop a job still running (tandem run forwards SIGTERM to its workers)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


INDEPENDENT = {  # the module's jobs that need nothing from each other: started together
    "accuracy": TANDEM_RUN + DIGITS,
    "one_process": [sys.executable] + DIGITS + ["--epochs", "1"],
    "plain_ddp": TORCHRUN + ["-m", "tandem.examples.ddp_regression", "--steps", "60", "--log-every", "20"],
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, subprocess.Popen]]]:
    """Each independent job's directory and process, all started at the first
    test that asks (a job's test waits for its own: :func:`_finish`)."""
    started = {}
    for name, argv in INDEPENDENT.items():
        cwd = tmp_path_factory.mktemp(name)
        started[name] = (cwd, _start(argv, cwd))
    try:
        yield started
    finally:
        for _, proc in started.values():
            _stop(proc)


def _printed(stdout: str, pattern: str) -> str:
    found = re.findall(pattern, stdout)
    assert len(found) == 1, f"expected one match of {pattern!r} in:\n{stdout[-3000:]}"
    return found[0]


def test_main_job_reaches_the_accuracy_the_readme_states(jobs):
    stated = float(_printed(README.read_text(), r"test accuracy of\s+([\d.]+)%"))
    tmp_path, job = jobs["accuracy"]
    proc = _finish(job)
    printed = float(_printed(proc.stdout, r"\[rank 0\] test accuracy ([\d.]+)%"))
    # The run is deterministic on one machine; another CPU may round differently.
    assert abs(printed - stated) <= 1.0, (printed, stated)
    out = tmp_path / "tandem-digits"
    assert (out / "checkpoints" / "step-00000460.pt").is_file()
    assert (out / "loss.png").stat().st_size > 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 92 + 20  # 460/5 train, 20 eval


def test_main_job_resumes_exactly_across_launchers(tmp_path):
    short = ["--epochs", "3", "--output-dir"]
    # One uninterrupted run (in the background, in a directory of its own) ...
    whole_job = _start(TANDEM_RUN + DIGITS + short + ["whole"], cwd=tmp_path)
    try:
        # ... and one stopped mid-epoch under torchrun, resumed under tandem run ...
        stopped = _run(TORCHRUN + DIGITS + short + ["parted", "--max-steps", "30"], cwd=tmp_path)
        assert "trained 1 epoch(s), 30 steps" in stopped.stdout
        resumed = _run(TANDEM_RUN + DIGITS + short + ["parted"], cwd=tmp_path)
        assert "resumed from parted/checkpoints/step-00000030.pt (epoch 1, step 30)" in resumed.stdout
    except BaseException:
        _stop(whole_job)
        raise
    # ... ends where the uninterrupted run ends.
    whole = _finish(whole_job)
    pattern = r"test accuracy ([\d.]+% on \d+ images, test loss [\d.]+)"
    assert _printed(resumed.stdout, pattern) == _printed(whole.stdout, pattern)
    assert "trained 3 epoch(s), 69 steps, over 2 rank(s)" in resumed.stdout


def test_main_job_runs_as_one_process(jobs):
    proc = _finish(jobs["one_process"][1])
    assert "over 1 rank(s)" in proc.stdout and "test accuracy" in proc.stdout


def test_plain_ddp_example_exits_cleanly_under_torchrun(jobs):
    proc = _finish(jobs["plain_ddp"][1])
    assert "over 2 rank(s)" in proc.stdout


def test_the_digits_are_scikit_learns_without_importing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example reads the file scikit-learn ships (importing scikit-learn would
    cost each worker 1.7 s of CPU): the images and labels of ``load_digits``, in
    a process that has not imported scikit-learn; where the file is not found,
    ``load_digits``'s own."""
    np = pytest.importorskip("numpy")
    code = ("import sys; from tandem.examples.digits import _digits; pixels, target = _digits(); "
            "print('sklearn' in sys.modules, pixels.shape, target[:5].tolist())")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert shown.stdout.strip() == "False (1797, 64) [0, 1, 2, 3, 4]", shown
    from sklearn.datasets import load_digits

    from tandem.examples import digits
    want = load_digits()
    for found in (True, False):
        if not found:
            monkeypatch.setattr(digits.importlib.util, "find_spec", lambda name: None)
        pixels, target = digits._digits()
        assert np.array_equal(pixels, want.data) and np.array_equal(target, want.target), found
