"""``tandem run --elastic`` (Note [elastic launch]): a worker SIGKILLed mid-training
leaves the others running; they shrink, a replacement started by the agent joins
at a step boundary with a live worker's state, and the job ends at full size
with equal replicas and exit status 0, leaving no process behind."""

from __future__ import annotations

import re

from test_launch_support import clean_env, elastic_demo_steps, lines_with, script, tandem


def test_a_killed_worker_is_replaced_and_the_job_finishes(tmp_path):
    # The README's and the docs' command: the job ships as tandem.examples.elastic.
    r = tandem(["--nproc-per-node", "3", "--elastic", "--max-restarts", "1", "--log-dir",
                str(tmp_path / "logs"), "-m", "tandem.examples.elastic"], cwd=tmp_path, timeout=150,
               env=clean_env())
    assert r.returncode == 0, r
    assert "worker 1 (local 1" in r.stderr and "exited with -9" in r.stderr, r
    assert "started replacement 1" in r.stderr, r
    lost = lines_with(r.stdout, "elastic: lost rank 1")
    assert lost, r
    # Worker 1 dies in step 3 (after 2 committed): the line's every step is that one
    # (Note [step numbers] in tandem/comm/ledger.py), the collective's included.
    assert "going on with step 3;" in lost[0] and set(re.findall(r"\bstep (\d+)", lost[0])) == {"3"}, lost
    assert lines_with(r.stdout, "admitted j1"), r
    said, expected = elastic_demo_steps(r.stdout)  # where the replacement came in: a spare is quicker
    assert said == expected, (said, expected, r)
    # The replacement's output is on the console like the others' (it was only in its
    # log file), and in that file; every line's prefix is the rank its worker has
    # now (it was the launch rank: "[rank 2] done world=3 rank=1").
    done = [line.split("] ", 1)[1] for line in lines_with(r.stdout, "done world=")]
    assert len(done) == 3, (done, r)
    for line in lines_with(r.stdout, "done world="):
        assert line.startswith(f"[rank {line.split('rank=')[1].split()[0]}] "), (line, r)
    replacement = (tmp_path / "logs").glob("**/stdout.join1.log")
    assert [line for p in replacement for line in p.read_text().splitlines() if "done world=" in line], r
    assert "its output: on the console, and in " in r.stderr, r
    assert all("world=3" in line for line in done), done
    assert len({line.split("params=")[1] for line in done}) == 1, done  # equal replicas
    assert r.orphans == []


ABORT_AFTER_FINISHING = """
    import os
    import torch
    import torch.distributed as dist
    import tandem

    tandem.init()
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"trained rank={dist.get_rank()} sum={t.item():g}", flush=True)
    tandem.shutdown()
    if os.environ["RANK"] == "0":
        os.abort()   # as a teardown that dies with "terminate called without an active exception"
"""


def test_a_worker_that_crashes_after_it_finished_fails_the_job(tmp_path):
    """Note [a crash after finishing]: not a loss the others went on without, so
    never a job that "finished" with exit 0."""
    path = script(tmp_path, "train.py", ABORT_AFTER_FINISHING)
    r = tandem(["--nproc-per-node", "2", "--elastic", str(path)], cwd=tmp_path, timeout=90, env=clean_env())
    assert r.returncode == 1, r
    assert len(lines_with(r.stdout, "trained rank=")) == 2, r
    assert "elastic: worker 0 (local 0" in r.stderr and "crashed with -6 after it finished training" in r.stderr, r
    assert "the job failed" in r.stderr and "finished in" not in r.stderr, r
    assert r.orphans == []


LOST_AT_ONCE = """
    import os, signal
    import torch.distributed as dist
    import tandem

    tandem.init()
    # Both ranks are connected before one dies: a rank 0 that ended while rank 1
    # was still inside gloo's connectFullMesh made it fail there with exit 1.
    dist.barrier()
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    print(f"trained rank={dist.get_rank()}", flush=True)
    tandem.shutdown()
"""


def test_a_worker_lost_and_not_replaced_is_not_counted_among_those_that_finished(tmp_path):
    """The launcher's last line said "2 worker(s) on this node finished" after one
    of the two was killed; and torch's agent must get every worker in its result."""
    path = script(tmp_path, "train.py", LOST_AT_ONCE)
    r = tandem(["--nproc-per-node", "2", "--elastic", str(path)], cwd=tmp_path, timeout=90, env=clean_env())
    assert r.returncode == 0, r.stderr
    assert "elastic: worker 1 (local 1" in r.stderr and "exited with -9; the others go on" in r.stderr, r.stderr
    assert "1 of 2 worker(s) on this node finished in" in r.stderr, r.stderr
    assert "1 lost on the way and not replaced" in r.stderr, r.stderr
    assert r.orphans == []


