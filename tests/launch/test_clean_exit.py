"""A script that raises ends its process with exit code 1 and its traceback, not
SIGABRT ("terminate called without an active exception") and not a wait for its
peers (Note [exit on an uncaught exception] in tandem/comm/exit.py): under
``tandem run``, and as one process, where normal exits, ``sys.exit(n)``,
KeyboardInterrupt, atexit handlers and an interactive console keep Python's
behaviour."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from test_launch_support import clean_env, kill_leftovers, script, tandem

# The case: DDP over models whose shapes depend on the rank. Every rank
# raises in the constructor's check.
SHAPES = """
    import torch.nn as nn, tandem

    world = tandem.init()
    model = tandem.DistributedDataParallel(nn.Linear(4 + world.rank, 2))
"""

# Rank 1 raises in backward at step 3, from a gradient hook on the parameter
# whose gradient comes last, when its other buckets are launched and in flight.
# "waiting": rank 0 is ahead, waiting in its collective for the bucket rank 1
# never launches; the communication hook chains Python callbacks on the
# collectives' futures (which, run by gloo's threads while the interpreter
# shuts down, aborted the process); it ignores SIGTERM, so that the
# launcher's stop does not cut short what it says of rank 1. "late": rank 0
# comes to step 3's collectives only after LATE_S (rank 1 used to wait for it
# while exiting).
MID_BACKWARD = """
    import atexit, os, signal

    def told_at_exit():  # registered first, so run last of the atexit handlers
        from tandem._compat import default_store
        from tandem.store.job_secret import signed
        from tandem.comm.peers import departure, heartbeat_key
        # under tandem run's job secret the heartbeats are signed (Note [signed store])
        beat = signed(default_store()).get(heartbeat_key(int(os.environ["RANK"]))).decode()
        told = departure(beat) is not None
        print(f"peers told before the last atexit handler: {told}", flush=True)

    atexit.register(told_at_exit)

    import sys, time, torch, torch.nn as nn, tandem

    ahead, LATE_S = sys.argv[1], 300
    world = tandem.init()
    if ahead == "waiting" and world.rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.manual_seed(0)
    model = tandem.DistributedDataParallel(nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)]),
                                           bucket_cap_mb=0.001)
    if ahead == "waiting":
        model.register_comm_hook(None, tandem.comm_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def fail(grad):
        raise RuntimeError(f"rank {world.rank}: bad gradient at step 3")

    for step in range(5):
        loss = model(torch.randn(4, 32)).pow(2).mean()
        if step == 3 and world.rank == 1:
            model.module[0].weight.register_hook(fail)
            if ahead == "waiting":
                time.sleep(0.5)
        if step == 3 and world.rank == 0 and ahead == "late":
            time.sleep(LATE_S)
        loss.backward()
        opt.step()
        opt.zero_grad()
"""


def _check_clean_failure(r, path: Path, *, error: str) -> tuple[int, list[str]]:
    """The launcher's status and summary for a job whose script raised ``error``;
    returns the rank that failed first and the summary's lines."""
    out = r.stdout + r.stderr
    assert "terminate called" not in out and "SIGABRT" not in out, r
    assert r.returncode == 1, r
    summary = r.stderr[r.stderr.index("tandem run: the job failed"):]
    lines = summary.splitlines()
    assert lines[0].endswith("failed first, with exit code 1"), summary
    first = int(lines[0].split(": rank ", 1)[1].split()[0])
    assert "    Traceback (most recent call last):" in lines, summary
    assert any(error in line for line in lines), summary
    # Printed once, although the process left with work in flight.
    assert out.count(f"[rank {first}] [rank{first}]: Traceback") == 1, out
    assert r.orphans == [], r  # every process the job started, found by its marker in /proc
    return first, lines


def test_rank_dependent_shapes_exit_with_code_1(tmp_path):
    path = script(tmp_path, "shapes.py", SHAPES)
    r = tandem(["--nproc-per-node", "2", str(path)], cwd=tmp_path, timeout=90)
    _, lines = _check_clean_failure(r, path, error="    ValueError: rank ")
    assert any(line.startswith("    ValueError: rank ") and "'weight'" in line for line in lines), lines
    then = next(line for line in lines if line.startswith("  then: "))
    assert "exit code 1" in then or "stopped by the launcher" in then, lines


@pytest.mark.parametrize("ahead", ["waiting", "late"])
def test_rank_failing_mid_backward_exits_with_code_1(tmp_path, ahead):
    path = script(tmp_path, "mid_backward.py", MID_BACKWARD)
    r = tandem(["--nproc-per-node", "2", str(path), ahead], cwd=tmp_path, timeout=120)
    first, _ = _check_clean_failure(r, path, error="RuntimeError: rank 1: bad gradient at step 3")
    assert first == 1, r
    # The failed rank tells its peers it has left last of all, after the atexit
    # handlers (Note [exit on an uncaught exception]): by the time rank 0 fails
    # of it, rank 1 is all but gone, and the summary names it first.
    assert "[rank 1] peers told before the last atexit handler: False" in r.stdout.splitlines(), r
    if ahead == "waiting":  # Note [how a rank left] in tandem/comm/peers.py: rank 1 raised, and rank 0 says so
        lost = next(line for line in r.stderr.splitlines() if "PeerLostError: rank 0: peer lost during" in line)
        assert "rank 1 crashed: it raised an uncaught RuntimeError (its traceback is in its log)" in lost, lost
    # Not after rank 0's LATE_S (300 s), nor after a collective timeout.
    assert r.seconds < 60, r


# One process, no launcher: a world of one in a real process group. torch is
# imported once; each case runs in a child forked at the top level, which then
# ends as a script does, its output in <case>.out and <case>.err.
ONE_PROCESS = """
    import atexit, code, json, os, sys, threading, time
    import tandem

    here = os.path.dirname(os.path.abspath(__file__))
    children = {}
    for mode in sys.argv[1:]:
        pid = os.fork()
        if pid == 0:
            break
        children[mode] = pid
    else:
        print(json.dumps({mode: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                          for mode, pid in children.items()}))
        sys.exit(0)

    for fd, ext in ((1, "out"), (2, "err")):
        os.dup2(os.open(os.path.join(here, f"{mode}.{ext}"), os.O_WRONLY | os.O_CREAT), fd)
    if mode != "console":
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    tandem.init()
    atexit.register(lambda: print("atexit ran", flush=True))
    left_open = open(os.path.join(here, mode + ".txt"), "w")
    left_open.write("buffered")
    sys.stdout.write("unflushed ")
    if mode == "exit3":
        sys.exit(3)
    elif mode == "raise":
        raise ValueError("boom")
    elif mode == "interrupt":
        raise KeyboardInterrupt
    elif mode == "thread":
        def late():
            time.sleep(0.5)
            print("thread finished", flush=True)
        threading.Thread(target=late).start()
        raise ValueError("boom")
    elif mode == "console":
        code.interact(banner="", exitmsg="", local={})
        print("console returned", flush=True)
    elif mode == "after_shutdown":
        tandem.shutdown()
        raise ValueError("boom")
"""

_ONE_PROCESS_CASES = {
    # mode: (exit status, stdout, tracebacks on stderr)
    "normal": (0, "unflushed atexit ran\n", 0),
    "exit3": (3, "unflushed atexit ran\n", 0),
    "raise": (1, "unflushed atexit ran\n", 1),
    "interrupt": (-signal.SIGINT, "unflushed atexit ran\n", 1),
    "thread": (1, "unflushed thread finished\natexit ran\n", 1),
    # The console reports the error and goes on; the process ends normally.
    "console": (0, "unflushed >>> >>> alive\n>>> console returned\natexit ran\n", 1),
    "after_shutdown": (1, "unflushed atexit ran\n", 1),
}


def test_one_process_keeps_pythons_exits(tmp_path):
    path = script(tmp_path, "one.py", ONE_PROCESS)
    marker = uuid.uuid4().hex
    try:
        r = subprocess.run([sys.executable, str(path), *_ONE_PROCESS_CASES], check=False, cwd=tmp_path,
                           env=clean_env(TANDEM_TEST_MARKER=marker), text=True,
                           input='1/0\nprint("alive")\n', capture_output=True, timeout=90,
                           start_new_session=True)
    finally:
        kill_leftovers(marker)
    assert r.returncode == 0, r
    statuses = json.loads(r.stdout)
    for mode, (status, stdout, tracebacks) in _ONE_PROCESS_CASES.items():
        out, err = ((tmp_path / f"{mode}.{ext}").read_text() for ext in ("out", "err"))
        where = f"{mode}: exit {statuses[mode]}\n--- stdout\n{out}\n--- stderr\n{err}"
        assert statuses[mode] == status, where
        assert out == stdout, where
        assert err.count("Traceback (most recent call last)") == tracebacks, where
        assert "terminate called" not in err, where
        assert (tmp_path / f"{mode}.txt").read_text() == "buffered", where
