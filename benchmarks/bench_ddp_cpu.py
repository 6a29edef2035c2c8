"""What each DDP costs the training thread per step, without communication: a
world of one (gloo), tandem's reducer built anyway, on bench_ddp.py's models.

Run book::

    python benchmarks/bench_ddp_cpu.py                     # many: plain, tandem, torch in alternating rounds
    python benchmarks/bench_ddp_cpu.py --model transformer
    python benchmarks/bench_ddp_cpu.py --bare-hooks        # a bare post-accumulate-grad hook's cost per call
    py-spy record --rate 500 --format raw -o spy.txt -- \\
        python benchmarks/bench_ddp_cpu.py --loop 15          # 15 s of tandem steps, for a sampling profiler

Each round times 10 steps of each contender with ``time.thread_time`` (CPU of
the main thread); the table gives the medians over rounds and each DDP's
overhead over the plain step. ``--bare-hooks`` times the plain model with and
without one trivial hook per parameter, in alternating rounds.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from bench_ddp import build_workload, make_train_step

import tandem


def _timed(step: Callable[[], None], steps: int) -> float:
    started = time.thread_time()
    for _ in range(steps):
        step()
    return (time.thread_time() - started) / steps * 1e3


def contenders(model: str) -> dict[str, Callable[[], None]]:
    work = build_workload(model, 0)
    ddp = tandem.DistributedDataParallel(copy.deepcopy(work.model))
    ddp._make_reducer()  # a world of one builds none: Note [gradients born in their bucket] needs it
    return {"plain": make_train_step(copy.deepcopy(work.model), work),
            "tandem": make_train_step(ddp, work),
            "torch": make_train_step(torch.nn.parallel.DistributedDataParallel(copy.deepcopy(work.model)), work)}


def overheads(model: str, rounds: int) -> str:
    steps = contenders(model)
    for step in steps.values():
        for _ in range(5):
            step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(_timed(step, 10))
    med = {k: statistics.median(v) for k, v in times.items()}
    return (f"| {model} | {med['plain']:.2f} | {med['tandem']:.2f} | {med['torch']:.2f} "
            f"| {med['tandem'] - med['plain']:.2f} | {med['torch'] - med['plain']:.2f} |")


def bare_hooks(model: str, rounds: int) -> str:
    work = build_workload(model, 0)
    params = list(work.model.parameters())
    step = make_train_step(work.model, work)
    calls = [0]

    def hook(i: int, p: torch.Tensor) -> None:
        calls[0] += 1

    for _ in range(5):
        step()
    bare, hooked = [], []
    for _ in range(rounds):
        bare.append(_timed(step, 10))
        handles = [p.register_post_accumulate_grad_hook(functools.partial(hook, i)) for i, p in enumerate(params)]
        hooked.append(_timed(step, 10))
        for h in handles:
            h.remove()
    per_call = (statistics.median(hooked) - statistics.median(bare)) * 1e3 / len(params)
    return (f"{model}: {len(params)} hooks; step {statistics.median(bare):.2f} ms without, "
            f"{statistics.median(hooked):.2f} ms with: {per_call:.2f} us per hook call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="many", choices=("mlp", "transformer", "many"))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--bare-hooks", action="store_true", help="time a bare hook per parameter instead")
    parser.add_argument("--loop", type=float, default=0.0, metavar="S",
                        help="run tandem's steps for S seconds (for a sampling profiler) instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        if args.loop:
            step = contenders(args.model)["tandem"]
            end, n = time.monotonic() + args.loop, 0
            while time.monotonic() < end:
                step()
                n += 1
            print(f"{n} tandem steps of {args.model}")
        elif args.bare_hooks:
            print(bare_hooks(args.model, args.rounds))
        else:
            print(f"torch {torch.__version__}, world of one (gloo), 1 thread; medians of {args.rounds} rounds "
                  "x 10 steps, main-thread CPU ms per step\n")
            print("| model | plain | tandem DDP | torch DDP | tandem overhead | torch overhead |")
            print("|---|---|---|---|---|---|")
            print(overheads(args.model, args.rounds))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
