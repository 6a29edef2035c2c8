"""Restarts that work: a worker SIGKILLed mid-training under ``--max-restarts`` makes
the agent restart the whole group and the job completes, three times in a row
in one job (plain torchrun fails such restarts, see Note [one store per
attempt]); a script that fails on every attempt ends after exactly K+1 attempts."""

from __future__ import annotations

from test_launch_support import lines_with, script, tandem

TRAIN = """
    import os, signal, time
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"start rank={rank} attempt={attempt}", flush=True)
    w = torch.zeros(4)
    for step in range(20):
        g = torch.full((4,), float(rank + 1))
        dist.all_reduce(g)
        w -= 0.1 * g / dist.get_world_size()
        # Attempts 0, 1 and 2 each lose a worker mid-training (rank 1, 0, 1): no
        # cleanup, no goodbye. Attempt 3 runs to the end.
        if attempt < 3 and rank == (attempt + 1) % 2 and step == 8:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.01)
    print(f"done rank={rank} attempt={attempt} w={w[0].item():.2f}", flush=True)
    dist.destroy_process_group()
"""


def test_sigkill_mid_training_three_times_in_a_row_then_completes(tmp_path):
    path = script(tmp_path, "train.py", TRAIN)
    r = tandem(["--nproc-per-node", "2", "--max-restarts", "3", str(path)], cwd=tmp_path,
               timeout=120)
    assert r.returncode == 0, r
    # Every attempt started both ranks: the whole group was restarted, not the dead rank.
    for rank in (0, 1):
        for attempt in range(4):
            assert f"start rank={rank} attempt={attempt}" in r.stdout, r
        assert f"done rank={rank} attempt=3 w=-3.00" in r.stdout, r
    assert "after 3 restart(s)" in r.stderr
    assert r.orphans == []


ALWAYS_FAILS = """
    import os, pathlib, time
    attempt, rank = os.environ['TORCHELASTIC_RESTART_COUNT'], os.environ['RANK']
    print(f"attempt {attempt} of rank {rank}", flush=True)
    # Both ranks print before either fails: the first failure makes the agent stop
    # the other, which must not happen before its line is out.
    here = pathlib.Path(__file__).parent
    (here / f"printed-{attempt}-{rank}").touch()
    deadline = time.monotonic() + 20
    while not all((here / f"printed-{attempt}-{r}").exists() for r in range(2)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    raise SystemExit(3)
"""


def test_a_script_failing_every_attempt_gets_exactly_k_plus_one(tmp_path):
    path = script(tmp_path, "always_fails.py", ALWAYS_FAILS)
    r = tandem(["--nproc-per-node", "2", "--max-restarts", "2", "--log-dir", str(tmp_path / "logs"),
                str(path)], cwd=tmp_path, timeout=60)
    assert r.returncode == 1, r
    assert len(lines_with(r.stdout, "[rank 0] attempt")) == 3
    assert [line.split("] ")[1] for line in lines_with(r.stdout, "[rank 1] attempt")] == [
        "attempt 0 of rank 1", "attempt 1 of rank 1", "attempt 2 of rank 1"]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "attempt_0", "attempt_1", "attempt_2"]
    assert "with exit code 3" in r.stderr and "gave up after 3 attempt(s) (--max-restarts 2)" in r.stderr
    assert r.orphans == []
