"""A failure every T seconds: how much of its time an elastic job still trains.

Run book::

    python benchmarks/bench_soak.py                                  # T = 5 and 10 s, 30 failures each
    python benchmarks/bench_soak.py --every 30 --failures 10 --strategies ddp
    python benchmarks/bench_soak.py --every 5 --failures 4 --strategies ddp   # a quick look (1 min)

Each run is :func:`tandem.testing.soak.run_soak` (Note [soak]): ``tandem run
--elastic`` with 4 workers training the soak job (an MLP of ``--hidden`` units,
float64, SGD with momentum, 16 samples per worker per step, a checkpoint every
25 steps), with one worker SIGKILLed at a random point about every T seconds
(uniform in [0.5 T, 1.5 T]; rank 0 and replacements too), and a replacement
started for each. Per run it prints the failures, step efficiency (steps
committed / attempted), training efficiency (time in committed steps / wall
time), sample efficiency (samples in committed steps / what the full world
trains in that wall time at its undisturbed pace), the median time from a
kill to the first member seeing it and to every survivor seeing it, the
median time an admission stopped the members (from the old world's last commit to the
new one's first, less the undisturbed step; with, after the semicolon, a
member's time to build the new group) against the median step, and whether every
check passed (parameters equal to one process on the committed batches,
every sample once per epoch, the last checkpoint loadable, no process left).
After each run, a line splits what the sample efficiency misses into its parts
(``SoakResult.lost_s``: seconds of full-world training per failure, and their
share of the wall time) and gives a replacement's median start (birth to its
Trainer built, from the kill it replaces) and wait (to its first batch).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from tandem.testing.soak import SoakPlan, run_soak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, nargs="+", default=[5.0, 10.0], help="seconds between failures")
    parser.add_argument("--failures", type=int, default=30)
    parser.add_argument("--strategies", nargs="+", default=["ddp", "zero2", "fsdp"])
    parser.add_argument("--hidden", type=int, default=512, help="the MLP's width")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-spare", action="store_true",
                        help="each replacement a new process started when a worker dies (--no-spare)")
    parser.add_argument("--keep", action="store_true",
                        help="keep every run's events and logs (a failed run's are always kept)")
    args = parser.parse_args()
    print("| T (s) | strategy | failures | steps | step eff. | training eff. | sample eff. "
          "| seen after, first; all (median) | admission (median; of it, the group) | step (median) | checks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for every in args.every:
        for strategy in args.strategies:
            tmp = Path(tempfile.mkdtemp(prefix=f"tandem-soak-{strategy}-{every:g}s-"))
            started = time.monotonic()
            r = run_soak(SoakPlan(directory=tmp, strategy=strategy, every_s=every, failures=args.failures,
                                  seed=args.seed, hidden=args.hidden, spare=not args.no_spare,
                                  timeout_s=every * args.failures * 3 + 300))
            took = time.monotonic() - started
            if not r.problems and not args.keep:  # a failed run's events and logs stay, to be looked at
                shutil.rmtree(tmp, ignore_errors=True)
            seen = (f"{statistics.median(r.detect_s) * 1000:.0f} ms; "
                    f"{statistics.median(r.detect_all_s) * 1000:.0f} ms" if r.detect_s else "-")
            admit = (f"{statistics.median(r.admit_s) * 1000:.0f} ms; "
                     f"{statistics.median(r.admit_connect_s) * 1000:.0f} ms" if r.admit_s else "-")
            checks = "all passed" if not r.problems else "; ".join(r.problems)
            print(f"| {every:g} | {strategy} | {len(r.kills)} | {r.steps} | {r.step_efficiency:.1%} | "
                  f"{r.training_efficiency:.1%} | {r.sample_efficiency:.1%} | {seen} | {admit} | "
                  f"{r.step_s * 1000:.0f} ms | {checks} |", flush=True)
            if r.lost_s:
                failures = max(len(r.kills), 1)
                parts = ", ".join(f"{part} {lost / failures:.2f} s ({lost / max(r.wall_s, 1e-9):.1%})"
                                  for part, lost in r.lost_s.items())
                start = (f"; a replacement's start {statistics.median(r.start_s):.2f} s, its wait to be admitted "
                         f"{statistics.median(r.join_s):.2f} s (medians)" if r.start_s and r.join_s else "")
                print(f"<!-- lost per failure: {parts}{start} -->", flush=True)
            if r.problems:
                print(f"<!-- run took {took:.0f} s; its events and logs are in {tmp}; launcher output tail:\n"
                      f"{r.output[-3000:]}\n-->", flush=True)
            elif args.keep:
                print(f"<!-- run took {took:.0f} s; its events and logs are in {tmp} -->", flush=True)


if __name__ == "__main__":
    main()
