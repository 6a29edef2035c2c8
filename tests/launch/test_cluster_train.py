"""Training across nodes: ``tandem run`` on namespace nodes with their own
addresses and a 1 Gbit/s link (tandem.testing.Cluster), the rendezvous on
node 0's address, as the docs' "Many nodes" page writes it. DDP, ZeRO-2,
fully_shard and HSDP (shard within a node, replicate across nodes) each end
at the parameters of one process on the global batch (tests/launch/_cluster_train.py
gives both), on 2 nodes x 2 workers and on 4 nodes x 1; ``--nnodes MIN:MAX``
starts with the nodes that came once the last call has passed; and the
"Launch on many nodes" page's commands train as written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.testing import Cluster, cluster_unavailable, prefixed

sys.path.insert(0, str(Path(__file__).parent))
from _cluster_train import reference  # noqa: E402

REASON = cluster_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no cluster of namespaces here: {REASON}")

JOB = str(Path(__file__).parent / "_cluster_train.py")
STRATEGIES = "ddp,zero2,fully_shard,hsdp"


def _launch(cluster: Cluster, nodes: list[int], nnodes: str, nproc: int, out: Path, strategies: str,
            *extra: str) -> list[tuple[int, str]]:
    """One ``tandem run`` per node, the c10d store on node 0's address; each
    node's exit code and output."""
    procs = []
    for node in nodes:
        argv = [sys.executable, "-m", "tandem", "run", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
                "--rdzv-endpoint", f"{cluster.address(0)}:29400", "--rdzv-id", "train-across",
                "--local-addr", cluster.address(node), "--rdzv-timeout", "60", *extra, JOB, str(out), strategies]
        procs.append(cluster.popen(node, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return [(p.wait(timeout=240), p.communicate()[0]) for p in procs]


def _trained(outs: list[tuple[int, str]], strategies: str) -> dict[str, set[tuple[str, str]]]:
    """For each strategy, the (rank, node) pairs that said they trained it."""
    seen: dict[str, set[tuple[str, str]]] = {s: set() for s in strategies.split(",")}
    for code, out in outs:
        assert code == 0, out[-4000:]
        for line in out.splitlines():
            if "TRAINED " in line:
                fields = dict(kv.split("=") for kv in line.split("TRAINED ")[1].split()[1:])
                seen[line.split("TRAINED ")[1].split()[0]].add((fields["rank"], fields["node"]))
    return seen


def _equal_to_one_process(out: Path, strategies: str) -> None:
    want = reference()
    for strategy in strategies.split(","):
        got = torch.load(out / f"{strategy}.pt")
        assert got.keys() == want.keys(), strategy
        for name in want:
            # gloo adds the ranks' gradients in its own order: equal to float32 rounding.
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6,
                                       msg=prefixed(f"{strategy} {name}"))


def test_two_nodes_of_two_workers_train_as_one_process(tmp_path: Path) -> None:
    with Cluster(2, rate="1gbit") as cluster:
        outs = _launch(cluster, [0, 1], "2", 2, tmp_path, STRATEGIES)
    seen = _trained(outs, STRATEGIES)
    for strategy, ranks in seen.items():
        assert ranks == {("0", "0"), ("1", "0"), ("2", "1"), ("3", "1")}, (strategy, ranks)
    _equal_to_one_process(tmp_path, STRATEGIES)
    assert cluster.leftovers() == []


def test_four_nodes_of_one_worker_with_a_range_of_nodes(tmp_path: Path) -> None:
    """``--nnodes 2:4`` with all four nodes started: the job waits for the
    last call and forms a world of 4, one rank per node."""
    with Cluster(4, rate="1gbit") as cluster:
        outs = _launch(cluster, [0, 1, 2, 3], "2:4", 1, tmp_path, STRATEGIES)
    seen = _trained(outs, STRATEGIES)
    for strategy, ranks in seen.items():
        assert {rank for rank, _ in ranks} == {"0", "1", "2", "3"}, (strategy, ranks)
        assert len({node for _, node in ranks}) == 4, (strategy, ranks)
    _equal_to_one_process(tmp_path, STRATEGIES)
    assert cluster.leftovers() == []


def test_a_range_of_nodes_starts_with_those_that_came(tmp_path: Path) -> None:
    """``--nnodes 2:4`` and only two nodes: once the last call has passed
    (2 s here), the job starts as a world of 2."""
    with Cluster(2, rate="1gbit") as cluster:
        outs = _launch(cluster, [0, 1], "2:4", 1, tmp_path, "ddp", "--rdzv-conf", "last_call_timeout=2")
    assert _trained(outs, "ddp")["ddp"] == {("0", "0"), ("1", "1")}
    _equal_to_one_process(tmp_path, "ddp")
    assert cluster.leftovers() == []


def _losses(metrics: Path) -> list[tuple[str, int, float]]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [(r["kind"], r["step"], r["loss"]) for r in records if "loss" in r]


def _docs_block() -> tuple[str, str, list[list[str]]]:
    """The "Launch on many nodes" page's commands: the line that makes the
    secret, the line every node runs first, and each form's command per node
    (the static form's two lines; the c10d form's one line on both nodes)."""
    page = (Path(__file__).parents[2] / "docs" / "how-to" / "many-nodes.md").read_text()
    block = page.split("```sh\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line and not line.startswith("#")]
    make, export, static0, static1, c10d = lines
    assert make.startswith("python3 -c") and export.startswith("export "), lines
    return make, export, [[static0, static1], [c10d, c10d]]


def test_the_many_nodes_commands_train_as_written_where_the_host_name_is_loopback(tmp_path: Path) -> None:
    """The "Launch on many nodes" page's block, as written but for the address
    10.0.0.1 (node 0's), on two nodes whose host name resolves to 127.0.0.1
    (Note [nodes as namespaces]): the secret made once and read by both nodes,
    then each form of rendezvous. Both train the digits job on 2 x 2 workers
    to the same losses: the same world of 4, placed by node ranks or by
    arrival. (The c10d form once handed every worker ``MASTER_ADDR=localhost``,
    the host name's name, and hung: Note [the address a node gives].)"""
    make, export, forms = _docs_block()
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home)}
    assert subprocess.run(["bash", "-c", make], env=env, timeout=30).returncode == 0
    losses = []
    with Cluster(2, rate="1gbit") as cluster:
        for form, commands in zip(("static", "c10d"), forms):
            procs = []
            for node, command in enumerate(commands):
                cwd = tmp_path / form / f"node{node}"
                cwd.mkdir(parents=True)
                line = f"{export} && {command.replace('10.0.0.1', cluster.address(0))}"
                procs.append(cluster.popen(node, ["bash", "-c", line], with_secret=False, env=env, cwd=cwd,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            outs = [p.communicate(timeout=180)[0] for p in procs]
            for p, out in zip(procs, outs):
                assert p.returncode == 0, (form, out[-4000:])
            [metrics] = (tmp_path / form).glob("node*/tandem-digits/metrics.jsonl")  # rank 0's node writes it
            assert "test accuracy" in "".join(outs), (form, outs[0][-3000:])
            losses.append(_losses(metrics))
    static, c10d = losses
    assert len(static) >= 10 and any(kind == "eval" for kind, _, _ in static), static
    assert [(k, s) for k, s, _ in static] == [(k, s) for k, s, _ in c10d]
    # The same ranks on the same data; gloo's sums in the same order: equal, to float32 rounding at most.
    assert max(abs(a - b) for (_, _, a), (_, _, b) in zip(static, c10d)) < 1e-5, (static, c10d)
    assert cluster.leftovers() == []


def test_the_bytes_between_nodes_are_what_tandem_plan_predicts(tmp_path: Path) -> None:
    """The bytes that cross the link between 2 nodes x 2 workers per step, read
    from node 0's interface counters by benchmarks/bench_nodes.py's workers,
    are within 5% of ``tandem plan --nodes 2`` (Note [bytes between nodes] in
    tandem/planner/traffic.py) for DDP, ZeRO-2, fully_shard and HSDP; the
    heartbeats and the store add a little."""
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_nodes.py"
    sys.path.insert(0, str(bench.parent))
    import bench_nodes

    shape = ["--width", "256", "--depth", "4", "--batch", "16"]
    out = tmp_path / "result.json"
    with Cluster(2, rate="1gbit") as cluster:
        procs = bench_nodes._launch(cluster, [], ["--worker", "--out", str(out), "--contenders",
                                                  "ddp,zero2,fully_shard,hsdp", "--rounds", "1", "--steps", "3",
                                                  *shape])
        logs = [p.communicate(timeout=240)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    measured = json.loads(out.read_text())["bytes"]
    planned = bench_nodes._planned(bench_nodes.build_parser().parse_args(shape))
    for name, want in planned.items():
        assert want > 0 and abs(measured[name][0] / want - 1) < 0.05, (name, measured[name], want)
    assert cluster.leftovers() == []
