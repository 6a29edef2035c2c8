"""A worker's start: the CPU seconds a fresh Python spends importing what a
training script imports, tandem's module against torch's counterpart.

Run book::

    python benchmarks/bench_startup.py              # about a minute on 2 cores
    python benchmarks/bench_startup.py --rounds 9

Every process of a job, and every elastic replacement, starts with these
imports before it can join: on a 2-core machine they were most of a worker's
start. Each row is a fresh ``python -c "import torch; import <module>"`` whose
user + system CPU time (``resource.getrusage`` of the child) is measured;
rounds alternate the order of the rows. Reported: the median over rounds and
the quartiles, and each tandem row over its torch row (``torch`` alone for
rows with no counterpart).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys

ROWS = {  # name: (the import, the torch row it is compared with)
    "torch": ("import torch", "torch"),
    "torch DDP": ("from torch.nn.parallel import DistributedDataParallel", "torch"),
    "tandem DDP": ("from tandem import DistributedDataParallel; DistributedDataParallel", "torch DDP"),
    "torch FSDP2": ("from torch.distributed.fsdp import fully_shard", "torch"),
    "tandem fully_shard": ("from tandem.fsdp import fully_shard", "torch FSDP2"),
    "tandem Trainer": ("from tandem.train import Trainer, prepare", "torch DDP"),
    "tandem elastic + ZeRO": ("from tandem.elastic import run; from tandem.zero import ZeroOptimizer", "torch DDP"),
    "tandem run (launcher)": ("import tandem.launch.cli, tandem.launch.agent", "torch"),
}


def cpu_seconds(code: str) -> float:
    """User + system CPU of one fresh interpreter running ``import torch`` and ``code``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", f"import torch\n{code}"], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {name: [] for name in ROWS}
    names = list(ROWS)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            times[name].append(cpu_seconds(ROWS[name][0]))
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"{'import':<24} {'CPU s (median)':>14} {'quartiles':>14}   {'over':<12} ratio")
    for name, t in times.items():
        q = statistics.quantiles(t, n=4) if len(t) > 1 else [t[0], t[0], t[0]]
        base = ROWS[name][1]
        over, ratio = ("", "") if base == name else (base, f"{median[name] / median[base]:.2f}")
        print(f"{name:<24} {median[name]:>14.2f} {q[0]:>6.2f}-{q[2]:<6.2f}   {over:<12} {ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "seconds": times}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
