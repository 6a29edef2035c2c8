"""Across nodes: step time and bytes over the link between two nodes, tandem
against torch, at 10 Gbit/s, 1 Gbit/s and 100 Mbit/s; and the time to see and
get over a lost node.

Run book (as root: it builds network namespaces, tandem.testing.Cluster)::

    python benchmarks/bench_nodes.py                        # about 6 minutes on 2 cores
    python benchmarks/bench_nodes.py --rates 1gbit --rounds 5
    python benchmarks/bench_nodes.py --json /tmp/nodes.json

Two nodes as network namespaces, each with its own address and a ``tbf``
link at the rate (on both ends of its veth pair: the rate holds each way; no
added delay: this kernel has no netem, so latency is queueing only), two
workers per node (``tandem run --nnodes 2 --nproc-per-node 2``, the c10d
store on node 0's address). Contenders, each with AdamW on the same MLP
(``--width``, ``--depth`` Linear+ReLU layers) and batches:

    ddp / torch-ddp                   tandem.DistributedDataParallel / torch's DDP
    zero2 / torch-zero1               tandem ZeRO-2 (zero_stage=2 + ZeroOptimizer) /
                                      torch's DDP + ZeroRedundancyOptimizer (torch has
                                      no ZeRO-2; it is the nearest)
    fully_shard / torch-fully_shard   fully_shard on each Linear, then the model, over all 4
    hsdp / torch-hsdp                 the same on a (2, 2) mesh: shard within a node,
                                      replicate across the two

Rounds alternate the order of the contenders. A block of ``--steps`` steps
starts on a barrier; rank 0 times it, and node 0's rank 0 reads its node's
``eth0`` byte counters (``/sys/class/net/eth0/statistics``, both
directions: everything that crossed the link) before and after. Reported:
the median over rounds of the mean step, the quartiles over rounds, tandem
over torch, and the bytes per step over the link (median over rounds)
against ``tandem plan``'s prediction for 2 nodes (Note [bytes between nodes]
in tandem/planner/traffic.py). The link also carries the store's heartbeats
(a few hundred bytes per second per rank).

Then, at each rate, ``--elastic`` with node 1 killed mid-training: from its
log line, how long node 0's ranks took to see the loss and to regroup, and
the time from the kill until the survivors finished their next step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _two_nodes import launch, link_bytes, require_cluster

HERE = Path(__file__).resolve()
CONTENDERS = ("ddp", "torch-ddp", "zero2", "torch-zero1", "fully_shard", "torch-fully_shard", "hsdp", "torch-hsdp")
PAIRS = (("ddp", "torch-ddp"), ("zero2", "torch-zero1"), ("fully_shard", "torch-fully_shard"),
         ("hsdp", "torch-hsdp"))


# ---------------------------------------------------------------------------- the workers

def _model(width: int, depth: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _contender(name: str, args: argparse.Namespace, rank: int, mesh: Any) -> Callable[[], None]:
    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import tandem

    model = _model(args.width, args.depth)
    gen = torch.Generator().manual_seed(1000 + rank)
    x, y = torch.randn(args.batch, args.width, generator=gen), torch.randn(args.batch, args.width, generator=gen)
    wrapped: Any
    opt: Any
    if name == "ddp":
        wrapped = tandem.DistributedDataParallel(model)
    elif name == "torch-ddp":
        wrapped = TorchDDP(model)
    elif name == "zero2":
        wrapped = tandem.DistributedDataParallel(model, zero_stage=2)
        opt = tandem.ZeroOptimizer(wrapped, torch.optim.AdamW, lr=1e-4)
    elif name == "torch-zero1":
        wrapped = TorchDDP(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
    else:
        shard_mesh = mesh if name.endswith("hsdp") else None
        if name.startswith("torch"):
            def shard(m: Any) -> Any:
                return torch_fully_shard(m, mesh=shard_mesh)
        else:
            def shard(m: Any) -> Any:
                return tandem.fully_shard(m, mesh=shard_mesh, min_unit_bytes=0)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                shard(layer)
        wrapped = shard(model)
    if name in ("ddp", "torch-ddp") or "shard" in name or "hsdp" in name:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(wrapped(x), y).backward()
        opt.step()

    return step


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import tandem

    world = tandem.init()
    mesh = init_device_mesh("cpu", (world.world_size // world.local_world_size, world.local_world_size),
                            mesh_dim_names=("replicate", "shard"))
    names = args.contenders.split(",")
    steps = {n: _contender(n, args, world.rank, mesh) for n in names}
    for step in steps.values():   # warm-up, one contender at a time
        for _ in range(2):
            step()
    times: dict[str, list[float]] = {n: [] for n in names}
    nbytes: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            dist.barrier()
            before = link_bytes() if world.rank == 0 else 0
            t0 = time.perf_counter()
            for _ in range(args.steps):
                steps[n]()
            dist.barrier()
            elapsed = time.perf_counter() - t0
            if world.rank == 0:
                times[n].append(elapsed / args.steps)
                nbytes[n].append((link_bytes() - before) / args.steps)
    if world.rank == 0:
        Path(args.out).write_text(json.dumps({"times": times, "bytes": nbytes}))
    tandem.shutdown()


def elastic_worker(args: argparse.Namespace) -> None:
    """Trains until told to stop; prints each step's end time (node 0's rank 0)."""
    import torch
    from torch.utils.data import TensorDataset

    import tandem
    from tandem.control.generation import ElasticConfig

    tandem.init()
    data = TensorDataset(torch.randn(4096, args.width), torch.randn(4096, args.width))
    model = _model(args.width, 2)
    trainer: Any = None

    def loss_fn(out: Any, y: Any) -> Any:
        time.sleep(0.05)
        if trainer.rank == 0:
            print(f"STEPEND {time.time():.3f} world={trainer.world_size}", flush=True)
        return ((out - y) ** 2).mean()

    config = tandem.TrainerConfig(batch_size=8, epochs=1, progress=False, plot=False, log_every=1000,
                                  resume=False, output_dir=args.out, max_steps=args.elastic_steps,
                                  elastic=ElasticConfig())
    trainer = tandem.Trainer(model, torch.optim.SGD(model.parameters(), lr=1e-3), data, loss_fn, config=config)
    trainer.fit()
    tandem.shutdown()


# ---------------------------------------------------------------------------- the host

def _launch(cluster: Any, extra: list[str], worker_args: list[str], env: dict[str, str] | None = None,
            ) -> list[subprocess.Popen]:
    return launch(cluster, HERE, "bench", extra, worker_args, env)


def _planned(args: argparse.Namespace) -> dict[str, int]:
    """``tandem plan``'s bytes per step between the 2 nodes, by contender."""
    import torch

    from tandem import plan

    layers = [str(i) for i in range(0, 2 * args.depth - 1, 2)]  # each Linear a unit, as the contenders
    report = plan(_model(args.width, args.depth), world_size=4, hsdp=2, nodes=2, fsdp_units=layers,
                  min_unit_bytes=0, sample=(torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)))
    names = {"ddp": "DDP", "zero2": "ZeRO-1/2", "fully_shard": "fully_shard", "hsdp": "HSDP 2x2"}
    return {ours: report.between_nodes(name) or 0 for ours, name in names.items()}


