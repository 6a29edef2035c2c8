"""The runs that tests/integrations/test_lightning.py compares, as one script that
Lightning's own launcher runs once per process (``Trainer(devices=N)`` and
``Fabric(devices=N)`` on CPU/gloo): the first Trainer starts the other ranks,
which run this script from the top; the Trainers and Fabrics after it find the
processes and the process group there and reuse them.

    python _lightning_runs.py --world 2 --out DIR --fresh ddp,tandem_ddp      # each saves a checkpoint
    python _lightning_runs.py --world 3 --out DIR --resume ddp,tandem_ddp     # each resumes from its world-2 one

The model is Lightning's shipped demo, ``LightningTransformer`` (its ``Transformer``,
a small vocabulary), on random tokens. Each run writes the losses of each rank to
``DIR/{run}-w{world}-r{rank}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, cast

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.demos import LightningTransformer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils.data import DataLoader, TensorDataset

import tandem.integrations.lightning  # noqa: F401  (registers "tandem_ddp", "tandem_fsdp")
from tandem.integrations.lightning import TandemDDPStrategy, TandemFabricFSDPStrategy, TandemFSDPStrategy

VOCAB, SEQ, BATCH, ACCUMULATE = 64, 8, 2, 2
STEPS, MORE_STEPS = 30, 4  # optimizer steps of a fresh run; of a resumed one after the checkpoint's
LAYERS = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}


def tokens() -> TensorDataset:
    data = torch.randint(0, VOCAB, (400, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(data[:, :-1], data[:, 1:])


class LoggedTransformer(LightningTransformer):
    """The demo on random tokens (no WikiText2 download), logging its loss through Lightning's logger."""

    def prepare_data(self) -> None:
        pass

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


class ManualTransformer(LoggedTransformer):
    """The demo under manual optimization: the strategy arms the gradient sync in manual_backward."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size=vocab_size)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        assert isinstance(optimizer, LightningOptimizer), "one optimizer"
        optimizer.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        # Lightning's stub asks for an Optimizer; its docs pass what optimizers() returns, as here.
        self.clip_gradients(cast(torch.optim.Optimizer, optimizer), gradient_clip_val=0.5)
        optimizer.step()
        return loss.detach()


def torch_parallelize(module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """As a ModelParallelStrategy user shards the demo: torch's fully_shard on each layer, then the root."""
    mesh = device_mesh["data_parallel"]
    for layer in [m for m in module.modules() if isinstance(m, tuple(LAYERS))]:
        torch_fully_shard(layer, mesh=mesh)
    torch_fully_shard(module, mesh=mesh)
    return module


class TorchShardedTransformer(LoggedTransformer):
    """The demo sharded by torch's fully_shard in configure_model (the Trainer's ModelParallelStrategy)."""

    def configure_model(self) -> None:
        assert self.device_mesh is not None, "ModelParallelStrategy sets the mesh before configure_model"
        torch_parallelize(self, self.device_mesh)


