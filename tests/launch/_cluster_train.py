"""A training job for the namespace cluster's tests (tests/launch/test_cluster_train.py):
each strategy named on the command line trains the same model for STEPS
steps, each rank on its slice of the global batch, and rank 0 saves the
final parameters to OUT/<strategy>.pt for the test to compare with one
process on the whole batch (:func:`reference`).

    tandem run ... _cluster_train.py OUT ddp,zero2,fully_shard,hsdp
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

STEPS = 4
GLOBAL_BATCH = 12  # every world of 1 to 4 divides it
LR = 1e-2


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``, the same in every process."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def reference() -> dict[str, torch.Tensor]:
    """One process, the whole global batch, plain torch."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(strategy: str, rank: int, world_size: int, local_world_size: int) -> dict[str, torch.Tensor]:
    import tandem
    from torch.distributed.tensor import DTensor

    model = make_model()
    wrapped: nn.Module
    if strategy == "ddp":
        wrapped = tandem.DistributedDataParallel(model)
        opt: torch.optim.Optimizer = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    elif strategy == "zero2":
        wrapped = tandem.DistributedDataParallel(model, zero_stage=2)
        opt = tandem.ZeroOptimizer(wrapped, torch.optim.AdamW, lr=LR)
    elif strategy in ("fully_shard", "hsdp"):
        mesh = None
        if strategy == "hsdp":  # shard within a node, replicate across nodes
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (world_size // local_world_size, local_world_size),
                                    mesh_dim_names=("replicate", "shard"))
        for layer in (model[0], model[2], model[4]):
            tandem.fully_shard(layer, mesh=mesh)
        wrapped = tandem.fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    else:
        raise SystemExit(f"unknown strategy {strategy!r}")
    per = GLOBAL_BATCH // world_size
    for step in range(STEPS):
        x, y = batch(step)
        mine = slice(rank * per, (rank + 1) * per)
        nn.functional.mse_loss(wrapped(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def main() -> None:
    import tandem

    out, strategies = Path(sys.argv[1]), sys.argv[2].split(",")
    world = tandem.init()
    assert GLOBAL_BATCH % world.world_size == 0, world.world_size
    for strategy in strategies:
        params = train(strategy, world.rank, world.world_size, world.local_world_size)
        if world.rank == 0:
            torch.save(params, out / f"{strategy}.pt")
        print(f"TRAINED {strategy} rank={world.rank} size={world.world_size} node={os.environ['GROUP_RANK']}",
              flush=True)
    tandem.shutdown()


if __name__ == "__main__":
    main()
