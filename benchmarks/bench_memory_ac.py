"""Peak bytes per rank: activation checkpointing, and meta-device init against eager init.

Run book::

    python benchmarks/bench_memory_ac.py                          # 2 ranks, the defaults (under a minute)
    python benchmarks/bench_memory_ac.py --dim 256 --depth 8 --seq 256

Launches its own ranks (tandem.testing.run_distributed: gloo, one thread per
rank). A GPT (tandem.testing.models.GPT: embedding, ``depth`` blocks of causal
attention and a 4x MLP, head), float32, on CPU. Peaks are measured with
tandem.testing.memory.PeakMemory: the profiler's allocation events of the CPU
allocator, the most bytes held at once beyond what existed before.

- step: one training step (forward, cross-entropy, backward, SGD step) after a
  warm-up step, on a model already built and sharded: the peak is activations,
  gradients and gathered units; rank 0's number. Contenders: tandem's
  fully_shard (per block and root, min_unit_bytes=0) and torch's FSDP2, tandem's
  DDP; each without checkpointing and with ``checkpoint_wrapper`` on each block
  (before sharding, as torchtitan). The plan's prediction of the activations
  (``tandem plan --activation-checkpointing``) is printed beside.
- init: building the model until it has its values: eagerly (``GPT()``,
  ``init_weights()``), and by the meta-device recipe (meta build,
  fully_shard, ``to_empty``, ``init_weights()`` under ``init_like_unsharded``).
"""

from __future__ import annotations

import argparse
import functools
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import tandem
from tandem.fsdp import fully_shard, init_like_unsharded
from tandem.testing import run_distributed
from tandem.testing.memory import PeakMemory
from tandem.testing.models import GPT
from tandem.tools.plan import measure


def _model(args: Any, ac: bool) -> GPT:
    torch.manual_seed(0)
    model = GPT(args.vocab, args.dim, args.depth, heads=args.heads)
    if ac:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    return model


def _batch(args: Any, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return (torch.randint(0, args.vocab, (args.batch, args.seq), generator=g),
            torch.randint(0, args.vocab, (args.batch, args.seq), generator=g))


def _step_peak(rank: int, world_size: int, args: Any, impl: str, ac: bool) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = _model(args, ac)
    run: nn.Module = model
    if impl == "ddp":
        run = tandem.DistributedDataParallel(model)
    else:
        mesh = init_device_mesh("cpu", (world_size,))
        shard: Any = (functools.partial(fully_shard, mesh=mesh, min_unit_bytes=0) if impl == "tandem-fsdp"
                      else functools.partial(torch_fully_shard, mesh=mesh))
        for block in model.blocks:
            shard(block)
        shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens, target = _batch(args, rank)

    def step() -> None:
        F.cross_entropy(run(tokens).flatten(0, 1), target.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with PeakMemory() as mem:
        step()
    return mem.peak


def _init_peak(rank: int, world_size: int, args: Any, meta: bool) -> int:
    with PeakMemory() as mem:
        if not meta:
            model = GPT(args.vocab, args.dim, args.depth, heads=args.heads)
            model.init_weights()
        else:
            with torch.device("meta"):
                model = GPT(args.vocab, args.dim, args.depth, heads=args.heads)
            for block in model.blocks:
                fully_shard(block, min_unit_bytes=0)
            fully_shard(model, min_unit_bytes=0)
            model.to_empty(device="cpu")
            with init_like_unsharded():
                model.init_weights()
    return mem.peak


def _ranks(rank: int, world_size: int, args: Any) -> dict[str, int]:
    warnings.simplefilter("ignore")
    out = {}
    for impl in ("tandem-fsdp", "torch-fsdp", "ddp"):
        for ac in (False, True):
            out[f"step {impl}{' +AC' if ac else ''}"] = _step_peak(rank, world_size, args, impl, ac)
    out["init eager"] = _init_peak(rank, world_size, args, meta=False)
    out["init meta + fully_shard"] = _init_peak(rank, world_size, args, meta=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args()
    results = run_distributed(_ranks, args.nproc, args=(args,), timeout=600)[0]
    model = _model(args, False)
    params = sum(t.numel() * t.element_size() for t in model.parameters())
    m = measure(model, _batch(args, 0), loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()),
                blocks=[f"blocks.{i}" for i in range(args.depth)])
    mib = 2**20
    print(f"GPT vocab {args.vocab} dim {args.dim} depth {args.depth}, batch {args.batch} x seq {args.seq} per "
          f"rank, {args.nproc} gloo ranks; model {params / mib:.2f} MiB")
    print(f"tandem plan: activations {m.activation_bytes / mib:.2f} MiB, with checkpointing "
          f"{m.checkpointed_bytes / mib:.2f} MiB")
    print("peak bytes held by rank 0 (MiB):")
    for name, peak in results.items():
        print(f"  {name:<28} {peak / mib:8.2f}")


if __name__ == "__main__":
    main()
