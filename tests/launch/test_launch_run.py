"""``tandem run`` end to end, as subprocesses with deadlines: the environment
contract against torchrun, tandem.init under every launcher, the console
output, the failure summary and fail-fast teardown, signals, two jobs on one
machine, and bad input that must fail fast instead of hanging."""

from __future__ import annotations

import json
import signal
import socket
import sys
import time

import pytest

from test_launch_support import (
    TANDEM,
    TORCHRUN,
    Job,
    clean_env,
    finish_all,
    free_port,
    lines_with,
    processes_mentioning,
    run,
    script,
    tandem,
)

from tandem.store.job_secret import new_secret
from tandem.testing.ports import descendants, listening_ports

# Dumps the launcher's variables, then all-reduces through tandem.init. Each
# rank writes its own file: torchrun does not line-buffer its workers' shared
# stdout, so two ranks' prints can interleave within one line.
CONTRACT = """
    import json, os, sys
    import torch, torch.distributed as dist
    import tandem

    names = {k: v for k, v in os.environ.items()
             if k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "ROLE_RANK", "ROLE_NAME", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
             or k.startswith("TORCHELASTIC_")}
    world = tandem.init()
    t = torch.tensor([float(world.rank + 1)])
    dist.all_reduce(t)
    # the job secret (Note [signed store] in tandem/store/job_secret.py), and the command
    # lines every local user can read: this worker's and its launcher's
    cmdlines = []
    for pid in (os.getpid(), os.getppid()):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdlines.append(f.read().decode(errors="replace"))
    with open(os.path.join(sys.argv[1], f"{world.rank}.json"), "w") as f:
        json.dump({"rank": world.rank, "local_rank": world.local_rank,
                   "world_size": world.world_size, "sum": t.item(), "env": names,
                   "secret": os.environ.get("TANDEM_JOB_SECRET"), "cmdlines": cmdlines}, f)
    tandem.shutdown()
"""


def results(folder) -> dict[int, dict]:
    out = {}
    for file in folder.glob("*.json"):
        r = json.loads(file.read_text())
        out[r["rank"]] = r
    return out


def test_environment_and_init_as_under_torchrun(tmp_path):
    path = script(tmp_path, "contract.py", CONTRACT)
    (tmp_path / "ours").mkdir()
    (tmp_path / "theirs").mkdir()
    # Both launchers at once: each job has its own ports and directory.
    runs = finish_all({"ours": Job(TANDEM + ["--nproc-per-node", "2", str(path), "ours"], cwd=tmp_path),
                       "theirs": Job(TORCHRUN + ["--standalone", "--nproc-per-node", "2", str(path), "theirs"],
                                     cwd=tmp_path)}, 60)
    ours, theirs = runs["ours"], runs["theirs"]
    assert ours.returncode == 0, ours
    assert theirs.returncode == 0, theirs
    mine, ref = results(tmp_path / "ours"), results(tmp_path / "theirs")
    assert sorted(mine) == sorted(ref) == [0, 1]
    for rank in (0, 1):
        # tandem.init all-reduced across the world of two under both launchers.
        assert mine[rank]["sum"] == ref[rank]["sum"] == 3.0
        a, b = mine[rank]["env"], ref[rank]["env"]
        assert set(b) <= set(a), f"torchrun sets {sorted(set(b) - set(a))} and tandem does not"
        differ = {k for k in b if a[k] != b[k]}
        # Per-job values: the run id, the ports, the error file, the thread count; and
        # the store's address, which a job of one node keeps on loopback (Note [a store
        # on the job's address]) where torchrun gives the host's name.
        assert differ <= {"TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE",
                          "OMP_NUM_THREADS", "MASTER_ADDR"}, {k: (a[k], b[k]) for k in differ}
        assert a["MASTER_ADDR"] == "127.0.0.1"
        assert a["RANK"] == str(rank) and a["LOCAL_RANK"] == str(rank)
        assert a["TORCHELASTIC_RESTART_COUNT"] == "0"
    # tandem run makes a job secret and gives it to its workers, in their environment only
    secret = mine[0]["secret"]
    assert secret is not None and len(secret) == 64 and mine[1]["secret"] == secret
    assert ref[0]["secret"] is None  # torchrun makes none
    for rank in (0, 1):
        assert len(mine[rank]["cmdlines"]) == 2 and all(secret not in c for c in mine[rank]["cmdlines"])
    assert secret not in ours.stdout + ours.stderr
    assert ours.orphans == [] and theirs.orphans == []


