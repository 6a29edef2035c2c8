"""What one lost worker costs: shrink-and-continue (``tandem run --elastic``) against a
restart of the group from its last checkpoint (``tandem run --max-restarts 1``).

Run book::

    python benchmarks/bench_elastic.py                      # 3 workers, 3 rounds (a few minutes)
    python benchmarks/bench_elastic.py --rounds 5 --steps 160 --kill-at 70 --checkpoint-every 25

The same job runs in both ways, alternating, ``--rounds`` times each: a Trainer
on 3 workers (an MLP of about 0.6 M parameters, batch 32 per worker, SGD),
checkpointing every ``--checkpoint-every`` steps, with worker 1 SIGKILLed inside
step ``--kill-at`` of the first attempt. A run without a kill is timed too, as
the baseline. Per run:

- wall: the launcher's wall-clock time, start to exit;
- lost: wall minus the baseline's median, the time the failure cost;
- steps lost: the step in flight when the worker died (never recorded), plus
  the steps done twice (from the step records rank 0 prints: a step number
  printed twice was trained twice, once before the failure and once after the
  restart from the checkpoint).

"elastic" keeps going on 2 workers (no replacement), so it trains the rest of
the epoch in more, smaller steps; "elastic+replacement" (``--max-restarts 1``
with ``--elastic``) grows back to 3 when the replacement has started. For the
elastic runs, the Trainer's own report gives the time from the start of the
failed step to the failure being seen, and the regroup.
Medians and min..max are printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

JOB = """
    import os, signal
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import tandem

    tandem.init()
    steps, kill_at = int(os.environ["STEPS"]), int(os.environ["KILL_AT"])
    g = torch.Generator().manual_seed(0)
    n = steps * 32 * 3
    data = TensorDataset(torch.randn(n, 256, generator=g), torch.randn(n, 16, generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(),
                          nn.Linear(256, 16))
    trainer = None

    def loss_fn(out, y):
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if (kill_at >= 0 and first and os.environ["RANK"] == "1" and trainer.state.step == kill_at
                and os.environ.get("TANDEM_ELASTIC_JOIN") != "1"):
            os.kill(os.getpid(), signal.SIGKILL)
        return ((out - y) ** 2).mean()

    config = tandem.TrainerConfig(batch_size=32, epochs=1, progress=False, plot=False, log_every=1,
                                  checkpoint_every=int(os.environ["EVERY"]), shuffle=False,
                                  output_dir=os.environ["OUT"])
    trainer = tandem.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), data, loss_fn,
                             config=config)
    trainer.fit()
    tandem.shutdown()
"""


def run(mode: str, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    out = workdir / f"out-{mode}-{time.monotonic_ns()}"
    script = workdir / "job.py"
    flags = {"baseline": [], "restart": ["--max-restarts", "1"], "elastic": ["--elastic"],
             "elastic+replacement": ["--elastic", "--max-restarts", "1"]}[mode]
    env = dict(os.environ, STEPS=str(args.steps), KILL_AT=str(-1 if mode == "baseline" else args.kill_at),
               EVERY=str(args.checkpoint_every), OUT=str(out))
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "tandem", "run", "--nproc-per-node", "3", *flags, str(script)],
                       env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"{mode} run failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    seen: dict[int, int] = {}
    noticed = regrouped = 0.0
    for line in r.stdout.splitlines():
        if line.startswith("[rank 0] elastic: lost"):
            noticed = float(line.split("failure seen after ")[1].split(" s")[0])
            regrouped = float(line.split("regroup took ")[1].split(" s")[0])
        if line.startswith("[rank 0]") and "  step " in line:
            step = int(line.split("  step ")[1].split()[0])
            seen[step] = seen.get(step, 0) + 1
    redone = sum(count - 1 for count in seen.values())
    return {"wall": wall, "lost_steps": redone + (0 if mode == "baseline" else 1),
            "noticed": noticed, "regrouped": regrouped}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=120, help="steps of the job at 3 workers")
    p.add_argument("--kill-at", type=int, default=55)
    p.add_argument("--checkpoint-every", type=int, default=25)
    args = p.parse_args(argv)
    modes = ("baseline", "restart", "elastic", "elastic+replacement")
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "job.py").write_text(textwrap.dedent(JOB))
        for i in range(args.rounds):
            for mode in (modes if i % 2 == 0 else modes[::-1]):
                results[mode].append(run(mode, args, workdir))
                print(f"round {i} {mode}: {results[mode][-1]}", flush=True)
    base = statistics.median(r["wall"] for r in results["baseline"])
    print(f"\n{args.steps} steps at 3 workers, worker 1 killed in step {args.kill_at}, "
          f"checkpoint every {args.checkpoint_every}; {args.rounds} rounds\n")
    print("| run | wall s, median (min..max) | lost s, median | steps lost | failure seen after s | regroup s |")
    print("|---|---|---|---|---|---|")
    for mode, rows in results.items():
        walls = [r["wall"] for r in rows]
        redone = sorted({int(r["lost_steps"]) for r in rows})
        elastic = mode.startswith("elastic")
        seen = f"{statistics.median(r['noticed'] for r in rows):.2f}" if elastic else "-"
        regroup = f"{statistics.median(r['regrouped'] for r in rows):.2f}" if elastic else "-"
        print(f"| {mode} | {statistics.median(walls):.1f} ({min(walls):.1f}..{max(walls):.1f}) | "
              f"{statistics.median(walls) - base:+.1f} | {', '.join(map(str, redone))} | {seen} | {regroup} |")


if __name__ == "__main__":
    main()
