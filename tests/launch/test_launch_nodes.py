"""Two nodes on one machine: two ``tandem run`` commands form one world of 4 with
global ranks 0..3 and local ranks 0..1 on each node, with node ranks
(``--node-rank``, static rendezvous) and without (``--rdzv-endpoint``, c10d)."""

from __future__ import annotations

import pytest

from test_launch_support import TANDEM, Job, clean_env, free_port, lines_with, script

from tandem.comm.job_secret import new_secret

WORLD = """
    import os, torch, torch.distributed as dist, tandem

    world = tandem.init()
    t = torch.tensor([float(world.rank)])
    dist.all_reduce(t)
    print(f"WORLD rank={world.rank} local={world.local_rank}/{world.local_world_size} "
          f"size={world.world_size} node={os.environ['GROUP_RANK']} sum={t.item():g}", flush=True)
    tandem.shutdown()
"""


@pytest.mark.parametrize("form", ["node-rank", "endpoint"])
def test_two_nodes_form_one_world(tmp_path, form):
    path = script(tmp_path, "world.py", WORLD)
    port = free_port()
    if form == "node-rank":
        nodes = [["--node-rank", str(n), "--master-addr", "127.0.0.1", "--master-port", str(port)]
                 for n in (0, 1)]
    else:
        nodes = [["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes"]] * 2
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
