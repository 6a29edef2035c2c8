"""tandem against torch as the world grows: DDP and fully_shard on gloo worlds of 2, 4 and 8, one machine.

Run book::

    python benchmarks/bench_scale.py                       # worlds 2,4,8, quick settings: needs 8 cores
    python benchmarks/bench_scale.py --worlds 2            # 17 s on 2 cores
    python benchmarks/bench_scale.py --worlds 2,4          # fewer worlds
    python benchmarks/bench_scale.py --ddp-repeats 16 --ddp-steps 5 --fsdp-rounds 20 --fsdp-steps 3
                                                           # the two scripts' own defaults: several minutes
    python benchmarks/bench_scale.py --worlds 4 --oversubscribe   # a run on fewer cores: checks, times mean nothing

For each world in ``--worlds``, in that order, two runs of the sibling scripts'
own rank functions (tandem.testing.run_distributed: forkserver children, a gloo
group, one intra-op thread per rank, so that a world of 8 needs 8 cores):

* bench_ddp.py, one model (``--ddp-model``, the transformer by default: 6
  encoder layers of width 384, 10.6M parameters in 72 tensors): tandem's DDP,
  torch's DDP, and its ``compute`` (no DDP) and ``comm`` (one all-reduce of all
  gradients) baselines, ``--ddp-repeats`` rotating rounds of ``--ddp-steps`` steps;
* bench_fsdp.py, its model (``--width``, ``--depth``; 13.1M parameters by
  default) with AdamW: tandem's fully_shard against torch's FSDP2, both
  resharding after forward (the default), ``--fsdp-rounds`` rotating rounds of
  ``--fsdp-steps`` steps.

The quick defaults were sized on 2 cores, where world 2 takes 17 s (8 s each
comparison, the first with the ranks' start-up). Worlds 4 and 8 run there only
oversubscribed (31 s and 81 s): a rank of world 8 costs about 1.2 times the
CPU of a rank of world 2, so on 16 cores, a core per rank, all three worlds
should take about a minute (an estimate, not a run there).

A world runs only if it fits the cores this process may use (its CPU affinity,
else os.cpu_count()): one rank per core. ``--oversubscribe`` lifts that, for a
check on a small machine. Each run has ``--timeout`` seconds, start-up
included; a run that fails or times out leaves its error in its world's row,
and the other runs and worlds go on. Every world prints its two scripts' own
tables (compute, all-reduce, overlap and bytes held, as bench_ddp.py and
bench_fsdp.py print them) and its elapsed time as soon as it is done, so that a
run cut short keeps what it measured; at the end one Markdown table, with the
command line and the versions, to paste into docs/benchmarks/gpu.md ("Scaling on CPU"):

    world | DDP tandem ms | DDP torch ms | ratio [q1-q3] | fsdp tandem ms | FSDP2 ms | ratio [q1-q3]

Each ratio is the one its script prints in bold, with the quartiles of the
per-round ratios (tandem's block over torch's block of the same round): for
DDP, the median step of tandem over torch's (over all measured steps); for
fully_shard, the median over rounds of the per-round ratio. Times are rank 0's
clock: DDP the median step, fully_shard the median over rounds of each block's
mean step.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from typing import Any

import bench_ddp  # the sibling scripts, on sys.path when this one is run
import bench_fsdp
import torch

from tandem.testing import RankFailure, run_distributed

FSDP_PAIR = ("tandem-fsdp", "torch-fsdp")


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def parse_worlds(text: str) -> tuple[int, ...]:
    try:
        worlds = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not worlds or min(worlds) < 1:
        raise argparse.ArgumentTypeError(f"expected world sizes >= 1, got {text!r}")
    return worlds


def failure(e: BaseException) -> str:
    """One line for a table cell: the failing rank's last traceback line, or the timeout."""
    if isinstance(e, RankFailure):
        lines = e.tracebacks[e.rank].strip().splitlines() or ["(no traceback)"]
        return f"rank {e.rank}: {lines[-1]}"
    return f"{type(e).__name__}: {e}".splitlines()[0]


def run_ddp(world: int, args: argparse.Namespace) -> dict[str, Any]:
    cfg = bench_ddp.BenchConfig(models=(args.ddp_model,), steps=args.ddp_steps,
                                warmup=args.ddp_warmup, repeats=args.ddp_repeats)
    records = run_distributed(bench_ddp.bench_rank, world_size=world, args=(cfg,), timeout=args.timeout)[0]
    row = bench_ddp.summarise(records[0])[0]
    print(bench_ddp.format_table([row]))
    return {"tandem": row["median"]["tandem"], "torch": row["median"]["torch"],
            "ratio": row["ratio"], "quartiles": row["ratio_iqr"]}


def fsdp_args(world: int, args: argparse.Namespace) -> argparse.Namespace:
    """bench_fsdp.py's own settings (its defaults for what this script does not set)."""
    return bench_fsdp.build_parser().parse_args([
        "--world-size", str(world), "--width", str(args.width), "--depth", str(args.depth),
        "--warmup", str(args.fsdp_warmup), "--steps", str(args.fsdp_steps),
        "--rounds", str(args.fsdp_rounds), "--contenders", ",".join(FSDP_PAIR)])


def run_fsdp(world: int, args: argparse.Namespace) -> dict[str, Any]:
    results = run_distributed(bench_fsdp.bench_rank, world, args=(fsdp_args(world, args),),
                              timeout=args.timeout)
    print(bench_fsdp.format_table(results))
    times = results[0]["times"]
    vs = bench_fsdp.vs_torch(times, FSDP_PAIR[0])
    return {"tandem": statistics.median(times[FSDP_PAIR[0]]),
            "torch": statistics.median(times[FSDP_PAIR[1]]),
            "ratio": vs["per_round"], "quartiles": vs["quartiles"]}


