"""Two nodes on one machine: two ``tandem run`` commands form one world of 4 with
global ranks 0..3 and local ranks 0..1 on each node, with node ranks
(``--node-rank``, static rendezvous) and without (``--rdzv-endpoint``, c10d);
and the address each node gives the others, known before the rendezvous."""

from __future__ import annotations

import socket

import pytest

from test_launch_support import TANDEM, Job, clean_env, free_port, lines_with, script, tandem

from tandem.store.job_secret import new_secret
from tandem.launch.machine import node_address

WORLD = """
    import os, torch, torch.distributed as dist, tandem

    world = tandem.init()
    t = torch.tensor([float(world.rank)])
    dist.all_reduce(t)
    print(f"WORLD rank={world.rank} local={world.local_rank}/{world.local_world_size} "
          f"size={world.world_size} node={os.environ['GROUP_RANK']} sum={t.item():g}", flush=True)
    tandem.shutdown()
"""


def _node_flags(form: str, port: int, run_id: str) -> list[list[str]]:
    """Each of two nodes' rendezvous flags: with node ranks (static) or an endpoint (c10d)."""
    if form == "node-rank":
        return [["--node-rank", str(n), "--master-addr", "127.0.0.1", "--master-port", str(port)] for n in (0, 1)]
    return [["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id]] * 2


@pytest.mark.parametrize("form", ["node-rank", "endpoint"])
def test_two_nodes_form_one_world(tmp_path, form):
    path = script(tmp_path, "world.py", WORLD)
    port = free_port()
    nodes = _node_flags(form, port, "two-nodes")
    env = clean_env(TANDEM_JOB_SECRET=new_secret())  # the one secret both nodes of a job share
    jobs = [Job(TANDEM + ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-timeout", "60"]
                + flags + [str(path)], cwd=tmp_path, env=env) for flags in nodes]
    runs = [job.finish(120) for job in jobs]
    seen = {}
    for r in runs:
        assert r.returncode == 0, r
        mine = [line.split("] ", 1)[1] for line in lines_with(r.stdout, "WORLD ")]
        assert len(mine) == 2, r
        node = {line.split("node=")[1].split()[0] for line in mine}
        assert len(node) == 1, mine  # both workers of one launcher are on one node
        for line in mine:
            fields = dict(kv.split("=") for kv in line.split()[1:])
            seen[int(fields["rank"])] = fields
        assert r.orphans == []
    assert sorted(seen) == [0, 1, 2, 3]
    for rank, fields in seen.items():
        assert fields["size"] == "4" and fields["sum"] == "6"
        assert fields["local"] == f"{rank % 2}/2" and fields["node"] == str(rank // 2)


def test_a_node_knows_its_address_before_the_rendezvous():
    """Note [the address a node gives] in tandem/launch/machine.py: --local-addr,
    else the route's address toward the rendezvous host, never a name."""
    assert node_address("10.9.8.7", ("10.0.0.1", 29400)) == "10.9.8.7"
    assert node_address(None, ("127.0.0.1", 29400)) == "127.0.0.1"   # every node on this machine
    assert node_address(None, ("localhost", 29400)) == "127.0.0.1"


def test_a_rendezvous_host_named_into_loopback_is_refused_at_once_naming_local_addr(tmp_path):
    """A host name that this machine resolves to loopback (as /etc/hosts does here
    for its own name, skipped where it does not) tells nothing of the address the
    other nodes reach this node by: the launcher stops before starting anything."""
    name = socket.gethostname()
    if not socket.gethostbyname(name).startswith("127."):
        pytest.skip(f"this machine's host name {name!r} does not resolve to loopback")
    with pytest.raises(ValueError, match="--local-addr") as caught:
        node_address(None, (name, 29400))
    assert name in str(caught.value)
    path = script(tmp_path, "world.py", WORLD)
    r = tandem(["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"{name}:{free_port()}",
                str(path)], cwd=tmp_path, timeout=60, env=clean_env(TANDEM_JOB_SECRET=new_secret()))
    assert r.returncode == 2, r
    assert "--local-addr" in r.stderr and f"{name!r}" in r.stderr and "WORLD" not in r.stdout, r


# Node 1's worker, its training done, kills its own launcher before that reaches
# the end: node 1 is lost just after training ended, never to say it finished.
LOST_AT_THE_END = """
    import os, signal, torch, torch.distributed as dist, tandem

    world = tandem.init()
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"TRAINED rank={world.rank} sum={t.item():g}", flush=True)
    tandem.shutdown()
    if os.environ["GROUP_RANK"] == "1":
        os.kill(os.getppid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("form", ["node-rank", "endpoint"])
def test_a_node_lost_just_after_training_is_not_waited_for(tmp_path, form):
    """torch's exit barrier would keep node 0 (the stores' host) 300 s for a
    node that never arrives; node 0 waits only while node 1's launcher still
    beats (Note [nodes of an elastic job] in tandem/launch/node_roll.py: a
    launcher silent for STALE_S is gone)."""
    path = script(tmp_path, "lost.py", LOST_AT_THE_END)
    port = free_port()
    nodes = _node_flags(form, port, "lost-at-end")
    env = clean_env(TANDEM_JOB_SECRET=new_secret())
    jobs = [Job(TANDEM + ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-timeout", "60"]
                + flags + [str(path)], cwd=tmp_path, env=env) for flags in nodes]
    runs = [job.finish(90) for job in jobs]
    assert "TRAINED" in runs[0].stdout + runs[1].stdout and "sum=2" in runs[0].stdout + runs[1].stdout, runs
    assert runs[1].returncode == -9, runs[1]
    assert runs[0].returncode == 0, runs[0]
    assert runs[0].seconds < 60, runs[0]   # torch's barrier: 300 s more


@pytest.mark.parametrize("form", ["node-rank", "endpoint"])
def test_nodes_with_different_secrets_are_told_so(tmp_path, form):
    """Note [stores behind TLS] in tandem/launch/tunnel.py: the node that
    reaches the other's rendezvous store is told at once that its secret
    differs; the host logs one line and names it in its error when the
    rendezvous gives up; nothing trains."""
    path = script(tmp_path, "world.py", WORLD)
    port = free_port()
    nodes = _node_flags(form, port, "two-secrets")
    jobs = [Job(TANDEM + ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-timeout", "8"] + flags + [str(path)],
                cwd=tmp_path, env=clean_env(TANDEM_JOB_SECRET=new_secret())) for flags in nodes]
    runs = [job.finish(90) for job in jobs]
    for r in runs:
        assert r.returncode == 1 and "WORLD" not in r.stdout, r
    told = [r for r in runs if "tandem run: error: this job's secret differs from yours: the rendezvous store at "
            f"127.0.0.1:{port} refused this node's TLS handshake" in r.stderr]
    assert len(told) == 1, runs
    host = runs[1 - runs.index(told[0])]
    # Told at once, not when a rendezvous would give up: the two started together, and
    # the host waits out its 8 s after its own start (a loaded host delays both starts).
    assert told[0].seconds < host.seconds - 4, runs
    assert host.stderr.count("refused a connection from 127.0.0.1 to the rendezvous store: its job secret "
                             "differs from this job's") == 1, host
    last = host.stderr.strip().splitlines()[-1]
    assert last.startswith("tandem run: error: a node at 127.0.0.1 with another job secret was refused at the "
                           "rendezvous store. Then: "), host


@pytest.mark.parametrize("form", ["node-rank", "endpoint"])
def test_nodes_with_different_secrets_and_open_stores_are_told_so(tmp_path, form):
    """Note [another secret at the rendezvous] in tandem/launch/secret_check.py
    (``--open-stores``): each node names the other's secret at once, while it
    waits, and in its error when the rendezvous gives up; nothing trains."""
    path = script(tmp_path, "world.py", WORLD)
    port = free_port()
    nodes = _node_flags(form, port, "two-secrets")
    jobs = [Job(TANDEM + ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-timeout", "8", "--open-stores"]
                + flags + [str(path)], cwd=tmp_path, env=clean_env(TANDEM_JOB_SECRET=new_secret()))
            for flags in nodes]
    runs = [job.finish(90) for job in jobs]
    for r in runs:
        assert r.returncode == 1 and "WORLD" not in r.stdout, r
        assert r.stderr.count("came to the rendezvous at 127.0.0.1") >= 1, r
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("tandem run: error: the node at 127.0.0.1-") and "another job secret" in last, r
