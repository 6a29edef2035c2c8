"""What ZeRO costs and saves on gloo: step time and the bytes each rank holds.

Run book::

    python benchmarks/bench_zero.py                      # 2 ranks, the defaults
    python benchmarks/bench_zero.py --width 1600 --rounds 8

Launches its own ranks (tandem.testing.run_distributed: gloo, one intra-op
thread per rank). Contenders, all with Adam on the same MLP and batches:

    ddp          tandem.DistributedDataParallel + torch.optim.Adam
    torch-ddp    torch's DistributedDataParallel + torch.optim.Adam
    zero1        tandem DDP(zero_stage=1) + tandem.ZeroOptimizer(Adam)
    zero2        tandem DDP(zero_stage=2) + tandem.ZeroOptimizer(Adam)
    torch-zero   torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer(Adam)

A step is zero_grad, forward, MSE loss, backward, optimizer step. Steps run in
interleaved rounds (every contender once per round, so that a noisy neighbour
hits all alike); the table gives the median step over rounds, rank 0's clock.

Bytes are counted from the tensors each rank holds after a step, not computed:
optimizer state = every tensor in the (wrapped) optimizer's state; gradients =
the distinct storages of ``param.grad`` plus tandem's reducer buffers (the flat
bucket buffer unless released, and the gradient shards). torch's DDP keeps its
own bucket buffers inside C++, which are not counted.
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
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem
from tandem.testing import run_distributed

CONTENDERS = ("ddp", "zero1", "zero2", "torch-ddp", "torch-zero")


def build(width: int, depth: int, batch: int, rank: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    gen = torch.Generator().manual_seed(1000 + rank)
    return (nn.Sequential(*layers[:-1]), torch.randn(batch, width, generator=gen),
            torch.randn(batch, width, generator=gen))


def contender(name: str, args: argparse.Namespace, rank: int) -> tuple[Callable[[], None], Callable[[], dict]]:
    model, x, y = build(args.width, args.depth, args.batch, rank)
    if name == "torch-zero":
        ddp: nn.Module = TorchDDP(model)
        opt: Any = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
        state = lambda: opt.optim.state  # noqa: E731
    elif name in ("ddp", "torch-ddp"):
        ddp = tandem.DistributedDataParallel(model) if name == "ddp" else TorchDDP(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        state = lambda: opt.state  # noqa: E731
    else:
        ddp = tandem.DistributedDataParallel(model, zero_stage=int(name[-1]))
        opt = tandem.ZeroOptimizer(ddp, torch.optim.Adam, lr=1e-4)
        state = lambda: opt.optim.state  # noqa: E731

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(ddp(x), y).backward()
        opt.step()

    def holdings() -> dict:
        opt_bytes = sum(t.nbytes for s in state().values() for t in s.values() if torch.is_tensor(t))
        storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                    for p in model.parameters() if p.grad is not None}
        grad_bytes = sum(storages.values())
        reducer = ddp.reducer if isinstance(ddp, tandem.DistributedDataParallel) else None
        if reducer is not None:
            grad_bytes += reducer.buffer.held_bytes
            grad_bytes += sum(g.nbytes for g in reducer.grad_shards)
        params = sum(p.nbytes for p in model.parameters())
        return {"params": params, "grads": grad_bytes, "optimizer": opt_bytes}

    return step, holdings


def bench_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.distributed.barrier()
    runs = {name: contender(name, args, rank) for name in CONTENDERS}
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for step, _ in runs.values():
        for _ in range(args.warmup):
            step()
    for _ in range(args.rounds):
        for name, (step, _) in runs.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - start) / args.steps)
    return {"times": times, "bytes": {name: h() for name, (_, h) in runs.items()}}


def format_table(result: dict[str, Any], world_size: int) -> str:
    times, held = result["times"], result["bytes"]
    base = statistics.median(times["ddp"])
    rows = ["| contender | step (ms) | vs ddp | optimizer state (of ddp's) "
            "| gradients held (in gradient copies) | parameters |",
            "|---|---:|---:|---:|---:|---:|"]
    for name in CONTENDERS:
        t = statistics.median(times[name])
        b = held[name]
        rows.append(f"| {name} | {t * 1e3:.1f} | {t / base:.2f}x | {_mib(b['optimizer'])} "
                    f"({b['optimizer'] / max(held['ddp']['optimizer'], 1):.3f}) | "
                    f"{_mib(b['grads'])} ({b['grads'] / b['params']:.3f}) | "
                    f"{_mib(b['params'])} |")
    rows.append(f"\n1/N = {1 / world_size:.3f}; rank 0 shown")
    return "\n".join(rows)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    results = run_distributed(bench_rank, args.world_size, args=(args,), timeout=3600)
    print(f"torch {torch.__version__}, {args.world_size} ranks (gloo, 1 thread each), "
          f"MLP {args.depth} x Linear({args.width}, {args.width}), batch {args.batch} per rank, "
          f"{args.rounds} rounds x {args.steps} steps")
    print(format_table(results[0], args.world_size))


if __name__ == "__main__":
    main()
