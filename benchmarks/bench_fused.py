"""The optimizer step fused into backward (``ddp.fuse_optimizer``) against the
unfused ``optimizer.step()`` after backward: step time and memory, on gloo.

Run book::

    python benchmarks/bench_fused.py                          # 2 ranks, AdamW, the defaults
    python benchmarks/bench_fused.py --optimizer sgd --rounds 12

Launches its own ranks (tandem.testing.run_distributed: gloo, one intra-op
thread per rank). Contenders, all on copies of the same MLP and batches:

    unfused      tandem.DistributedDataParallel, optimizer.step() after backward
    fused        the same, with ddp.fuse_optimizer(optimizer)
    zero2        tandem DDP(zero_stage=2) + tandem.ZeroOptimizer, step after backward
    zero2-fused  the same, fused: each bucket's shard steps when its reduce-scatter lands
    torch-ddp    torch's DistributedDataParallel, optimizer.step() after backward

A step is zero_grad(set_to_none=True), forward, MSE loss, backward, step (a
no-op when fused). Steps run in interleaved rounds (every contender once per
round, in rotating order, each block started on a barrier); the table gives
the median step over rounds on rank 0's clock, with the quartiles of the
per-round medians, and the ratio to ``unfused`` with the quartiles of the
per-round ratios.

Memory, rank 0, per contender:

* held between steps: the distinct storages of ``param.grad`` plus tandem's
  reducer buffers (flat bucket buffer unless released, gradient shards);
  torch's DDP keeps its bucket buffers in C++, not counted.
* peak in a step: the same count, taken at every gradient hook of one more
  step (after the DDP's own hook on that parameter) and after the step: the
  most gradient memory the step holds at once.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem
from tandem.testing import run_distributed

CONTENDERS = ("unfused", "fused", "zero2", "zero2-fused", "torch-ddp")
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-4, "weight_decay": 0.01}),
    "sgd": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}),
}


def build(args: argparse.Namespace, rank: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    gen = torch.Generator().manual_seed(1000 + rank)
    return (nn.Sequential(*layers[:-1]), torch.randn(args.batch, args.width, generator=gen),
            torch.randn(args.batch, args.width, generator=gen))


def contender(name: str, args: argparse.Namespace, rank: int
              ) -> tuple[Callable[[], None], Callable[[], int], list[nn.Parameter]]:
    model, x, y = build(args, rank)
    cls, kwargs = OPTIMIZERS[args.optimizer]
    ddp: nn.Module
    opt: Any
    if name == "torch-ddp":
        ddp = TorchDDP(model)
        opt = cls(model.parameters(), **kwargs)
    elif name.startswith("zero2"):
        ddp = tandem.DistributedDataParallel(model, zero_stage=2)
        opt = tandem.ZeroOptimizer(ddp, cls, **kwargs)
    else:
        ddp = tandem.DistributedDataParallel(model)
        opt = cls(model.parameters(), **kwargs)
    if name.endswith("fused") and name != "unfused":
        ddp.fuse_optimizer(opt)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(ddp(x), y).backward()
        opt.step()

    def held() -> int:
        storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                    for p in model.parameters() if p.grad is not None}
        total = sum(storages.values())
        reducer = ddp.reducer if isinstance(ddp, tandem.DistributedDataParallel) else None
        if reducer is not None:
            total += reducer.buffer.held_bytes  # (no param.grad is a view here: no overlap)
            total += sum(g.nbytes for g in reducer.grad_shards)
        return total

    return step, held, list(model.parameters())


def peak_in_step(step: Callable[[], None], held: Callable[[], int], params: list[nn.Parameter]) -> int:
    """The most gradient bytes held at any gradient hook of one step, or after it
    (hooks registered after the DDP's run after its own, on each parameter)."""
    peak = [held()]

    def hook(_: torch.Tensor) -> None:
        peak[0] = max(peak[0], held())

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    step()
    peak[0] = max(peak[0], held())
    for h in handles:
        h.remove()
    return peak[0]


def bench_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.distributed.barrier()
    runs = {name: contender(name, args, rank) for name in CONTENDERS}
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for step, _, _ in runs.values():
        for _ in range(args.warmup):
            step()
    names = list(CONTENDERS)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            step = runs[name][0]
            torch.distributed.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - start) / args.steps)
    peaks = {}
    for name, (step, held, params) in runs.items():
        torch.distributed.barrier()
        peaks[name] = peak_in_step(step, held, params)
    return {"times": times, "held": {name: h() for name, (_, h, _) in runs.items()}, "peak": peaks}


def _quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def format_table(result: dict[str, Any]) -> str:
    times = result["times"]
    base = times["unfused"]
    rows = ["| contender | step ms [quartiles] | vs unfused [quartiles of per-round ratios] "
            "| gradients held between steps | gradients held at the peak of a step |",
            "|---|---|---|---:|---:|"]
    for name in CONTENDERS:
        t = times[name]
        lo, hi = _quartiles([v * 1e3 for v in t])
        ratios = [a / b for a, b in zip(t, base)]
        rlo, rhi = _quartiles(ratios)
        rows.append(f"| {name} | {statistics.median(t) * 1e3:.1f} [{lo:.1f}–{hi:.1f}] | "
                    f"{statistics.median(t) / statistics.median(base):.3f} [{rlo:.2f}–{rhi:.2f}] | "
                    f"{_mib(result['held'][name])} | {_mib(result['peak'][name])} |")
    return "\n".join(rows)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    results = run_distributed(bench_rank, args.world_size, args=(args,), timeout=3600)
    params = args.depth * (args.width * args.width + args.width)
    print(f"torch {torch.__version__}, {args.world_size} ranks (gloo, 1 thread each), "
          f"MLP {args.depth} x Linear({args.width}, {args.width}) ({params / 1e6:.2f}M params), "
          f"batch {args.batch} per rank, {args.optimizer}, {args.rounds} rounds x {args.steps} steps")
    print(format_table(results[0]))


if __name__ == "__main__":
    main()
