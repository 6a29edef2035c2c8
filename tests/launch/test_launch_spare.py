"""Spare workers (Note [spare workers] in tandem/launch/spare.py): a spare runs a
script or module as a new process started for it would, dies with its launcher
while it waits, and under ``tandem run --elastic`` becomes the replacement of a
worker that died."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_launch_support import clean_env, elastic_demo_steps, lines_with, script, tandem

from tandem.launch.spare import Spares

SHOW = """
    import atexit, os, random, sys
    print("argv", sys.argv[1:], "name", __name__, "path0", sys.path[0], "cwd", os.getcwd())
    print("env", os.environ.get("TANDEM_TEST_SHOWN"), os.environ.get("TANDEM_TEST_NOT_GIVEN"))
    atexit.register(lambda: print("atexit ran", flush=True))
    if sys.argv[1] == "raise":
        raise RuntimeError("raised on purpose")
    sys.exit(int(sys.argv[1]))
"""


def _ready(spares: Spares, seconds: float = 60.0) -> None:
    """Wait until the spare reads its FIFO (it has imported torch and tandem)."""
    deadline = time.monotonic() + seconds
    while not spares.ready():
        assert time.monotonic() < deadline, "the spare was not ready within 60 s"
        time.sleep(0.02)


def test_a_spare_runs_a_script_as_a_new_process_would(tmp_path: Path) -> None:
    show = script(tmp_path, "show.py", SHOW)
    env = {**clean_env(TANDEM_TEST_SHOWN="given"), "PYTHONHASHSEED": "0"}
    os.environ["TANDEM_TEST_NOT_GIVEN"] = "the launcher's own"  # the spare's, not the replacement's
    try:
        spares = Spares(sys.executable, {}, count=2)
    finally:
        del os.environ["TANDEM_TEST_NOT_GIVEN"]
    try:
        for n, arg in enumerate(["3", "raise"]):
            _ready(spares)
            out, err = tmp_path / f"spare{n}.out", tmp_path / f"spare{n}.err"
            handler = spares.take(["-u", str(show), arg], env, str(out), str(err), local_rank=1)
            assert handler is not None and handler.local_rank_id == 1
            code = handler.proc.wait(timeout=30)
            new = subprocess.run([sys.executable, "-u", str(show), arg], env=env, cwd=os.getcwd(),
                                 capture_output=True, text=True, timeout=30)
            assert code == new.returncode == (3 if arg == "3" else 1), (code, new)
            assert out.read_text() == new.stdout, (out.read_text(), new.stdout)
            assert "env given None" in new.stdout and "atexit ran" in new.stdout
            # The traceback ends the same; above it, runpy's frames stand where the interpreter's were.
            assert err.read_text().splitlines()[-3:] == new.stderr.splitlines()[-3:], (err.read_text(), new.stderr)
    finally:
        spares.close()
    assert spares.pid is None


def test_a_spare_runs_a_module(tmp_path: Path) -> None:
    (tmp_path / "shown_module.py").write_text(script(tmp_path, "unused.py", SHOW).read_text())
    spares = Spares(sys.executable, {}, count=1)
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the module is found from the working directory, as with python -m
    try:
        _ready(spares)
        out = tmp_path / "module.out"
        handler = spares.take(["-u", "-m", "shown_module", "0"], clean_env(TANDEM_TEST_SHOWN="m"), str(out),
                              None, local_rank=0)
        assert handler.proc.wait(timeout=30) == 0
        new = subprocess.run([sys.executable, "-u", "-m", "shown_module", "0"], env=clean_env(TANDEM_TEST_SHOWN="m"),
                             capture_output=True, text=True, timeout=30)
        assert out.read_text() == new.stdout, (out.read_text(), new.stdout)
        assert spares.pid is None  # count=1: no next spare
    finally:
        os.chdir(cwd)
        spares.close()


BUILDS_AN_OPTIMIZER = """
    import sys
    before = set(sys.modules)
    import torch
    torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    print(sorted(m for m in set(sys.modules) - before if m.count(".") < 2))