class Losses(Callback):
    """Each training step's loss on this rank, and the classes that wrapped the model."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.wrapper = ""
        self.options: dict[str, object] = {}

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        model = trainer.strategy.model
        self.wrapper = wrapper_name(model)
        # what the strategy's options did to tandem's wrapper: (state, hook) of its registered hook
        hook = getattr(model, "_comm_hook", None)
        self.options = {"bucket_bytes_cap": getattr(model, "bucket_bytes_cap", None),
                        "comm_hook": hook[1].__name__ if hook else None}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.values.append(float(outputs["loss"]))


def wrapper_name(model: nn.Module) -> str:
    """The wrapper's class, or under FSDP2 the class that fully_shard mixed into the model's."""
    for cls in type(model).__mro__:
        if cls.__name__ in ("DistributedDataParallel", "FSDPModule"):
            return f"{cls.__module__}.{cls.__name__}"
    return type(model).__name__


def write(out: Path, run: str, world: int, rank: int, record: dict) -> None:
    (out / f"{run}-w{world}-r{rank}.json").write_text(json.dumps(record))


def fit(run: str, strategy, module_class: type, args: argparse.Namespace, ckpt: Path | None) -> None:  # noqa: ANN001
    """Trainer.fit for 30 optimizer steps with clipping (of 2 micro-batches under DDP and automatic
    optimization), or from ``ckpt`` for 4 more."""
    seed_everything(42)
    model = module_class(vocab_size=VOCAB)
    losses = Losses()
    steps = STEPS + MORE_STEPS if ckpt else STEPS
    automatic = module_class is not ManualTransformer
    # Accumulation where the strategy takes part in it (DDP's no_sync); FSDP2 reduces every micro-batch.
    accumulate = ACCUMULATE if automatic and "fsdp" not in run else 1
    trainer = Trainer(accelerator="cpu", devices=args.world, strategy=strategy, max_steps=steps,
                      accumulate_grad_batches=accumulate,
                      gradient_clip_val=0.5 if automatic else None, callbacks=[losses],
                      logger=CSVLogger(args.out / "logs", name=run), log_every_n_steps=1, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(tokens(), batch_size=BATCH), ckpt_path=ckpt)
    name = f"{run}-resumed" if ckpt else run
    write(args.out, name, args.world, trainer.global_rank,
          {"losses": losses.values, "wrapper": losses.wrapper, **losses.options})
    if ckpt is None:
        trainer.save_checkpoint(args.out / f"{run}-w{args.world}.ckpt")


def fabric_loop(run: str, strategy, args: argparse.Namespace, resume: bool) -> None:  # noqa: ANN001
    """The loop of Fabric's docs: gradient accumulation under no_backward_sync, clipping, save/load.
    Under a sharding strategy the optimizer is made after the model is set up (sharding replaces
    the parameters), as Fabric's docs do for FSDP."""
    fabric = Fabric(accelerator="cpu", devices=args.world, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(42)
    module = LightningTransformer(vocab_size=VOCAB)
    if isinstance(fabric.strategy, FabricModelParallelStrategy):
        model = fabric.setup_module(module)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    else:
        model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    assert not isinstance(optimizer, tuple), "one optimizer"
    loader = fabric.setup_dataloaders(DataLoader(tokens(), batch_size=BATCH))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    step = 0
    if resume:
        fabric.load(args.out / f"{run}-w{args.saved_world}.ckpt", state)
    losses: list[float] = []
    # Whether the first backward under no_backward_sync left gradients in param.grad: DDP's no_sync
    # does (local sums); FSDP2's does not (full gradients kept in the unit until the sync).
    grads_in_no_sync = None
    micro = 0
    for inputs, target in loader:
        is_accumulating = (micro + 1) % ACCUMULATE != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            loss = nn.functional.nll_loss(model(inputs, target), target.view(-1))
            fabric.backward(loss / ACCUMULATE)
        if micro == 0:
            grads_in_no_sync = any(p.grad is not None for p in model.parameters())
        losses.append(loss.item())
        micro += 1
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=0.5)
            optimizer.step()
            optimizer.zero_grad()
            step = state["step"] = int(state["step"]) + 1
            if step == (STEPS + MORE_STEPS if resume else STEPS):
                break
    write(args.out, f"{run}-resumed" if resume else run, args.world, fabric.global_rank,
          {"losses": losses, "wrapper": wrapper_name(model._forward_module), "grads_in_no_sync": grads_in_no_sync})
    if not resume:
        fabric.save(args.out / f"{run}-w{args.world}.ckpt", state)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fresh", default="", help="comma-separated runs from a fresh model, each saving a checkpoint")
    parser.add_argument("--resume", default="", help="comma-separated runs resuming from their checkpoint")
    parser.add_argument("--saved-world", type=int, default=2, help="the world size whose checkpoints --resume loads")
    args = parser.parse_args()
    trainer_runs = {
        "ddp": (lambda: DDPStrategy(), LoggedTransformer),
        "tandem_ddp": (lambda: "tandem_ddp", LoggedTransformer),
        # torch's own all-reduce hook through Lightning's ddp_comm_hook, and a bucket size for the wrapper
        "tandem_ddp_hook": (lambda: TandemDDPStrategy(ddp_comm_hook=default_hooks.allreduce_hook, bucket_cap_mb=1),
                            LoggedTransformer),
        "ddp_manual": (lambda: DDPStrategy(), ManualTransformer),
        "tandem_ddp_manual": (lambda: "tandem_ddp", ManualTransformer),
        "fsdp": (lambda: ModelParallelStrategy(data_parallel_size=args.world, tensor_parallel_size=1),
                 TorchShardedTransformer),
        "tandem_fsdp": (lambda: TandemFSDPStrategy(auto_wrap_policy=LAYERS), LoggedTransformer),
    }
    fabric_runs = {
        "fabric_ddp": lambda: FabricDDPStrategy(),
        "fabric_tandem_ddp": lambda: "tandem_ddp",
        "fabric_fsdp": lambda: FabricModelParallelStrategy(torch_parallelize, data_parallel_size=args.world,
                                                           tensor_parallel_size=1),
        "fabric_tandem_fsdp": lambda: TandemFabricFSDPStrategy(auto_wrap_policy=LAYERS),
    }
    for resume, runs in ((False, args.fresh), (True, args.resume)):
        for run in filter(None, runs.split(",")):
            if run in fabric_runs:
                fabric_loop(run, fabric_runs[run](), args, resume=resume)
            else:
                strategy, module_class = trainer_runs[run]
                ckpt = args.out / f"{run}-w{args.saved_world}.ckpt" if resume else None
                fit(run, strategy(), module_class, args, ckpt)
    print(f"rank {os.environ.get('LOCAL_RANK', '0')}: done")


if __name__ == "__main__":
    main()