def run_rate(rate: str, args: argparse.Namespace) -> dict[str, Any]:
    from tandem.testing import Cluster

    with tempfile.TemporaryDirectory() as tmp, Cluster(2, rate=rate) as cluster:
        out = Path(tmp) / "result.json"
        worker_args = ["--worker", "--out", str(out), "--contenders", args.contenders, "--rounds",
                       str(args.rounds), "--steps", str(args.steps), "--width", str(args.width), "--depth",
                       str(args.depth), "--batch", str(args.batch)]
        procs = _launch(cluster, [], worker_args)
        logs = [p.communicate(timeout=args.timeout)[0] for p in procs]
        if any(p.returncode for p in procs) or not out.exists():
            raise SystemExit(f"the run at {rate} failed:\n" + "\n".join(log[-3000:] for log in logs))
        result = json.loads(out.read_text())
        result["elastic"] = _elastic(cluster, Path(tmp), args) if args.elastic_steps else None
    return result


def _elastic(cluster: Any, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    worker_args = ["--elastic-worker", "--out", str(tmp / "run"), "--width", str(args.width),
                   "--elastic-steps", str(args.elastic_steps)]
    procs = _launch(cluster, ["--elastic", "--nnodes", "1:2"], worker_args)
    lines: list[str] = []
    assert procs[0].stdout is not None
    killed_at = None
    for line in procs[0].stdout:
        lines.append(line)
        if killed_at is None and "STEPEND" in line and len([x for x in lines if "STEPEND" in x]) == 20:
            cluster.kill(1)
            killed_at = time.time()
    procs[0].wait(timeout=args.timeout)
    ends = [float(x.split("STEPEND ")[1].split()[0]) for x in lines if "STEPEND" in x and "world=2" in x]
    change = next((x for x in lines if "elastic: lost" in x), "")
    if not change:
        print("no world change seen; node 0's output:\n" + "".join(lines[-40:]), file=sys.stderr)
    seen = float(change.split("failure seen after ")[1].split(" s")[0]) if change else float("nan")
    regroup = float(change.split("regroup took ")[1].split(" s")[0]) if change else float("nan")
    first = min((t for t in ends if killed_at is not None and t > killed_at), default=float("nan"))
    return {"seen_s": seen, "regroup_s": regroup, "next_step_s": first - (killed_at or 0.0)}


def _quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def format_results(results: dict[str, dict[str, Any]], planned: dict[str, int]) -> str:
    lines = ["| link | strategy | tandem ms/step | torch ms/step | tandem / torch | bytes/step over the link: "
             "tandem | torch | tandem plan | tandem / plan |", "|---|---|---|---|---|---|---|---|---|"]
    for rate, result in results.items():
        times, nbytes = result["times"], result["bytes"]
        for ours, theirs in PAIRS:
            if ours not in times or theirs not in times:
                continue
            t_ours, t_theirs = statistics.median(times[ours]), statistics.median(times[theirs])
            q_ours, q_theirs = _quartiles(times[ours]), _quartiles(times[theirs])
            b_ours, b_theirs = statistics.median(nbytes[ours]), statistics.median(nbytes[theirs])
            want = planned.get(ours)
            lines.append(
                f"| {rate} | {ours} | {1e3 * t_ours:.1f} [{1e3 * q_ours[0]:.1f}-{1e3 * q_ours[1]:.1f}] | "
                f"{1e3 * t_theirs:.1f} [{1e3 * q_theirs[0]:.1f}-{1e3 * q_theirs[1]:.1f}] | {t_ours / t_theirs:.2f} | "
                f"{b_ours / 2**20:.2f} MiB | {b_theirs / 2**20:.2f} MiB | "
                f"{(want or 0) / 2**20:.2f} MiB | {b_ours / want if want else float('nan'):.3f} |")
    if any(r.get("elastic") for r in results.values()):
        lines += ["", "| link | loss seen after s | regroup s | kill to the survivors' next step s |",
                  "|---|---|---|---|"]
        for rate, result in results.items():
            e = result.get("elastic")
            if e:
                lines.append(f"| {rate} | {e['seen_s']:.2f} | {e['regroup_s']:.2f} | {e['next_step_s']:.2f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="10gbit,1gbit,100mbit")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--elastic-steps", type=int, default=60, help="0: skip the lost-node run")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--elastic-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.elastic_worker:
        elastic_worker(args)
        return
    require_cluster("bench_nodes")
    planned = _planned(args)
    results = {}
    for rate in args.rates.split(","):
        t0 = time.time()
        results[rate] = run_rate(rate, args)
        print(f"{rate}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    print(format_results(results, planned))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "planned": planned}, indent=1))


if __name__ == "__main__":
    main()