HAND = """
    import os, sys, torch, torch.distributed as dist, tandem

    rank, ports, store = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
    for method in ("env", "tcp", "file"):
        if method == "env":
            os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=ports[0])
            world = tandem.init(init_method="env://")
        elif method == "tcp":
            world = tandem.init(init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=2)
        else:
            world = tandem.init(init_method=f"file://{store}", rank=rank, world_size=2)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        print(f"{method} rank={world.rank} world={world.world_size} sum={t.item():g}", flush=True)
        tandem.shutdown()
        if method == "env":
            for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                del os.environ[k]
"""


def test_init_with_ranks_started_by_hand(tmp_path):
    path = script(tmp_path, "hand.py", HAND)
    ports = f"{free_port()},{free_port()}"
    jobs = [Job([sys.executable, str(path), str(rank), ports, str(tmp_path / "store")],
                cwd=tmp_path) for rank in (0, 1)]
    runs = [job.finish(60) for job in jobs]
    for rank, r in enumerate(runs):
        assert r.returncode == 0, r
        for method in ("env", "tcp", "file"):
            assert f"{method} rank={rank} world=2 sum=3" in r.stdout, r


OUTPUT = """
    import os, sys, time
    rank = int(os.environ["RANK"])
    print(f"hello from {rank}")
    sys.stdout.write(f"half from {rank}")
    sys.stdout.flush()
    time.sleep(0.4)
    sys.stdout.write(" and the rest\\n")
    print(f"warning from {rank}", file=sys.stderr)
"""


def test_output_is_prefixed_by_rank_and_filtered(tmp_path):
    path = script(tmp_path, "out.py", OUTPUT)
    r = tandem(["--nproc-per-node", "3", str(path)], cwd=tmp_path)
    assert r.returncode == 0, r
    for rank in range(3):
        assert f"[rank {rank}] hello from {rank}" in r.stdout.splitlines()
        # Written in two pieces, printed as one line.
        assert f"[rank {rank}] half from {rank} and the rest" in r.stdout.splitlines()
        assert f"[rank {rank}] warning from {rank}" in r.stderr.splitlines()
    shown = tandem(["--nproc-per-node", "3", "--ranks", "1", "--log-dir", str(tmp_path / "logs"),
                    str(path)], cwd=tmp_path)
    assert shown.returncode == 0, shown
    assert [line for line in shown.stdout.splitlines() if line.startswith("[rank")] == [
        "[rank 1] hello from 1", "[rank 1] half from 1 and the rest"]
    # The log files keep every rank.
    assert (tmp_path / "logs/attempt_0/rank_2/stdout.log").read_text().startswith("hello from 2")


FAILING = """
    import os, sys, time, datetime
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()

    def load_batch(step):
        raise ValueError(f"corrupt batch at step {step}")

    if rank == 1:
        time.sleep(0.5)
        print(f"FAILING_AT {time.time()}", flush=True)
        load_batch(7)
    elif rank == 0:
        dist.all_reduce(torch.ones(1))  # blocks: rank 1 never joins it
    else:
        time.sleep(600)  # not in any collective: only the launcher can stop it
"""


