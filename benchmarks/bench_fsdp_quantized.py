"""fully_shard with quantized collectives (``comm_policy=QuantizedCommPolicy``,
ZeRO++'s qwZ and qgZ) against fully_shard without them: bytes and step time,
on loopback and over a rate-limited link between two namespaced nodes.

Run book::

    python benchmarks/bench_fsdp_quantized.py                        # loopback and 1 Gbit/s, about 3 minutes
    python benchmarks/bench_fsdp_quantized.py --links loopback       # no namespaces needed
    python benchmarks/bench_fsdp_quantized.py --links 100mbit --rounds 5 --steps 2
    python benchmarks/bench_fsdp_quantized.py --json /tmp/q.json

Each link is one job of ``--workers`` workers (``tandem run``): on loopback
all on this node; otherwise ``--workers / 2`` on each of two namespaced nodes
(tandem.testing.Cluster, as root), whose link is a ``tbf`` queue at the rate.
Every worker builds every contender from the same seed: bench_fsdp.py's model
(an input projection, ``--depth`` residual blocks of LayerNorm, Linear(d, 4d),
GELU, Linear(4d, d), a LayerNorm and a head; ``--width`` d), fully_shard on each
block then on the model (``min_unit_bytes=0``), AdamW, the same batch at every
step. Contenders:

    plain        fully_shard without a comm_policy (fp32 gathers and reduce-scatters)
    int8-int8    QuantizedCommPolicy(weight_bits=8, grad_bits=8)
    int8-int4    QuantizedCommPolicy(weight_bits=8, grad_bits=4)

After ``--warmup`` steps of each, steps run in ``--rounds`` rounds: in each,
every contender runs ``--steps`` steps, starting on a barrier, in an order that
rotates from round to round. Rank 0 times each block (its mean step), reads its
ledger's payload bytes (``bytes_issued``: what it handed to its collectives)
and, over a link, its node's ``eth0`` byte counters (both directions: all that
crossed the link). Reported: the median over rounds of each contender's step
time with the quartiles in brackets; "/ plain" is the median over rounds of the
contender's block over plain's block of the same round (quartiles in
brackets); bytes a step (ledger and link) and plain's over these; and the loss
after the last step over plain's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
CONTENDERS = ("plain", "int8-int8", "int8-int4")
POLICIES = {"plain": None, "int8-int8": (8, 8), "int8-int4": (8, 4)}


# ---------------------------------------------------------------------------- the workers

def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from bench_fsdp import Net  # the sibling script, on sys.path when run

    import tandem
    from tandem.comm.monitor import current_monitor
    from tandem.fsdp import QuantizedCommPolicy

    world = tandem.init()
    torch.set_num_threads(1)
    ledger = current_monitor().ledger
    runs = {}
    for name in CONTENDERS:
        bits = POLICIES[name]
        policy = None if bits is None else QuantizedCommPolicy(weight_bits=bits[0], grad_bits=bits[1])
        torch.manual_seed(0)
        model = Net(args.width, args.depth)
        for block in model.layers:
            tandem.fully_shard(block, comm_policy=policy, min_unit_bytes=0)
        tandem.fully_shard(model, comm_policy=policy, min_unit_bytes=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1000 + world.rank)
        shape = (args.batch, args.width)
        runs[name] = (model, opt, torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))

    def step(name: str) -> float:
        model, opt, x, y = runs[name]
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    for name in CONTENDERS:
        for _ in range(args.warmup):
            step(name)
    on_link = world.rank == 0 and args.link != "loopback"
    times: dict[str, list[float]] = {n: [] for n in CONTENDERS}
    ledger_bytes: dict[str, list[int]] = {n: [] for n in CONTENDERS}
    link: dict[str, list[int]] = {n: [] for n in CONTENDERS}
    losses = {}
    for r in range(args.rounds):
        for name in CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]:
            dist.barrier()
            sent, crossed = ledger.bytes_issued, link_bytes() if on_link else 0
            start = time.perf_counter()
            for _ in range(args.steps):
                losses[name] = step(name)
            times[name].append((time.perf_counter() - start) / args.steps)
            ledger_bytes[name].append((ledger.bytes_issued - sent) // args.steps)
            link[name].append(((link_bytes() - crossed) // args.steps) if on_link else 0)
    if world.rank == 0:
        Path(args.out).write_text(json.dumps({"times": times, "ledger": ledger_bytes, "link": link,
                                              "losses": losses, "world": world.world_size}))
    tandem.shutdown()


def link_bytes() -> int:
    from _two_nodes import link_bytes as counted

    return counted()


# ---------------------------------------------------------------------------- the driver

def _worker_args(link: str, out: Path, args: argparse.Namespace) -> list[str]:
    argv = ["--worker", "--link", link, "--out", str(out)]
    for flag in ("width", "depth", "batch", "warmup", "rounds", "steps"):
        argv += [f"--{flag}", str(getattr(args, flag))]
    return argv


def run_link(link: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        if link == "loopback":
            argv = [sys.executable, "-m", "tandem", "run", "--nproc-per-node", str(args.workers), str(HERE),
                    *_worker_args(link, out, args)]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, env=env)
            logs, failed = [done.stdout + done.stderr], bool(done.returncode)
        else:
            from _two_nodes import launch, require_cluster

            from tandem.testing import Cluster

            require_cluster("bench_fsdp_quantized")
            with Cluster(2, rate=link) as cluster:
                procs = launch(cluster, HERE, f"quantized-{link}", [], _worker_args(link, out, args), env,
                               nproc_per_node=args.workers // 2)
                logs = [p.communicate(timeout=args.timeout)[0] for p in procs]
                failed = any(p.returncode for p in procs)
        if failed or not out.exists():
            raise SystemExit(f"{link} failed:\n" + "\n".join(log[-3000:] for log in logs))
        return json.loads(out.read_text())


def quartiles(values: list[float]) -> str:
    if len(values) < 2:
        return ""
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"[{q1:.2f}, {q3:.2f}]"


def format_results(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| link | contender | step (ms), median [quartiles] | / plain's, per round [quartiles] | "
             "ledger bytes a step | plain's / these | link bytes a step | plain's / these | loss / plain's |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for link, r in results.items():
        times, plain = r["times"], r["times"]["plain"]
        for name in CONTENDERS:
            ms = [t * 1e3 for t in times[name]]
            ratios = [a / b for a, b in zip(times[name], plain)]
            ledger = statistics.median(r["ledger"][name])
            crossed = statistics.median(r["link"][name])
            plain_crossed = statistics.median(r["link"]["plain"])
            lines.append(
                f"| {link} | {name} | {statistics.median(ms):.1f} {quartiles(ms)} | "
                f"**{statistics.median(ratios):.2f}** {quartiles(ratios)} | {ledger:,.0f} | "
                f"{statistics.median(r['ledger']['plain']) / ledger:.2f} | "
                f"{f'{crossed:,.0f}' if crossed else '-'} | {f'{plain_crossed / crossed:.2f}' if crossed else '-'} | "
                f"{r['losses'][name] / r['losses']['plain']:.4f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--links", default="loopback,1gbit", help="loopback and/or tbf rates (1gbit, 100mbit)")
    p.add_argument("--workers", type=int, default=2, help="workers in all (half on each node over a link)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="rows per worker and step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=3, help="steps per contender and round")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--link", default="loopback", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.workers < 2 or args.workers % 2:
        raise SystemExit(f"--workers {args.workers}: an even number >= 2 (half on each node over a link)")
    results = {}
    for link in args.links.split(","):
        t0 = time.time()
        results[link] = run_link(link, args)
        print(f"{link}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    print(format_results(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
