"""Pipeline parallelism with data parallelism: an MLP in pipeline stages, each stage
data-parallel through tandem.

The run book::

    tandem run --nproc-per-node 4 -m tandem.examples.pipeline                  # 2 stages x 2 replicas
    tandem run --nproc-per-node 4 -m tandem.examples.pipeline --schedule 1f1b --reference
    tandem run --nproc-per-node 4 -m tandem.examples.pipeline --dp fully_shard
    tandem run --nproc-per-node 6 -m tandem.examples.pipeline --stages 3      # 3 stages x 2 replicas

The ranks form a 2-D ``DeviceMesh`` with dims ``("pp", "dp")``: rank ``r`` is
stage ``r // dp`` of replica ``r % dp``, so ranks 0 and 1 hold stage 0, ranks 2
and 3 stage 1. Along ``pp``, torch's own ``torch.distributed.pipelining`` runs
the stages (``PipelineStage``, ``ScheduleGPipe`` or ``Schedule1F1B``) and sends
activations and their gradients point to point; along ``dp``, each stage is
wrapped in ``tandem.DistributedDataParallel(stage, device_mesh=mesh["dp"])`` (or
``tandem.fully_shard(stage, mesh=mesh["dp"])``), which averages its gradients
over the replicas of that stage only.

Each replica takes its own slice of the global batch and the schedule splits it
into micro-batches; the loss is the mean squared error of each micro-batch, and
torch's schedule divides the summed gradients by the number of micro-batches
(``scale_grads=True``). The update is therefore the one that single-process
training on the global batch makes, and ``--reference`` checks it: it trains the
unsplit model on the global batch in one process (on each last-stage rank) and
prints both losses and the largest difference between the parameters.

What to expect, in about 15 s on two CPU cores (most of it starting four
processes): the loss falls from 0.504 to 0.361 in 20 steps (the targets are
noisy, the batches small), and with ``--reference`` the single process prints
the same final loss and every rank a parameter difference below 1e-7.

Each stage is a :class:`tandem.pipelining.PipelineStage` (Note [pipeline stage
adapter] there): torch's stage, taught tandem's wrappers.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

import tandem
from tandem.pipelining import PipelineStage

__all__ = ["PipelineResult", "build_model", "make_batches", "make_mesh", "make_optimizer",
           "single_process_training", "split_stages", "train_pipeline", "wrap_data_parallel"]

MESH_DIMS = ("pp", "dp")
SCHEDULES: dict[str, type] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
DATA_PARALLEL = ("ddp", "fully_shard")
NUM_FEATURES = 16
HIDDEN = 32
NUM_OUTPUTS = 4


# ---------------------------------------------------------------------- model and data

def build_model(num_layers: int = 4, seed: int = 0) -> nn.Sequential:
    """The whole model, the same on every rank: ``num_layers`` linear layers with
    tanh between them, as one ``nn.Sequential`` (indices ``0, 1, ...``)."""
    torch.manual_seed(seed)
    widths = [NUM_FEATURES] + [HIDDEN] * (num_layers - 1) + [NUM_OUTPUTS]
    layers: list[nn.Module] = []
    for i in range(num_layers):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < num_layers - 1:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def split_stages(model: nn.Sequential, num_stages: int) -> list[nn.Sequential]:
    """Cut ``model`` into ``num_stages`` consecutive pieces with as equal a number
    of linear layers as possible. Slicing keeps the layers' indices, so a stage's
    parameter names (``"4.weight"``) are the whole model's."""
    linear_at = [i for i, m in enumerate(model) if isinstance(m, nn.Linear)]
    if not 1 <= num_stages <= len(linear_at):
        raise ValueError(f"num_stages={num_stages} must be between 1 and the number of linear "
                         f"layers ({len(linear_at)}); pass --layers with at least as many layers as stages")
    per_stage = [len(linear_at) // num_stages + (s < len(linear_at) % num_stages) for s in range(num_stages)]
    starts, first = [], 0
    for n in per_stage:
        starts.append(linear_at[first])
        first += n
    bounds = starts + [len(model)]
    return [model[bounds[s]:bounds[s + 1]] for s in range(num_stages)]  # type: ignore[misc]


def make_batches(steps: int, global_batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of inputs ``(global_batch, NUM_FEATURES)`` and
    targets ``(global_batch, NUM_OUTPUTS)``, the same on every rank: a fixed
    random linear map through a sine, plus a little noise."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(NUM_FEATURES, NUM_OUTPUTS, generator=gen) / NUM_FEATURES ** 0.5
    batches = []
    for _ in range(steps):
        x = torch.randn(global_batch, NUM_FEATURES, generator=gen)
        y = torch.sin(2 * x @ weight) + 0.05 * torch.randn(global_batch, NUM_OUTPUTS, generator=gen)
        batches.append((x, y))
    return batches


def make_optimizer(params: Any, lr: float) -> torch.optim.Optimizer:
    """Adam: its update divides by the gradients' running RMS, so a wrong scale
    (a missing 1/n) would hide, but wrong directions or unequal replicas would not;
    the test also runs SGD with momentum, where the scale shows."""
    return torch.optim.Adam(params, lr=lr)


# ---------------------------------------------------------------------- the reference

@dataclass(frozen=True)
class PipelineResult:
    """What a training run ends with (the pipeline's on a last-stage rank, or the single process's)."""

    losses: list[float]
    """The global batch's mean loss at each step, before that step's update."""
    params: dict[str, torch.Tensor]
    """Final parameters by the whole model's names (a stage's own ones, for a pipeline rank)."""
    synced_backwards: int | None = None
    """Backwards in which the stage's DDP reduced gradients (one per step); None
    without tandem's DDP."""


def single_process_training(*, steps: int, global_batch: int, num_layers: int = 4, lr: float = 1e-2,
                            seed: int = 0, optimizer: Callable[..., torch.optim.Optimizer] = make_optimizer,
                            ) -> PipelineResult:
    """Train the unsplit model in this process on the global batches: what the
    pipeline must equal."""
    model = build_model(num_layers, seed)
    opt = optimizer(model.parameters(), lr)
    losses = []
    for x, y in make_batches(steps, global_batch, seed):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return PipelineResult(losses, {n: p.detach().clone() for n, p in model.named_parameters()})


# ---------------------------------------------------------------------- the pipeline

def make_mesh(num_stages: int, device_type: str = "cpu") -> DeviceMesh:
    """The ``("pp", "dp")`` mesh of the world: ``num_stages`` stages, each on
    ``world_size // num_stages`` data-parallel replicas."""
    world = dist.get_world_size()
    if num_stages < 1 or world % num_stages:
        raise ValueError(f"rank {dist.get_rank()}: the world size {world} is not a multiple of "
                         f"num_stages={num_stages}; launch stages x replicas processes "
                         f"(tandem run --nproc-per-node {2 * num_stages} for 2 replicas)")
    return init_device_mesh(device_type, (num_stages, world // num_stages), mesh_dim_names=MESH_DIMS)


def wrap_data_parallel(stage: nn.Module, mesh: DeviceMesh, how: str) -> nn.Module:
    """``stage`` made data-parallel over ``mesh["dp"]`` by tandem."""
    if how == "ddp":
        return tandem.DistributedDataParallel(stage, device_mesh=mesh["dp"])
    if how == "fully_shard":
        return tandem.fully_shard(stage, mesh=mesh["dp"])
    raise ValueError(f"data parallelism {how!r} is not one of {DATA_PARALLEL}")


def train_pipeline(mesh: DeviceMesh, *, schedule: str = "gpipe", data_parallel: str = "ddp", steps: int = 5,
                   num_microbatches: int = 4, microbatch_size: int = 4, num_layers: int = 4, lr: float = 1e-2,
                   seed: int = 0, optimizer: Callable[..., torch.optim.Optimizer] = make_optimizer,
                   ) -> PipelineResult:
    """Train the model split over ``mesh["pp"]``, each stage data-parallel over
    ``mesh["dp"]``, on the same global batches as :func:`single_process_training`
    with ``global_batch = dp * num_microbatches * microbatch_size``.

    Returns this rank's stage parameters (gathered in full under ``fully_shard``)
    and, on a last-stage rank, the loss of each step averaged over the replicas
    (empty on the other stages).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {sorted(SCHEDULES)}")
    num_stages, num_replicas = mesh["pp"].size(), mesh["dp"].size()
    stage_index, replica = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    device = torch.device(mesh.device_type)

    module = split_stages(build_model(num_layers, seed), num_stages)[stage_index].to(device)
    names = [n for n, _ in module.named_parameters()]
    wrapped = wrap_data_parallel(module, mesh, data_parallel)
    stage = PipelineStage(wrapped, stage_index, num_stages, device, group=mesh["pp"].get_group())
    pipe = SCHEDULES[schedule](stage, num_microbatches, loss_fn=nn.functional.mse_loss)
    opt = optimizer(wrapped.parameters(), lr)

    local_batch = num_microbatches * microbatch_size
    losses = []
    for x, y in make_batches(steps, local_batch * num_replicas, seed):
        rows = slice(replica * local_batch, (replica + 1) * local_batch)  # this replica's share
        x, y = x[rows].to(device), y[rows].to(device)
        opt.zero_grad(set_to_none=True)
        mb_losses: list[torch.Tensor] = []
        if stage.is_first and stage.is_last:
            pipe.step(x, target=y, losses=mb_losses)
        elif stage.is_first:
            pipe.step(x)
        elif stage.is_last:
            pipe.step(target=y, losses=mb_losses)
        else:
            pipe.step()
        opt.step()
        if stage.is_last:
            loss = torch.stack(mb_losses).detach().mean()
            dist.all_reduce(loss, group=mesh["dp"].get_group())  # the replicas' mean
            losses.append(loss.item() / num_replicas)
    reducer = getattr(wrapped, "reducer", None)
    return PipelineResult(losses, dict(zip(names, _full_params(module))),
                          None if reducer is None else reducer.steps)


def _full_params(module: nn.Module) -> list[torch.Tensor]:
    """The module's parameters as whole tensors (a ``fully_shard`` module's are
    DTensor shards: gathered, a collective over its mesh)."""
    full = []
    for p in module.parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        full.append(t.detach().clone())
    return full


# ---------------------------------------------------------------------- the command

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schedule", default="gpipe", choices=sorted(SCHEDULES))
    p.add_argument("--dp", default="ddp", choices=DATA_PARALLEL, help="how each stage is data-parallel")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (the world is stages x replicas)")
    p.add_argument("--layers", type=int, default=4, help="linear layers in the model")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=4, help="per replica per step")
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2, help="Adam's")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", action="store_true",
                   help="also train in one process on the global batch and compare")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    world = tandem.init()
    mesh = make_mesh(args.stages, world.device.type)
    replicas = world.world_size // args.stages
    global_batch = replicas * args.microbatches * args.microbatch_size
    if world.rank == 0:
        print(f"{args.stages} stages x {replicas} replicas ({args.schedule}, {args.dp}), "
              f"global batch {global_batch} in {args.microbatches} micro-batches per replica")
    result = train_pipeline(mesh, schedule=args.schedule, data_parallel=args.dp, steps=args.steps,
                            num_microbatches=args.microbatches, microbatch_size=args.microbatch_size,
                            num_layers=args.layers, lr=args.lr, seed=args.seed)
    if result.losses and mesh.get_local_rank("dp") == 0:  # one rank of the last stage
        for step, loss in enumerate(result.losses, 1):
            if step % args.log_every == 0 or step in (1, args.steps):
                print(f"step {step:4d}  loss {loss:.6f}")
        print(f"final loss {result.losses[-1]:.6f}")
    if args.reference:
        ref = single_process_training(steps=args.steps, global_batch=global_batch, num_layers=args.layers,
                                      lr=args.lr, seed=args.seed)
        diff = max((result.params[n] - ref.params[n].to(world.device)).abs().max().item()
                   for n in result.params)
        if result.losses and mesh.get_local_rank("dp") == 0:
            print(f"reference final loss {ref.losses[-1]:.6f}")
        print(f"stage {mesh.get_local_rank('pp')}: max abs parameter difference from "
              f"single-process training {diff:.3g}")
    tandem.shutdown()


if __name__ == "__main__":
    main()
