"""What the collective ledger and the peer-watching waits cost a DDP step, on 2 gloo ranks.

Run book::

    python benchmarks/bench_ledger.py                      # the three bench_ddp.py models
    python benchmarks/bench_ledger.py --models many --steps 20 --repeats 10

Two copies of the same model are wrapped in tandem's DDP. One is left as it is
(``ledger``: every collective written to the ledger, gloo waits sliced and
watching the peers); the other's GroupComm is stripped of both (``bare``: the
collective issued and waited for directly). The blocks alternate in rotating
order, as in ``bench_ddp.py``, whose models, steps and timing this reuses; the
table gives median step times, the ratio ledger/bare with the quartiles of the
per-round ratios, the collectives per step, and two microbenchmarks on rank 0:
one ledger entry issued and completed; one wake of the monitor thread
(heartbeat into the job's store and progress check), which runs 4 times a second;
and a small all-reduce's latency with and without the watched wait, alternating.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import tandem  # noqa: E402
from bench_ddp import MODELS, BenchConfig, _ms, _quartiles, build_workload, make_train_step, run_rounds  # noqa: E402
from tandem.comm.group import GroupComm  # noqa: E402
from tandem.comm.ledger import Ledger  # noqa: E402
from tandem.comm.monitor import current_monitor  # noqa: E402
from tandem.testing import run_distributed  # noqa: E402


def strip_ledger(ddp: torch.nn.Module) -> int:
    """Make every GroupComm reachable from ``ddp`` issue and wait directly; returns how many."""
    found = {id(v): v for obj in (ddp, getattr(ddp, "_reducer", None)) if obj is not None
             for v in vars(obj).values() if isinstance(v, GroupComm)}
    for comm in found.values():
        comm._issue = lambda op, tensor, tag: None  # type: ignore[method-assign,assignment]
        comm._watched = False
    return len(found)


def micro_ledger(n: int = 100_000) -> float:
    ledger = Ledger()
    t0 = time.perf_counter()
    for _ in range(n):
        ledger.complete(ledger.issue("all_reduce", "bucket 3", 4096, "float32", "world"))
    return (time.perf_counter() - t0) / n


def micro_monitor(n: int = 2000) -> float:
    monitor = current_monitor()
    t0 = time.perf_counter()
    for _ in range(n):
        monitor._beat()
        monitor._write_progress()
    return (time.perf_counter() - t0) / n


def micro_wait(rounds: int = 300) -> tuple[float, float]:
    """Median latency of a 1000-element all-reduce waited for directly, and
    through the watched wait (sliced, peers checked between slices), alternating."""
    watched, bare = GroupComm(), GroupComm()
    bare._watched = False
    t = torch.ones(1000)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(rounds):
        for comm, key in ((watched, True), (bare, False)) if i % 2 else ((bare, False), (watched, True)):
            dist.barrier()
            t0 = time.perf_counter()
            comm.all_reduce(t, tag="micro")
            times[key].append(time.perf_counter() - t0)
    return statistics.median(times[True]), statistics.median(times[False])


def bench_rank(rank: int, world_size: int, cfg: BenchConfig) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    out = []
    for name in cfg.models:
        work = build_workload(name, rank)
        with_ledger = tandem.DistributedDataParallel(copy.deepcopy(work.model))
        bare = tandem.DistributedDataParallel(copy.deepcopy(work.model))
        assert strip_ledger(bare) >= 1
        ledger = current_monitor().ledger
        steps = {"ledger": make_train_step(with_ledger, work), "bare": make_train_step(bare, work)}
        blocks, _ = run_rounds(steps, cfg)
        before = ledger.issued
        steps["ledger"]()
        per_step = ledger.issued - before
        out.append({"model": name, "blocks": blocks, "collectives": per_step})
    waits = micro_wait()
    dist.barrier()
    if rank == 0:
        out.append({"micro_ledger": micro_ledger(), "micro_monitor": micro_monitor(), "waits": waits})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args(argv)
    cfg = BenchConfig(models=tuple(args.models.split(",")), steps=args.steps, warmup=args.warmup,
                      repeats=args.repeats)
    records = run_distributed(bench_rank, 2, args=(cfg,), timeout=3600)[0]
    micro = records.pop()
    print("| model | collectives/step | ledger | bare | ledger/bare [IQR] |")
    print("|---|---|---|---|---|")
    for rec in records:
        med = {c: statistics.median(t for b in rec["blocks"][c] for t in b) for c in ("ledger", "bare")}
        ratios = [statistics.median(a) / statistics.median(b)
                  for a, b in zip(rec["blocks"]["ledger"], rec["blocks"]["bare"])]
        q1, q3 = _quartiles(ratios)
        print(f"| {rec['model']} | {rec['collectives']} | {_ms(med['ledger'])} ms | "
              f"{_ms(med['bare'])} ms | {med['ledger'] / med['bare']:.3f} [{q1:.3f}–{q3:.3f}] |")
    print(f"\none ledger entry issued and completed: {micro['micro_ledger'] * 1e6:.2f} µs; "
          f"one monitor wake (heartbeat + progress check): {micro['micro_monitor'] * 1e6:.0f} µs, "
          f"4 wakes/s = {micro['micro_monitor'] * 4 * 100:.3f}% of a core")
    watched, bare = micro["waits"]
    print(f"1000-element all-reduce, median of 300: {watched * 1e6:.0f} µs with the watched wait, "
          f"{bare * 1e6:.0f} µs waited directly ({(watched - bare) * 1e6:+.0f} µs)")


if __name__ == "__main__":
    main()
