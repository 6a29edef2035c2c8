"""A hybrid job over RPC: a dense part data-parallel across trainers, an embedding
table on a parameter server, trained with distributed autograd.

Run it as three processes on this machine (two trainers and the parameter server)::

    tandem run --nproc-per-node 3 -m tandem.examples.rpc_hybrid

(``torchrun --standalone --nproc-per-node 3 -m tandem.examples.rpc_hybrid`` works
the same.) Options: ``--steps 30 --batch-size 16 --lr 0.5 --seed 0 --ddp tandem``
(``--ddp torch`` runs the same job with torch's own DistributedDataParallel) and
``--optimizer distributed`` (``local``: see below). ``--batch-size`` is the global
batch, split over the trainers.

The layout is the one of torch's tutorial "Combining Distributed DataParallel with
Distributed RPC Framework"::

    rank 0, 1 (trainer0, trainer1)        rank 2 (ps, also the master)
    ------------------------------        -----------------------------
    DDP(Linear) over the trainers' group  EmbeddingBag (a RemoteModule)
    forward:  ids -> rpc -> ps ------------> bag embeddings -> back
              dense(embeddings) -> loss
    backward: dist_autograd.backward ------> embedding gradient (ps side)
              DDP averages the dense gradients over the trainers (gloo)
    step:     DistributedOptimizer(SGD) over the table's parameter RRefs
              (on the ps) and the dense parameters' RRefs (on each trainer)

Every rank joins RPC; only the trainers join a process group, and it is the
group DDP reduces over. The master drives: it creates the table on itself with
:class:`~torch.distributed.nn.RemoteModule`, then asks each trainer to train
(``rpc_async``) and collects what they return.

Under distributed autograd, gradients do not land in ``param.grad``: the engine
keeps them in the autograd context (``dist_autograd.get_gradients(context_id)``),
and ``DistributedOptimizer`` steps from there. DDP must therefore average the
context's gradients, not ``param.grad`` (torch's reducer does this in C++; see
Note [distributed autograd] in tandem/ddp/dist_autograd.py). ``--optimizer local``
steps the dense part with a plain ``torch.optim.SGD`` fed from the context, and
the table with a ``DistributedOptimizer`` over its RRefs alone.

Every trainer applies its own embedding gradient on the parameter server (the
table is not replicated, so there is nothing to average); the dense gradients
are averaged. One step of this job is therefore one step of single-process
training on the global batch with the table's learning rate multiplied by the
number of trainers. The parameter server applies the trainers' updates as they
come; here they take turns (trainer 0, then 1, with a barrier between), which
makes the run reproducible to the bit.

What to expect, in about 10 s on two CPU cores: the mean loss over the trainers
falls from about 2.04 to about 0.2 in 30 steps, the dense replicas are identical
on both trainers, and ``--ddp tandem`` and ``--ddp torch`` print the same losses
and checksums to the last digit. (torch prints a few warnings of its own while
RPC starts: TorchScript deprecation, and "You are using a Backend ... as a
ProcessGroup".)
"""

from __future__ import annotations

import argparse
import datetime
import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer

import tandem

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
HIDDEN = 32
NUM_CLASSES = 8
BAG_SIZE = 4          # ids per bag
PS_NAME = "ps"

DDPKind = Literal["tandem", "torch"]
OptimizerKind = Literal["distributed", "local"]


def trainer_name(index: int) -> str:
    return f"trainer{index}"


@dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """One training run of the hybrid job."""

    ddp: DDPKind = "tandem"
    """Whose DistributedDataParallel wraps the dense part: tandem's or torch's."""
    optimizer: OptimizerKind = "distributed"
    """"distributed": one DistributedOptimizer over every parameter's RRef.
    "local": torch.optim.SGD on the dense part, fed from the autograd context."""
    steps: int = 30
    """Optimizer steps."""
    batch_size: int = 16
    """Global batch (bags), split evenly over the trainers."""
    lr: float = 0.5
    """SGD learning rate."""
    seed: int = 0
    """Seeds the initial weights and the data."""
    gradient_as_bucket_view: bool = False
    """Passed to DistributedDataParallel."""
    bucket_cap_mb: float = 25.0
    """Passed to DistributedDataParallel (a tiny cap: a bucket per parameter)."""
    find_unused_parameters: bool = False
    """Passed to DistributedDataParallel."""
    static_graph: bool = False
    """Passed to DistributedDataParallel."""

    def __post_init__(self) -> None:
        if self.ddp not in ("tandem", "torch"):
            raise ValueError(f"HybridConfig.ddp must be 'tandem' or 'torch', got {self.ddp!r}")
        if self.optimizer not in ("distributed", "local"):
            raise ValueError(f"HybridConfig.optimizer must be 'distributed' or 'local', got {self.optimizer!r}")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"HybridConfig.steps and batch_size must be at least 1, got "
                             f"steps={self.steps}, batch_size={self.batch_size}")