PAUSED = """
    import hashlib, os, signal, threading, time
    from pathlib import Path
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import tandem

    tandem.init()
    out = Path(os.environ["OUT"])
    out.mkdir(exist_ok=True)
    (out / f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    trainer = None

    def pause(pid):
        os.kill(pid, signal.SIGSTOP)   # the whole process: its heartbeat stops too
        time.sleep(5.0)
        os.kill(pid, signal.SIGCONT)

    def loss_fn(out_, y):
        if os.environ["RANK"] == "0" and trainer.state.step == 3 and not (out / "paused").exists():
            (out / "paused").write_text("")
            threading.Thread(target=pause, args=(int((out / "pid1").read_text()),)).start()
        return ((out_ - y) ** 2).mean()

    config = tandem.TrainerConfig(batch_size=4, epochs=1, progress=False, plot=False, log_every=1,
                                  resume=False, output_dir=str(out / "run"))
    trainer = tandem.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), data, loss_fn,
                             config=config)
    trainer.fit()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    print(f"done world={trainer.world_size} steps={trainer.state.step} "
          f"changes={len(trainer.world_changes)} params={digest.hexdigest()[:16]}", flush=True)
    tandem.shutdown()
"""


def test_a_rank_paused_for_5_s_is_not_a_loss(tmp_path):
    """A stopped process is slow, not dead (Note [deaths seen at once]): the
    others wait for it, and nobody regroups."""
    path = script(tmp_path, "train.py", PAUSED)
    r = tandem(["--nproc-per-node", "2", "--elastic", "--max-restarts", "1", str(path)], cwd=tmp_path,
               timeout=120, env=clean_env(OUT=str(tmp_path / "out")))
    assert r.returncode == 0, r
    assert (tmp_path / "out" / "paused").exists(), r
    done = [line.split("] ", 1)[1] for line in lines_with(r.stdout, "done world=")]
    assert len(done) == 2, r
    assert all(line.startswith("done world=2 steps=8 changes=0 ") for line in done), done
    assert len({line.split("params=")[1] for line in done}) == 1, done
    assert "elastic: lost" not in r.stdout + r.stderr and "exited with" not in r.stderr, r
    assert r.orphans == []


HUNG = """
    import os, time
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import tandem

    tandem.init()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 2, generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    trainer = None

    def loss_fn(out, y):
        if os.environ["RANK"] == "2" and trainer.state.step == 3:
            time.sleep(600)   # stuck, alive: its heartbeat goes on, nobody counts it dead
        return ((out - y) ** 2).mean()

    config = tandem.TrainerConfig(batch_size=4, epochs=1, progress=False, plot=False, log_every=1,
                                  resume=False, output_dir=os.environ["OUT"])
    trainer = tandem.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), data, loss_fn,
                             config=config)
    result = trainer.fit()
    if trainer.rank == 0:
        print(result.describe(), flush=True)
    print(f"done world={trainer.world_size} steps={trainer.state.step}", flush=True)
    tandem.shutdown()
"""


def test_a_hung_rank_under_elastic_is_stopped_and_the_others_go_on(tmp_path):
    """Note [a hung rank under --elastic]: the watchdog's report, then the rank that
    holds the others up is a loss like any other."""
    path = script(tmp_path, "train.py", HUNG)
    r = tandem(["--nproc-per-node", "3", "--elastic", "--hang-timeout", "3", "--log-dir", str(tmp_path / "logs"),
                str(path)], cwd=tmp_path, timeout=120, env=clean_env(OUT=str(tmp_path / "out")))
    assert r.returncode == 0, r
    assert "the job hung:\nno rank completed a collective" in r.stderr, r
    assert "elastic: worker 2 (pid " in r.stderr and "hung: it is in no collective" in r.stderr, r
    assert "the others go on" in r.stderr and lines_with(r.stdout, "elastic: lost rank 2"), r
    done = lines_with(r.stdout, "done world=")
    assert len(done) == 2 and all("done world=2 " in line for line in done), r
    # The run's last line says the worlds it went through, not the one it started in.
    summary = lines_with(r.stdout, "trained 1 epoch(s), ")
    assert len(summary) == 1 and summary[0].endswith(" steps, over 3 -> 2 rank(s)"), r
    assert "2 of 3 worker(s) on this node finished in" in r.stderr, r
    assert r.orphans == []