def measure_world(world: int, args: argparse.Namespace, cores: int) -> dict[str, Any]:
    """Both runs at one world; a failure or refusal becomes the row's text."""
    row: dict[str, Any] = {"world": world}
    if world > cores and not args.oversubscribe:
        row["refused"] = f"refused: {world} ranks need {world} cores, this process may use {cores}"
        print(f"\n## world {world}: {row['refused']} (--oversubscribe runs it anyway)", flush=True)
        return row
    started = time.perf_counter()
    for bench, run in (("ddp", run_ddp), ("fsdp", run_fsdp)):
        if bench not in args.benches:
            continue
        print(f"\n## world {world}, {bench}\n", flush=True)
        t0 = time.perf_counter()
        try:
            row[bench] = run(world, args)
        except Exception as e:  # one failed run must not lose the other rows
            row[bench] = {"error": failure(e)}
            print(f"FAILED: {row[bench]['error']}")
            if not isinstance(e, (RankFailure, TimeoutError)):
                traceback.print_exc(file=sys.stdout)
        print(f"\n({bench} at world {world}: {time.perf_counter() - t0:.1f} s)", flush=True)
    row["elapsed"] = time.perf_counter() - started
    print(f"\nworld {world} done in {row['elapsed']:.1f} s", flush=True)
    return row


def _cells(result: dict[str, Any] | None) -> list[str]:
    if result is None:
        return ["", "", ""]
    if "error" in result:
        return [f"failed: {result['error'].replace('|', '/')}", "", ""]
    q = result["quartiles"]
    spread = "" if q is None else f" [{q[0]:.2f}-{q[1]:.2f}]"
    return [bench_ddp._ms(result["tandem"]), bench_ddp._ms(result["torch"]),
            f"**{result['ratio']:.2f}**{spread}"]


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| world | DDP tandem ms | DDP torch ms | ratio [q1-q3] | fsdp tandem ms | FSDP2 ms "
             "| ratio [q1-q3] | s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        if "refused" in row:
            cells = [row["refused"]] + [""] * 6
        else:
            cells = _cells(row.get("ddp")) + _cells(row.get("fsdp")) + [f"{row['elapsed']:.0f}"]
        lines.append(f"| {row['world']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=parse_worlds, default=(2, 4, 8),
                        help="comma-separated world sizes, run in this order (default 2,4,8)")
    parser.add_argument("--benches", type=bench_ddp.name_list(("ddp", "fsdp")), default=("ddp", "fsdp"),
                        help="which comparisons to run at each world (default ddp,fsdp)")
    parser.add_argument("--ddp-model", choices=bench_ddp.MODELS, default="transformer",
                        help="bench_ddp.py's model (default transformer)")
    parser.add_argument("--ddp-warmup", type=int, default=2, help="default 2")
    parser.add_argument("--ddp-steps", type=int, default=3, help="steps per block (default 3)")
    parser.add_argument("--ddp-repeats", type=int, default=6, help="rounds (default 6)")
    fsdp_defaults = bench_fsdp.build_parser().parse_args([])
    parser.add_argument("--width", type=int, default=fsdp_defaults.width,
                        help=f"bench_fsdp.py's model width (default {fsdp_defaults.width})")
    parser.add_argument("--depth", type=int, default=fsdp_defaults.depth,
                        help=f"bench_fsdp.py's blocks (default {fsdp_defaults.depth})")
    parser.add_argument("--fsdp-warmup", type=int, default=2, help="default 2")
    parser.add_argument("--fsdp-steps", type=int, default=2, help="steps per block (default 2)")
    parser.add_argument("--fsdp-rounds", type=int, default=6, help="rounds (default 6)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds for each run (one world, one comparison), start-up included; "
                             "past it the run's ranks are killed and its row says so (default 60)")
    parser.add_argument("--oversubscribe", action="store_true",
                        help="run worlds larger than the usable cores (their times mean little)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.ddp_steps, args.ddp_repeats, args.fsdp_steps, args.fsdp_rounds) < 1 \
            or min(args.ddp_warmup, args.fsdp_warmup) < 0 or args.timeout <= 0:
        parser.error("steps, repeats and rounds must be >= 1, warm-ups >= 0, --timeout > 0")
    cores = usable_cores()
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    header = (f"torch {torch.__version__}, Python {platform.python_version()}, os.cpu_count() "
              f"{os.cpu_count()}, {cores} usable by this process; gloo, 1 intra-op thread per rank; "
              f"worlds {','.join(map(str, args.worlds))}; {args.timeout:.0f} s per run")
    print(f"{command}\n{header}", flush=True)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    rows = [measure_world(world, args, cores) for world in args.worlds]
    elapsed = time.perf_counter() - started

    print(f"\n## Scaling\n\n`{command}`\n\n{header}; ran {elapsed:.0f} s; 1-min load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    print(format_table(rows))
    numel = sum(p.numel() for p in bench_fsdp.Net(args.width, args.depth).parameters())
    print(f"\n- DDP: bench_ddp.py's {args.ddp_model}, SGD; {args.ddp_repeats} rounds x {args.ddp_steps} "
          f"steps after {args.ddp_warmup} warm-up; median step; ratio = median over median")
    print(f"- fsdp: bench_fsdp.py's {args.depth} blocks of width {args.width} ({numel / 1e6:.2f}M "
          f"parameters), AdamW, reshard after forward, tandem's fully_shard vs torch's FSDP2; "
          f"{args.fsdp_rounds} rounds x {args.fsdp_steps} steps after {args.fsdp_warmup} warm-up; median "
          f"over rounds of the block's mean step; ratio = median of the per-round ratios")
    print("- brackets: quartiles of the per-round ratios; s: seconds the world took, both runs")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
