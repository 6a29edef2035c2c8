"""Train a small MLP on a synthetic regression task with tandem's DistributedDataParallel.

Run it as one process (a world of one: the same code, collectives included)::

    python -m tandem.examples.ddp_regression

or as two processes on this machine (any number works; the data is split by rank)::

    torchrun --standalone --nproc-per-node 2 -m tandem.examples.ddp_regression

Options: ``--steps 400 --lr 3e-3 --batch-size 64 --log-every 50 --seed 0``.
``--batch-size`` is per rank, so the global batch grows with the number of
processes, as with torch's DDP.

What to expect, in about 5 s on two CPU cores (most of it starting Python and
torch): the training loss, averaged over ranks, falls from about 0.7 to about
0.02 within a few hundred steps, and the final evaluation reports a mean squared
error of about 0.02 (the noise alone gives 0.01) and an R^2 of about 0.97. The
run is deterministic: the same command on the same machine prints the same
losses.

The task: inputs are 8 standard normal features; the target is
``sin(2 u.x) + 0.5 (v.x)(w.x)`` plus Gaussian noise of standard deviation 0.1,
for three fixed orthonormal directions u, v, w. Every rank generates the same
data from the seed and keeps every world_size-th sample.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import tandem

NUM_FEATURES = 8
NOISE_STD = 0.1
NUM_TRAIN = 16384
NUM_EVAL = 4096


def make_dataset(num_samples: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs of shape (num_samples, NUM_FEATURES) and targets of shape (num_samples, 1)."""
    x = torch.randn(num_samples, NUM_FEATURES, generator=generator)
    # Three orthonormal directions, drawn from a generator of their own so that the
    # task is the same for the training and the evaluation set.
    directions, _ = torch.linalg.qr(torch.randn(NUM_FEATURES, 3,
                                                generator=torch.Generator().manual_seed(1234)))
    p = x @ directions
    y = torch.sin(2 * p[:, 0]) + 0.5 * p[:, 1] * p[:, 2]
    y = y + NOISE_STD * torch.randn(num_samples, generator=generator)
    return x, y.unsqueeze(1)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Mean squared error and R^2 over the union of every rank's (x, y).

    Each rank sums its own squared errors; one all-reduce adds up the sums, so the
    result is the same on every rank and does not depend on how the data was split.
    """
    model.eval()
    pred = model(x)
    sums = torch.tensor([((pred - y) ** 2).sum().item(), y.sum().item(), (y ** 2).sum().item(),
                         float(len(y))], dtype=torch.float64, device=y.device)
    dist.all_reduce(sums)
    model.train()
    sq_err, y_sum, y_sq, n = sums.tolist()
    mse = sq_err / n
    variance = y_sq / n - (y_sum / n) ** 2
    return mse, 1.0 - mse / variance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--log-every", type=int, default=50, help="print the loss every N steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if min(args.steps, args.batch_size, args.log_every) < 1:
        parser.error("--steps, --batch-size and --log-every must be at least 1")

    # -------------------------------------------------------------- the job
    world = tandem.init()  # torchrun's variables, or a world of one
    master = world.rank == 0  # rank 0 prints; every rank trains
    # Share the cores between the processes on this node instead of oversubscribing
    # them (a script may change torch's global settings; the library never does).
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // world.local_world_size))
    logging.basicConfig(level=logging.INFO if master else logging.WARNING,
                        format="%(name)s: %(message)s")
    if master:
        print(f"world of {world.world_size} on {world.device} ({world.backend}), "
              f"{torch.get_num_threads()} threads per process, "
              f"global batch {args.batch_size * world.world_size}")

    # -------------------------------------------------------------- data
    # Every rank builds the same data and keeps its own shard: every world_size-th sample.
    gen = torch.Generator().manual_seed(args.seed)
    x_train, y_train = make_dataset(NUM_TRAIN, gen)
    x_eval, y_eval = make_dataset(NUM_EVAL, gen)
    x_train, y_train = x_train[world.rank::world.world_size], y_train[world.rank::world.world_size]
    x_eval, y_eval = x_eval[world.rank::world.world_size], y_eval[world.rank::world.world_size]
    x_train, y_train = x_train.to(world.device), y_train.to(world.device)
    x_eval, y_eval = x_eval.to(world.device), y_eval.to(world.device)
    # Batches are drawn from the local shard with a per-rank generator: ranks see
    # different samples, which is the point of data parallelism.
    batch_gen = torch.Generator().manual_seed(args.seed + 1000 * (world.rank + 1))

    # -------------------------------------------------------------- model
    # The same seed on every rank; DDP would broadcast rank 0's weights anyway, and
    # checks first that every rank built the same model.
    torch.manual_seed(args.seed)
    model: nn.Module = nn.Sequential(
        nn.Linear(NUM_FEATURES, 128), nn.GELU(),
        nn.Linear(128, 128), nn.GELU(),
        nn.Linear(128, 1),
    ).to(world.device)
    model = tandem.DistributedDataParallel(model)  # the one line that makes it data-parallel
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    # -------------------------------------------------------------- training
    t0 = time.perf_counter()
    t_log, step_log = t0, 0
    for step in range(1, args.steps + 1):
        idx = torch.randint(len(x_train), (args.batch_size,), generator=batch_gen)
        loss = nn.functional.mse_loss(model(x_train[idx]), y_train[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # gradients are averaged across ranks during backward
        optimizer.step()

        if step == 1 or step % args.log_every == 0 or step == args.steps:
            # Average the loss over ranks for the log (one extra all-reduce per log line).
            logged = loss.detach().clone()
            dist.all_reduce(logged)
            logged /= world.world_size
            if master:
                now = time.perf_counter()
                ms = 1000 * (now - t_log) / (step - step_log)
                print(f"step {step:5d}  loss {logged.item():.4f}  {ms:.2f} ms/step")
                t_log, step_log = now, step
    train_s = time.perf_counter() - t0

    # -------------------------------------------------------------- evaluation
    mse, r2 = evaluate(model, x_eval, y_eval)
    if master:
        print(f"eval: mse {mse:.4f} (noise floor {NOISE_STD ** 2:.4f}), r2 {r2:.4f}, "
              f"on {NUM_EVAL} samples over {world.world_size} rank(s); "
              f"{args.steps} steps in {train_s:.1f} s")

    tandem.shutdown()


if __name__ == "__main__":
    main()