"""


def test_a_replacement_from_a_spare_builds_its_optimizer_with_nothing_left_to_import(tmp_path: Path) -> None:
    """torch's first optimizer imports torch._dynamo (over a second of CPU, as
    long as the rest of a replacement's start): a spare has imported it."""
    builds = script(tmp_path, "builds.py", BUILDS_AN_OPTIMIZER)
    spares = Spares(sys.executable, {}, count=1)
    try:
        _ready(spares)
        out = tmp_path / "builds.out"
        handler = spares.take(["-u", str(builds)], clean_env(), str(out), None, local_rank=0)
        assert handler is not None and handler.proc.wait(timeout=30) == 0
        assert out.read_text() == "[]\n", out.read_text()
    finally:
        spares.close()
    new = subprocess.run([sys.executable, "-u", str(builds)], env=clean_env(), capture_output=True, text=True,
                         timeout=60)
    assert "'torch._dynamo'" in new.stdout, new   # what a new process imports there


def test_a_spare_is_passed_over_until_ready_and_dies_with_its_launcher(tmp_path: Path) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import sys; from tandem.launch.spare import Spares\n"
         "s = Spares(sys.executable, {}, count=1)\n"
         "print(s.pid, s.take(['-u', 'x.py'], {}, None, None, 0) is None, flush=True)\n"
         "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    try:
        line = launcher.stdout.readline().split()
        spare, passed_over = int(line[0]), line[1]
        assert passed_over == "True"  # still importing: the replacement starts as a new process
        assert Path(f"/proc/{spare}").exists()
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    deadline = time.monotonic() + 10
    while _alive(spare):
        assert time.monotonic() < deadline, f"the spare {spare} outlived its launcher"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


KILLED_WHEN_THE_SPARE_WAITS = """
    import os, signal, sys, time
    from pathlib import Path
    import tandem.examples.elastic as job

    def spare_waiting():  # a spare process that has its FIFO open: it has imported and waits
        for proc in Path("/proc").iterdir():
            try:
                if b"tandem/launch/spare.py" not in (proc / "cmdline").read_bytes():
                    continue
                if any("tandem-spares-" in os.readlink(fd) for fd in (proc / "fd").iterdir()):
                    return True
            except OSError:
                continue
        return False

    if os.environ["RANK"] == "1" and os.environ.get("TANDEM_ELASTIC_JOIN") != "1":
        deadline = time.monotonic() + 60
        while not spare_waiting() and time.monotonic() < deadline:
            time.sleep(0.05)
    job.main(sys.argv[1:])
"""


def test_the_spare_becomes_the_replacement_of_a_killed_worker(tmp_path: Path) -> None:
    run = script(tmp_path, "run.py", KILLED_WHEN_THE_SPARE_WAITS)
    r = tandem(["--nproc-per-node", "3", "--elastic", "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"),
                str(run)], cwd=tmp_path, timeout=150, env=clean_env())
    assert r.returncode == 0, r
    assert "started replacement 1 (pid" in r.stderr and ", the spare) for local rank 1" in r.stderr, r
    assert lines_with(r.stdout, "admitted j1"), r
    said, expected = elastic_demo_steps(r.stdout)  # where the replacement came in: a spare is quicker
    assert said == expected, (said, expected, r)
    done = [line.split("] ", 1)[1] for line in lines_with(r.stdout, "done world=")]
    assert len(done) == 3 and all("world=3" in line for line in done), (done, r)
    assert len({line.split("params=")[1] for line in done}) == 1, done  # equal replicas
    replacement = list((tmp_path / "logs").glob("**/stdout.join1.log"))
    assert [line for p in replacement for line in p.read_text().splitlines() if "done world=" in line], r
    assert r.orphans == []
