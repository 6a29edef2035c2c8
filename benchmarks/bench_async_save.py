"""Saves that do not stop training: how long a checkpoint blocks the training
thread, synchronous against ``TrainerConfig(async_checkpoint=True)``, on the
GPT example (tandem/examples/gpt.py).

Run book::

    python benchmarks/bench_async_save.py                    # 2 ranks, 3 rounds (about 2 minutes)
    python benchmarks/bench_async_save.py --nproc 1          # one process: full-format checkpoints
    python benchmarks/bench_async_save.py --rounds 5 -- --embd 256 --layers 6   # the example's flags after --

Launches its own ranks (tandem.testing.run_distributed: gloo, CPU). Each round
builds the example's Trainer (``build_trainer``, the example's default flags
and ``--checkpoint-every``) twice, once saving synchronously and once in the
background, the order alternating from round to round, and trains ``--steps``
steps. With 2 ranks the model is fully sharded and the checkpoints are sharded
(every rank writes its shard with DCP); with 1, one file. Measured on rank 0's
training thread:

- step: each optimizer step (the Trainer's step runner); "step" is the median
  of the steps that follow no save, "step after save" the median of the first
  step after each save (an async write runs beside it, on the same cores);
- blocked: each call of the Trainer's save. Synchronous: capture, write,
  commit, prune. Async: wait for the previous save if it is still running,
  capture, copy into the staging buffers, start the writer thread. The last
  save of a run is counted too; the wait for it at the end of ``fit`` is not
  (training is over), and is printed apart.

Printed: per mode, the median over the rounds of each round's median, with the
rounds' min..max, and blocked / step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from typing import Any

import tandem
from tandem.examples import gpt
from tandem.testing import run_distributed

MODES = ("sync", "async")


def _run(rank: int, args: argparse.Namespace, mode: str, output_dir: str, data: Any) -> dict[str, Any]:
    flags = ["--output-dir", output_dir, "--max-steps", str(args.steps), "--checkpoint-every", str(args.every),
             "--no-progress", "--log-every", str(args.steps + 1), *args.example]
    if mode == "async":
        flags.append("--async-checkpoint")
    world = tandem.init()
    trainer = gpt.build_trainer(gpt.parse_args(flags), world, *data)
    steps: list[tuple[int, float]] = []
    saves: list[float] = []
    finishes: list[float] = []
    run, save, finish = trainer._runner.run, trainer._save, trainer._checkpoints.finish

    def timed_run(*a: Any, **k: Any) -> Any:
        started = time.perf_counter()
        out = run(*a, **k)
        steps.append((trainer.state.step + 1, time.perf_counter() - started))
        return out

    def timed_save(*a: Any, **k: Any) -> Any:
        started = time.perf_counter()
        out = save(*a, **k)
        saves.append(time.perf_counter() - started)
        return out

    def timed_finish() -> Any:
        started = time.perf_counter()
        out = finish()
        finishes.append(time.perf_counter() - started)
        return out

    trainer._runner.run, trainer._save = timed_run, timed_save  # type: ignore[method-assign]
    trainer._checkpoints.finish = timed_finish  # type: ignore[method-assign]
    trainer.fit()
    after_save = [t for s, t in steps if s > 1 and (s - 1) % args.every == 0]
    clean = [t for s, t in steps if s > 1 and (s - 1) % args.every != 0]
    return {"step": statistics.median(clean), "after": statistics.median(after_save),
            "blocked": statistics.median(saves), "blocked_max": max(saves),
            "end_wait": finishes[-1], "format": trainer.checkpoint_format.value}


def _bench(rank: int, world_size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    warnings.filterwarnings("ignore", "No artists with labels")  # loss.png of a run without records
    codec, train_ids, val_ids = gpt.split_text(gpt.load_text())
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                result = _run(rank, args, mode, f"{tmp}/round{r}-{mode}", (codec, train_ids, val_ids))
                out.append({"round": r, "mode": mode, **result})
    return out


def _summary(values: list[float], scale: float = 1e3) -> str:
    return f"{statistics.median(values) * scale:.1f} ({min(values) * scale:.1f}..{max(values) * scale:.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=24, help="optimizer steps per run")
    p.add_argument("--every", type=int, default=4, help="a checkpoint every this many steps")
    p.add_argument("example", nargs="*", help="flags for tandem.examples.gpt, after --")
    args = p.parse_args()
    results = run_distributed(_bench, args.nproc, args=(args,), timeout=60 + 60 * args.rounds)[0]
    print(f"GPT example, {args.nproc} rank(s), {results[0]['format']} checkpoints, {args.steps} steps, "
          f"a save every {args.every}, {args.rounds} rounds; rank 0; ms: median of the rounds' medians "
          "(min..max)")
    print("| mode | step ms | step after save ms | blocked per save ms | blocked / step | "
          "longest block ms | wait at the end ms |")
    print("|---|---|---|---|---|---|---|")
    for mode in MODES:
        rows = [r for r in results if r["mode"] == mode]
        ratios = [r["blocked"] / r["step"] for r in rows]
        print(f"| {mode} | {_summary([r['step'] for r in rows])} | {_summary([r['after'] for r in rows])} | "
              f"{_summary([r['blocked'] for r in rows])} | {_summary(ratios, 100)} % | "
              f"{_summary([r['blocked_max'] for r in rows])} | {_summary([r['end_wait'] for r in rows])} |")


if __name__ == "__main__":
    main()
