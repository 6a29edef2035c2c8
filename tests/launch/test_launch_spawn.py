"""``tandem.spawn``: each process is initialised (tandem.init) and all-reduces,
return values come back by rank, the first failure is raised with its rank and
traceback and the other processes are stopped. Each case runs as a script in a
subprocess, as users run it, under a deadline."""

from __future__ import annotations

import os
import sys

import pytest

from test_launch_support import run, script

SPAWNING = """
    import os, sys, time
    import torch, torch.distributed as dist
    import tandem

    def train(rank, scale):
        world = dist.get_world_size()  # spawn called tandem.init first
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        print(f"rank {rank} of {world} sees {t.item():g}")
        return {"rank": rank, "env_rank": os.environ["RANK"], "value": t.item() * scale}

    def fails(rank, pid_dir):
        open(os.path.join(pid_dir, f"{rank}.pid"), "w").write(str(os.getpid()))
        if rank == 1:
            time.sleep(0.5)
            raise KeyError("missing shard 5")
        time.sleep(600)  # stopped by spawn when rank 1 fails

    if __name__ == "__main__":
        what = sys.argv[1]
        if what == "train":
            print("RESULT", tandem.spawn(train, args=(10.0,), nprocs=2))
        elif what == "fails":
            try:
                tandem.spawn(fails, args=(sys.argv[2],), nprocs=2)
            except tandem.launch.SpawnError as e:
                print("RANK", e.rank, "EXIT", e.exitcode)
                print("TRACEBACK", e.traceback.strip().splitlines()[-1])
                print("MESSAGE", str(e).splitlines()[0])
                print("LOCAL", any("in fails" in l for l in e.traceback.splitlines()))
        elif what == "lambda":
            try:
                tandem.spawn(lambda rank: rank, nprocs=2)
            except ValueError as e:
                print("VALUEERROR", e)
            # fork reaches any function; init=False leaves the process group to fn.
            print("RESULT", tandem.spawn(lambda rank: (rank, dist.is_initialized()), nprocs=2,
                                         init=False, start_method="fork"))
"""


def test_spawn_initialises_and_returns_by_rank(tmp_path):
    path = script(tmp_path, "spawning.py", SPAWNING)
    r = run([sys.executable, str(path), "train"], cwd=tmp_path, timeout=90)
    assert r.returncode == 0, r
    results = [line.split(" ", 1)[1] for line in r.stdout.splitlines() if line.startswith("RESULT")]
    assert results == [str([{"rank": 0, "env_rank": "0", "value": 30.0},
                             {"rank": 1, "env_rank": "1", "value": 30.0}])]
    assert "[rank 1] rank 1 of 2 sees 3" in r.stdout.splitlines()
    assert r.orphans == []


def test_spawn_raises_the_first_failure_and_stops_the_others(tmp_path):
    path = script(tmp_path, "spawning.py", SPAWNING)
    r = run([sys.executable, str(path), "fails", str(tmp_path)], cwd=tmp_path, timeout=90)
    assert r.returncode == 0, r
    assert "RANK 1 EXIT 1" in r.stdout
    assert "TRACEBACK KeyError: 'missing shard 5'" in r.stdout
    assert "MESSAGE rank 1 failed with exit code 1:" in r.stdout and "LOCAL True" in r.stdout
    pids = [int((tmp_path / "0.pid").read_text())]
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")], "spawn left processes running"
    assert r.orphans == []


def test_spawn_refuses_what_a_new_process_cannot_import_but_fork_can(tmp_path):
    path = script(tmp_path, "spawning.py", SPAWNING)
    r = run([sys.executable, str(path), "lambda"], cwd=tmp_path, timeout=60)
    assert "VALUEERROR" in r.stdout and "start_method='fork'" in r.stdout, r
    assert "RESULT [(0, False), (1, False)]" in r.stdout, r
    with pytest.raises(ValueError, match="nprocs=0"):
        import tandem

        tandem.spawn(print, nprocs=0)
