"""Step time of tandem.DistributedDataParallel against torch's, on 2 gloo ranks.

Run book::

    python benchmarks/bench_ddp.py                                   # all models, defaults
    python benchmarks/bench_ddp.py --models many --steps 20 --repeats 8
    python benchmarks/bench_ddp.py --ddp-kwargs gradient_as_bucket_view=True
    python benchmarks/bench_ddp.py --models many --profile 30        # + cProfile of rank 0

The script launches its own 2 ranks (tandem.testing.run_distributed: forkserver
children, a gloo group, one intra-op thread per rank) and prints two Markdown
tables from rank 0's clocks: wall-clock time per step, and the main thread's CPU
time per step (time.thread_time), which shows what each wrapper costs the
training thread even when other processes share the machine.

For each model, both wrappers are built once, on separate copies of the same
model, with the same keyword arguments. After ``--warmup`` steps of each, the
script runs ``--repeats`` rounds; a round is one block of ``--steps`` steps per
contender, the blocks in rotating order, each block started on a barrier:

* ``torch``   torch.nn.parallel.DistributedDataParallel
* ``tandem``  tandem.DistributedDataParallel
* ``compute`` the plain module: the same step with no DDP and no communication
* ``comm``    one dist.all_reduce of a flat fp32 tensor as large as all gradients

A step is ``zero_grad(set_to_none=True)``, forward, MSE loss, backward, SGD step,
timed with time.perf_counter (and time.thread_time). Alternating blocks in one run spreads drift of the
machine (other processes, frequency, caches) over all contenders alike.

Wall-clock columns: median step time over all measured steps; in brackets the first and
third quartiles of the per-block medians (the spread across rounds); tandem/torch
is the ratio of the medians, with the quartiles of the per-round ratios (tandem's
block over torch's block of the same round) in brackets;
overlap = (compute + comm - step) / min(compute, comm): 1 means the reduction is
completely hidden behind backward, 0 means none of it is, negative means the
wrapper costs more than compute and communication one after the other.
CPU columns: median main-thread CPU per step; overhead = DDP minus compute.
"""

from __future__ import annotations

import argparse
import ast
import copy
import cProfile
import io
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tandem
from tandem.testing import run_distributed

MODELS = ("mlp", "transformer", "many")
CONTENDERS = ("torch", "tandem", "compute", "comm")


# ---------------------------------------------------------------------- models
class ResidualStack(nn.Module):
    """Hundreds of small parameters: ``depth`` residual Linear(width, width) layers.

    The residual keeps activations and gradients out of the denormal range, which
    would otherwise make the step time depend on the numbers rather than the code.
    """

    def __init__(self, depth: int = 200, width: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + 0.1 * torch.tanh(layer(x))
        return x


@dataclass(frozen=True)
class Workload:
    model: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor


def build_workload(name: str, rank: int) -> Workload:
    """The model (identical on every rank) and this rank's batch."""
    torch.manual_seed(0)
    if name == "mlp":
        width, batch = 1600, 16
        model: nn.Module = nn.Sequential(
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
        in_shape, out_shape = (batch, width), (batch, width)
    elif name == "transformer":
        d_model, batch, seq = 384, 4, 16
        layer = nn.TransformerEncoderLayer(d_model, nhead=6, dim_feedforward=4 * d_model,
                                           dropout=0.0, batch_first=True)
        model = nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False)
        in_shape = out_shape = (batch, seq, d_model)
    elif name == "many":
        width, batch = 32, 32
        model = ResidualStack(depth=200, width=width)
        in_shape = out_shape = (batch, width)
    else:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    gen = torch.Generator().manual_seed(1000 + rank)
    return Workload(model, torch.randn(in_shape, generator=gen), torch.randn(out_shape, generator=gen))


# ---------------------------------------------------------------------- steps
def make_train_step(model: nn.Module, work: Workload) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(work.inputs), work.targets)
        loss.backward()
        opt.step()

    return step