def test_failure_summary_and_fail_fast(tmp_path):
    path = script(tmp_path, "failing.py", FAILING)
    r = tandem(["--nproc-per-node", "3", "--log-dir", str(tmp_path / "logs"), str(path)],
               cwd=tmp_path, timeout=90)
    assert r.returncode == 1, r
    failed_at = float(lines_with(r.stdout, "FAILING_AT")[0].split()[-1])
    # Torn down within a couple of seconds, not after the 300 s collective timeout.
    assert time.time() - failed_at < 8, r
    summary = r.stderr[r.stderr.index("tandem run: the job failed"):]
    lines = summary.splitlines()
    assert "rank 1 (local rank 1 on" in lines[0] and "exit code 1" in lines[0], summary
    assert "    ValueError: corrupt batch at step 7" in lines, summary
    assert any("load_batch" in line for line in lines), summary
    log = next(line for line in lines if line.startswith("  full log: ")).split(": ", 1)[1]
    assert log == str(tmp_path / "logs/attempt_0/rank_1/stderr.log")
    assert "corrupt batch" in open(log).read()
    assert "rank 2 (stopped by the launcher)" in summary
    assert len(lines) <= 16 and "elastic" not in summary.lower(), summary
    assert r.orphans == []


SLEEPER = """
    import os, time
    print(f"ready {os.getpid()}", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_reaches_the_workers(tmp_path, sig):
    path = script(tmp_path, "sleeper.py", SLEEPER)
    job = Job(TANDEM + ["--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), str(path)],
              cwd=tmp_path)
    pids: list[int] = []
    deadline = time.monotonic() + 30
    while len(pids) < 2 and time.monotonic() < deadline:
        line = job.proc.stdout.readline()
        if "ready" in line:
            pids.append(int(line.split()[-1]))
    assert len(pids) == 2, "the workers did not start"
    job.proc.send_signal(sig)
    r = job.finish(30)
    assert r.returncode == 128 + sig, r
    assert f"got {sig.name}" in r.stderr
    assert r.orphans == [] and not [p for p in pids if p in processes_mentioning(job.marker)]


def test_two_jobs_on_one_machine_do_not_collide(tmp_path):
    path = script(tmp_path, "contract.py", CONTRACT)
    outs = [tmp_path / "standalone", tmp_path / "default"]
    for out in outs:
        out.mkdir()
    jobs = [Job(TANDEM + flags + ["--nproc-per-node", "2", str(path), out.name], cwd=tmp_path)
            for flags, out in zip((["--standalone"], []), outs)]
    runs = [job.finish(90) for job in jobs]
    for r, out in zip(runs, outs):
        assert r.returncode == 0, r
        assert sorted(results(out)) == [0, 1]
        assert {v["sum"] for v in results(out).values()} == {3.0}


def test_port_in_use_is_reported(tmp_path):
    path = script(tmp_path, "hello.py", "print('hi')\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = tandem(["--master-port", str(port), str(path)], cwd=tmp_path, timeout=30)
    assert r.returncode == 1, r
    assert f"port {port} is already in use" in r.stderr and "--master-port" in r.stderr


NEVER_COME = {"static": ["--master-port", "{port}", "--node-rank", "0"],
              "c10d": ["--rdzv-endpoint", "127.0.0.1:{port}"]}


@pytest.fixture(scope="module")
def lone_nodes(tmp_path_factory):
    """One node of two under each rendezvous, started at once: each waits 2 s for
    a node that never comes."""
    ports: list[int] = []
    while len(ports) < len(NEVER_COME):  # two different ports, one per job
        port = free_port()
        if port not in ports:
            ports.append(port)
    jobs = {}
    for (name, flags), port in zip(NEVER_COME.items(), ports):
        cwd = tmp_path_factory.mktemp(f"lone-{name}")
        path = script(cwd, "hello.py", "print('hi')\n")
        jobs[name] = Job(TANDEM + ["--nnodes", "2", "--rdzv-timeout", "2"]
                         + [f.format(port=port) for f in flags] + [str(path)], cwd=cwd,
                         env=clean_env(TANDEM_JOB_SECRET=new_secret()))
    cwd = tmp_path_factory.mktemp("no-secret")
    jobs["no secret"] = Job(TANDEM + ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400",
                                      str(script(cwd, "hello.py", "print('hi')\n"))], cwd=cwd)
    return finish_all(jobs, 40)


def test_a_job_of_several_nodes_without_a_secret_refuses_to_start(lone_nodes):
    r = lone_nodes["no secret"]
    assert r.returncode == 2 and r.seconds < 20, r
    assert "a job of several nodes needs one job secret shared by every node" in r.stderr, r
    assert "export TANDEM_JOB_SECRET_FILE=" in r.stderr and "hi" not in r.stdout


@pytest.mark.parametrize("rendezvous", list(NEVER_COME))
def test_nodes_that_never_come_time_out(lone_nodes, rendezvous):
    r = lone_nodes[rendezvous]
    assert r.returncode == 1, r
    assert "waiting up to 2 s" in r.stderr
    assert "did not complete within 2 s" in r.stderr and "--rdzv-timeout" in r.stderr
    assert r.seconds < 25
    assert "hi" not in r.stdout


def test_console_script_and_module_form(tmp_path):
    import shutil

    exe = shutil.which("tandem", path=str(__import__("pathlib").Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the tandem console script is not installed (pip install -e . creates it)")
    r = run([exe, "run", "--nproc_per_node=2", "-m", "json.tool", "--help"], cwd=tmp_path,
            env=clean_env())
    assert r.returncode == 0, r
    assert len(lines_with(r.stdout, "[rank 1] usage:")) == 1


def test_readme_main_job(tmp_path):
    # The README's first command: the regression example on two workers.
    r = tandem(["--nproc-per-node", "2", "-m", "tandem.examples.ddp_regression", "--steps", "60",
                "--log-every", "20"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r
    assert "over 2 rank(s)" in r.stdout and "terminate called" not in r.stderr
    assert r.orphans == []


def test_auto_workers_and_threads_on_this_machine(tmp_path):
    from tandem.launch.config import resolve_nproc, threads_per_worker
    from tandem.launch.machine import usable_cpus

    cpus = usable_cpus()
    n = resolve_nproc("auto", cpus=cpus, gpus=0).nproc  # the tests hide GPUs (clean_env)
    threads = threads_per_worker(n, cpus=cpus, environ={})
    # --no-python: a shell as the program, its arguments after it.
    r = tandem(["--nproc-per-node", "auto", "--no-python", "sh", "-c",
                "echo rank=$RANK omp=$OMP_NUM_THREADS"], cwd=tmp_path)
    assert r.returncode == 0, r
    assert sorted(lines_with(r.stdout, "rank=")) == sorted(
        f"[rank {rank:>{len(str(n - 1))}}] rank={rank} omp={threads}" for rank in range(n))
    said = lines_with(r.stderr, "worker(s) on this node (auto:")
    assert len(said) == 1 and f"{n} worker(s)" in said[0] and f"OMP_NUM_THREADS={threads}" in said[0]


LISTENING = """
    import sys, time
    from pathlib import Path
    import torch, torch.distributed as dist, tandem

    out = Path(sys.argv[1])
    tandem.init()
    t = torch.ones(1)
    dist.all_reduce(t)
    (out / f"ready-{dist.get_rank()}").touch()
    while not (out / "seen").exists():  # the test reads the sockets meanwhile
        time.sleep(0.05)
    dist.barrier()
"""


def test_a_job_of_one_node_listens_on_loopback_only(tmp_path):
    # Note [a store on the job's address]: the rendezvous store, the workers' store and
    # gloo's listeners, each process's, read from /proc while the job runs.
    path = script(tmp_path, "listening.py", LISTENING)
    job = Job(TANDEM + ["--nproc-per-node", "2", str(path), str(tmp_path)], cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
        assert job.proc.poll() is None and time.monotonic() < deadline, job.finish(5)
        time.sleep(0.05)
    ports = listening_ports(descendants(job.proc.pid))
    (tmp_path / "seen").touch()
    r = job.finish(60)
    assert r.returncode == 0, r
    launcher = ports.pop(job.proc.pid)
    workers = {pid: found for pid, found in ports.items() if found}
    assert len(launcher) >= 2, ports  # the rendezvous store and the workers' store at least
    assert len(workers) == 2 and all(workers.values()), ports  # gloo's listeners, in each worker
    everything = [address for found in (launcher, *workers.values()) for address, _ in found]
    assert set(everything) == {"127.0.0.1"}, (launcher, workers)