@dataclass
class TrainerResult:
    """What one trainer saw: its losses, its final dense weights, and the dense
    gradients of its last step as DDP left them in the autograd context."""

    losses: list[float]
    dense: dict[str, torch.Tensor]
    dense_grads: dict[str, torch.Tensor]


@dataclass
class HybridResult:
    config: HybridConfig
    trainers: list[TrainerResult]
    embedding: torch.Tensor
    """The table's final weight, read on the parameter server."""


# ---------------------------------------------------------------------- data and model
def initial_table(seed: int) -> torch.Tensor:
    """The table's starting weight, the same wherever it is computed."""
    return torch.randn(NUM_EMBEDDINGS, EMBEDDING_DIM, generator=torch.Generator().manual_seed(seed)) * 0.3


def make_dense(seed: int) -> nn.Sequential:
    """The dense part, with the same starting weights wherever it is built."""
    first, last = nn.Linear(EMBEDDING_DIM, HIDDEN), nn.Linear(HIDDEN, NUM_CLASSES)
    dense = nn.Sequential(first, nn.ReLU(), last)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in (first, last):
            bound = layer.in_features ** -0.5
            for p in layer.parameters():
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
    return dense


def make_batches(config: HybridConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``config.steps`` global batches of (ids of shape (batch, BAG_SIZE), labels).
    Id ``i`` belongs to class ``i % NUM_CLASSES`` and a bag holds ids of its label's
    class: the table must learn which ids go together."""
    gen = torch.Generator().manual_seed(config.seed + 2)
    batches = []
    for _ in range(config.steps):
        labels = torch.randint(0, NUM_CLASSES, (config.batch_size,), generator=gen)
        rows = torch.randint(0, NUM_EMBEDDINGS // NUM_CLASSES, (config.batch_size, BAG_SIZE), generator=gen)
        batches.append((labels[:, None] + NUM_CLASSES * rows, labels))
    return batches


def shard(batch: tuple[torch.Tensor, torch.Tensor], index: int, count: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer ``index``'s contiguous share of a global batch."""
    ids, labels = batch
    per = ids.shape[0] // count
    return ids[index * per:(index + 1) * per], labels[index * per:(index + 1) * per]


class EmbeddingTable(nn.EmbeddingBag):
    """The parameter server's table: bags of ids summed, starting from ``weight``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(NUM_EMBEDDINGS, EMBEDDING_DIM, mode="sum")
        with torch.no_grad():
            self.weight.copy_(weight)


class HybridModel(nn.Module):
    """The remote table's bag embeddings, then the (data-parallel) dense part."""

    def __init__(self, remote_table: RemoteModule, dense: nn.Module) -> None:
        super().__init__()
        self.remote_table = remote_table
        self.dense = dense

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dense(self.remote_table.forward(ids))


# ---------------------------------------------------------------------- the trainer
def _wrap(dense: nn.Module, config: HybridConfig, group: dist.ProcessGroup) -> nn.Module:
    ddp = tandem.DistributedDataParallel if config.ddp == "tandem" else nn.parallel.DistributedDataParallel
    return ddp(dense, process_group=group, gradient_as_bucket_view=config.gradient_as_bucket_view,
               bucket_cap_mb=config.bucket_cap_mb, find_unused_parameters=config.find_unused_parameters,
               static_graph=config.static_graph)


def train(remote_table: RemoteModule, config: HybridConfig, index: int, count: int) -> TrainerResult:
    """Trainer ``index`` of ``count``: runs on the trainer, called by the master over RPC.

    The trainers' process group is this process's default group (see run_rank)."""
    group = dist.group.WORLD
    assert group is not None and dist.get_world_size() == count, "the trainers' group is the default group"
    dense = make_dense(config.seed)
    ddp = _wrap(dense, config, group)
    model = HybridModel(remote_table, ddp)

    table_params = remote_table.remote_parameters()
    dense_params = list(ddp.parameters())
    local_opt: torch.optim.Optimizer | None = None
    if config.optimizer == "distributed":
        dist_opt = DistributedOptimizer(torch.optim.SGD, table_params + [rpc.RRef(p) for p in dense_params],
                                        lr=config.lr)
    else:
        dist_opt = DistributedOptimizer(torch.optim.SGD, table_params, lr=config.lr)
        local_opt = torch.optim.SGD(dense_params, lr=config.lr)

    losses = []
    grads: dict[torch.Tensor, torch.Tensor] = {}
    for batch in make_batches(config):
        ids, labels = shard(batch, index, count)
        with dist_autograd.context() as context_id:
            loss = F.cross_entropy(model(ids), labels)
            dist_autograd.backward(context_id, [loss])
            # The context holds this trainer's gradients; DDP averaged the dense ones there.
            grads = dist_autograd.get_gradients(context_id)
            if local_opt is not None:
                for p in dense_params:
                    p.grad = grads.get(p)
                local_opt.step()
                local_opt.zero_grad(set_to_none=True)
            # The parameter server applies each trainer's update as it arrives; taking
            # turns makes the order, and so the rounding, the same in every run.
            for turn in range(count):
                if turn == index:
                    dist_opt.step(context_id)
                dist.barrier(group)
        losses.append(loss.item())
    names = [n for n, _ in dense.named_parameters()]
    return TrainerResult(
        losses=losses,
        dense={n: p.detach().clone() for n, p in dense.named_parameters()},
        dense_grads={n: grads[p].clone() for n, p in zip(names, dense.parameters()) if p in grads})


# ---------------------------------------------------------------------- the master
def run_master(configs: list[HybridConfig], num_trainers: int) -> list[HybridResult]:
    """On the parameter server: for each config, a fresh table on this rank, every
    trainer trains against it, and the results are collected."""
    results = []
    for config in configs:
        table = RemoteModule(f"{PS_NAME}/cpu", EmbeddingTable, args=(initial_table(config.seed),))
        futures = [rpc.rpc_async(trainer_name(i), train, args=(table, config, i, num_trainers))
                   for i in range(num_trainers)]
        trainers = [f.wait() for f in futures]
        final = table.get_module_rref().local_value().weight.detach().clone()
        results.append(HybridResult(config, trainers, final))
    return results


def run_rank(rank: int, world_size: int, configs: list[HybridConfig], *,
             rpc_init_method: str = "env://", pg_init_method: str = "env://",
             timeout: float = 120.0) -> list[HybridResult] | None:
    """Everything rank ``rank`` of ``world_size`` does: ranks 0..world_size-2 are
    trainers (they form the process group DDP reduces over), the last rank is the
    parameter server and drives. Returns the results on the parameter server,
    None on trainers.

    Args:
        rpc_init_method: where the RPC agents meet (``env://``: MASTER_ADDR/PORT).
        pg_init_method: where the trainers' process group meets.
        timeout: seconds for any one RPC and collective.
    """
    if world_size < 2:
        raise ValueError(f"the hybrid job needs at least 2 ranks (trainers and a parameter "
                         f"server), got world_size={world_size}; run with --nproc-per-node 3")
    num_trainers = world_size - 1
    is_ps = rank == num_trainers
    if not is_ps:
        dist.init_process_group("gloo", init_method=pg_init_method, rank=rank, world_size=num_trainers,
                                timeout=datetime.timedelta(seconds=timeout))
    options = rpc.TensorPipeRpcBackendOptions(init_method=rpc_init_method, rpc_timeout=timeout)
    rpc.init_rpc(PS_NAME if is_ps else trainer_name(rank), rank=rank, world_size=world_size,
                 rpc_backend_options=options)
    try:
        results = run_master(configs, num_trainers) if is_ps else None
    except BaseException:
        # Do not wait in shutdown's barrier for peers that may never come: the
        # caller (or the launcher) tears the other ranks down.
        rpc.shutdown(graceful=False)
        raise
    rpc.shutdown()  # trainers serve the master's calls until every rank gets here
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (bags)")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ddp", choices=["tandem", "torch"], default="tandem")
    parser.add_argument("--optimizer", choices=["distributed", "local"], default="distributed")
    args = parser.parse_args()
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch_size % max(1, world_size - 1):
        parser.error(f"--batch-size {args.batch_size} must divide evenly over {world_size - 1} trainers")
    torch.set_num_threads(1)
    config = HybridConfig(ddp=args.ddp, optimizer=args.optimizer, steps=args.steps,
                          batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    results = run_rank(rank, world_size, [config])
    if results is None:
        return
    (result,) = results
    print(f"{world_size - 1} trainers + 1 parameter server, DDP: {config.ddp}, "
          f"optimizer: {config.optimizer}, global batch {config.batch_size}")
    for step, step_losses in enumerate(zip(*(t.losses for t in result.trainers))):
        if step % 5 == 0 or step == config.steps - 1:
            mean = sum(step_losses) / len(step_losses)
            print(f"step {step:3d}  loss {mean:.6f}  (" + ", ".join(f"{x:.6f}" for x in step_losses) + ")")
    first = result.trainers[0].dense
    same = all(torch.equal(first[n], t.dense[n]) for t in result.trainers[1:] for n in first)
    print(f"dense replicas identical on every trainer: {same}")
    print(f"table weight checksum {result.embedding.double().sum().item():.6f}, "
          f"dense checksum {sum(t.double().sum().item() for t in first.values()):.6f}")


if __name__ == "__main__":
    main()