def make_comm_step(numel: int) -> Callable[[], None]:
    flat = torch.zeros(numel)

    def step() -> None:
        dist.all_reduce(flat)

    return step


def time_block(step: Callable[[], None], steps: int) -> tuple[list[float], list[float]]:
    """Wall-clock and main-thread CPU seconds of each of ``steps`` steps, all ranks
    starting together."""
    dist.barrier()
    wall, cpu = [], []
    for _ in range(steps):
        c0, t0 = time.thread_time(), time.perf_counter()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return wall, cpu


def profile_steps(step: Callable[[], None], steps: int, rank: int, top: int = 30) -> str:
    """cProfile ``steps`` steps on rank 0 (every rank runs them: they communicate)."""
    dist.barrier()
    prof = cProfile.Profile()
    if rank == 0:
        prof.enable()
    for _ in range(steps):
        step()
    if rank != 0:
        return ""
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    return f"{steps} steps, per-step cost = tottime / {steps}\n" + out.getvalue()


# ---------------------------------------------------------------------- one rank
@dataclass(frozen=True)
class BenchConfig:
    models: tuple[str, ...]
    steps: int
    warmup: int
    repeats: int
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    profile: int = 0


def bench_rank(rank: int, world_size: int, cfg: BenchConfig) -> list[dict[str, Any]]:
    """Runs on each rank (module-level, for the harness); returns one record per model."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    return [bench_model(name, rank, cfg) for name in cfg.models]


def bench_model(name: str, rank: int, cfg: BenchConfig) -> dict[str, Any]:
    work = build_workload(name, rank)
    params = [p for p in work.model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    torch_ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(work.model), **cfg.ddp_kwargs)
    tandem_ddp = tandem.DistributedDataParallel(copy.deepcopy(work.model), **cfg.ddp_kwargs)
    steps = {
        "torch": make_train_step(torch_ddp, work),
        "tandem": make_train_step(tandem_ddp, work),
        "compute": make_train_step(copy.deepcopy(work.model), work),
        "comm": make_comm_step(numel),
    }
    for c in CONTENDERS:
        time_block(steps[c], cfg.warmup)

    blocks: dict[str, list[list[float]]] = {c: [] for c in CONTENDERS}
    cpu: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    for r in range(cfg.repeats):
        shift = r % len(CONTENDERS)
        for c in CONTENDERS[shift:] + CONTENDERS[:shift]:
            wall, block_cpu = time_block(steps[c], cfg.steps)
            blocks[c].append(wall)
            cpu[c] += block_cpu

    record: dict[str, Any] = {"model": name, "numel": numel, "tensors": len(params),
                              "blocks": blocks, "cpu": cpu}
    if cfg.profile:
        record["profile"] = {c: profile_steps(steps[c], cfg.profile, rank)
                             for c in ("torch", "tandem")}
    return record


# ---------------------------------------------------------------------- report
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}" if seconds >= 0.01 else f"{seconds * 1e3:.2f}"


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def summarise(record: dict[str, Any]) -> dict[str, Any]:
    blocks = record["blocks"]
    med = {c: statistics.median(t for b in blocks[c] for t in b) for c in CONTENDERS}
    block_med = {c: [statistics.median(b) for b in blocks[c]] for c in CONTENDERS}
    round_ratio = [a / b for a, b in zip(block_med["tandem"], block_med["torch"])]
    compute, comm = med["compute"], med["comm"]

    def overlap(step: float) -> float:
        return (compute + comm - step) / min(compute, comm)

    return {"model": record["model"], "numel": record["numel"], "tensors": record["tensors"],
            "median": med, "block_iqr": {c: _quartiles(v) for c, v in block_med.items()},
            "ratio": med["tandem"] / med["torch"], "ratio_iqr": _quartiles(round_ratio),
            "overlap": {c: overlap(med[c]) for c in ("torch", "tandem")},
            "cpu": {c: statistics.median(record["cpu"][c]) for c in CONTENDERS}}


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(row: dict[str, Any], c: str) -> str:
        q1, q3 = row["block_iqr"][c]
        return f"{_ms(row['median'][c])} [{_ms(q1)}–{_ms(q3)}]"

    lines = [
        "| model | params (tensors) | torch DDP step ms | tandem DDP step ms | tandem/torch "
        "| compute ms | comm ms | overlap torch | overlap tandem |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} | {row['numel'] / 1e6:.2f}M ({row['tensors']}) "
            f"| {cell(row, 'torch')} | {cell(row, 'tandem')} "
            f"| **{row['ratio']:.3f}** [{row['ratio_iqr'][0]:.2f}–{row['ratio_iqr'][1]:.2f}] "
            f"| {cell(row, 'compute')} | {cell(row, 'comm')} "
            f"| {row['overlap']['torch']:.2f} | {row['overlap']['tandem']:.2f} |")
    return "\n".join(lines)


def format_cpu_table(rows: list[dict[str, Any]]) -> str:
    """Main-thread CPU per step: what each wrapper costs the training thread itself,
    whatever else the machine is running (waiting for a reduction costs none)."""
    lines = [
        "| model | torch DDP CPU ms | tandem DDP CPU ms | compute CPU ms "
        "| torch overhead ms | tandem overhead ms | tandem/torch CPU |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        t, d, c = (row["cpu"][k] for k in ("torch", "tandem", "compute"))
        lines.append(f"| {row['model']} | {_ms(t)} | {_ms(d)} | {_ms(c)} | {_ms(t - c)} "
                     f"| {_ms(d - c)} | {d / t:.3f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- command line
def parse_ddp_kwargs(text: str) -> dict[str, Any]:
    """``"a=True,b=10"`` -> ``{"a": True, "b": 10}`` (values are Python literals)."""
    kwargs: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected key=value, got {item!r}")
        try:
            kwargs[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise argparse.ArgumentTypeError(
                f"value of {key.strip()!r} is not a Python literal: {value!r}") from None
    return kwargs


def parse_models(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {unknown or text!r}; choose from {','.join(MODELS)}")
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per block (default 5)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="unmeasured steps per contender before the rounds (default 3)")
    parser.add_argument("--repeats", type=int, default=16,
                        help="rounds of one block per contender (default 16)")
    parser.add_argument("--models", type=parse_models, default=MODELS,
                        help=f"comma-separated, from {','.join(MODELS)} (default all)")
    parser.add_argument("--ddp-kwargs", type=parse_ddp_kwargs, default={},
                        help="keyword arguments for both wrappers, e.g. "
                             "gradient_as_bucket_view=True,bucket_cap_mb=10")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after measuring, cProfile N steps of each DDP on rank 0")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--steps and --repeats must be >= 1, --warmup >= 0")

    cfg = BenchConfig(models=args.models, steps=args.steps, warmup=args.warmup,
                      repeats=args.repeats, ddp_kwargs=args.ddp_kwargs, profile=args.profile)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    records = run_distributed(bench_rank, world_size=2, args=(cfg,), timeout=3600)[0]
    elapsed = time.perf_counter() - started

    print(f"torch {torch.__version__}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, 2 gloo ranks x 1 intra-op thread; "
          f"ddp kwargs {cfg.ddp_kwargs or '(defaults)'}; "
          f"{cfg.repeats} rounds x {cfg.steps} steps per contender after {cfg.warmup} warm-up; "
          f"ran {elapsed:.0f} s; 1-min load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after\n")
    rows = [summarise(r) for r in records]
    print("Wall-clock time per step, rank 0 (median [quartiles of the per-block medians])\n")
    print(format_table(rows))
    print("\nMain-thread CPU time per step, rank 0 (median)\n")
    print(format_cpu_table(rows))
    for r in records:
        for contender, text in r.get("profile", {}).items():
            print(f"\n## cProfile, {r['model']}, {contender} (rank 0)\n\n{text}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
