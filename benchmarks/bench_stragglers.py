"""What naming stragglers costs a Trainer step, on 2 gloo ranks.

Run book::

    python benchmarks/bench_stragglers.py                  # 12 rounds of 60 steps each way
    python benchmarks/bench_stragglers.py --rounds 20 --steps 100 --width 1024

Two Trainers train the same MLP on the same data, one with
``straggler_every`` at its default (the step's phases timed, four floats
all-gathered at the end of each window of steps, Note [naming a straggler])
and one with ``straggler_every=None``. Each round runs both for ``--steps``
steps, in alternating order; a round's time is its ``fit()``'s wall clock
(the one checkpoint at the epoch's end included, alike for both). It prints
each contender's median step time, the ratio watched/bare of each round
(median and quartiles), each rank's time inside the watch (its share of the
watched fit: the cost itself, without the noise of two runs) and what one
all-gather of the phases takes alone.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import tandem
from tandem.comm.group import GroupComm
from tandem.testing import run_distributed
from tandem.train import trainer as trainer_module
from tandem.train.stragglers import MIN_WINDOW_S, Slow, StepPhases, StragglerWatch

EVERY = tandem.TrainerConfig().straggler_every


def _trainer(every: int | None, width: int, steps: int, out: str) -> tandem.Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 1))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(steps * 32 * 2, width, generator=g), torch.randn(steps * 32 * 2, 1, generator=g))
    config = tandem.TrainerConfig(batch_size=32, epochs=1, log_every=10, progress=False, plot=False,
                                  resume=False, output_dir=out, straggler_every=every)
    return tandem.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), data,
                          lambda o, y: ((o - y) ** 2).mean(), config=config)


class _Timed(StragglerWatch):
    """The watch, with the time its :meth:`end_step` takes (the gather's wait included) summed."""

    spent = 0.0

    def end_step(self, phases: StepPhases) -> list[Slow] | None:
        t0 = time.perf_counter()
        try:
            return super().end_step(phases)
        finally:
            _Timed.spent += time.perf_counter() - t0


def _bench(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    trainer_module.StragglerWatch = _Timed  # type: ignore[misc]
    times: dict[str, list[float]] = {"watched": [], "bare": []}
    shares: list[float] = []
    for r in range(args.rounds + 1):  # round 0 warms up
        order = ("watched", "bare") if r % 2 == 0 else ("bare", "watched")
        for name in order:
            trainer = _trainer(EVERY if name == "watched" else None, args.width, args.steps, tempfile.mkdtemp())
            torch.distributed.barrier()
            _Timed.spent = 0.0
            t0 = time.perf_counter()
            trainer.fit()
            elapsed = time.perf_counter() - t0
            if r > 0:
                times[name].append(elapsed / args.steps)
                if name == "watched":
                    shares.append(_Timed.spent / elapsed)
    comm, phases = GroupComm(None), torch.zeros(4, dtype=torch.float64)
    for _ in range(20):
        comm.all_gather(phases)
    t0 = time.perf_counter()
    for _ in range(200):
        comm.all_gather(phases)
    gather_s = (time.perf_counter() - t0) / 200
    return {"times": times, "gather_s": gather_s, "shares": shares}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--width", type=int, default=512)
    args = p.parse_args()
    outs = run_distributed(_bench, 2, args=(args,), timeout=1800)
    out = outs[0]
    w, b = out["times"]["watched"], out["times"]["bare"]
    ratios = sorted(x / y for x, y in zip(w, b))
    q = statistics.quantiles(ratios, n=4)
    print(f"torch {torch.__version__}, 2 gloo ranks, MLP of width {args.width}, {args.rounds} rounds x "
          f"{args.steps} steps each way")
    print("| contender | median step (ms) |")
    print("|---|---|")
    print(f"| straggler_every={EVERY} | {1e3 * statistics.median(w):.3f} |")
    print(f"| straggler_every=None | {1e3 * statistics.median(b):.3f} |")
    print(f"watched / bare per round: median {statistics.median(ratios):.4f} [quartiles {q[0]:.4f}-{q[2]:.4f}]"
          f" (lower is faster)")
    for rank, o in enumerate(outs):
        sh = o["shares"]
        print(f"rank {rank}: the watch's own time (end_step, the gather's wait included) per fit: median "
              f"{100 * statistics.median(sh):.2f}% [max {100 * max(sh):.2f}%]")
    print(f"one all-gather of the phases alone: {1e6 * out['gather_s']:.0f} us, once a window "
          f"({EVERY} steps or {MIN_WINDOW_S:g} s, whichever is longer)")


if __name__ == "__main__":
    main()
