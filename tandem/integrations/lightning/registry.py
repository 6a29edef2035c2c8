"""The short names of tandem's strategies in Lightning's two registries: the
Trainer's (``lightning.pytorch.strategies.StrategyRegistry``) and Fabric's
(``lightning.fabric.strategies.STRATEGY_REGISTRY``), which is how a string such as
``Trainer(strategy="tandem_ddp")`` finds its class."""

from __future__ import annotations

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry as TRAINER_REGISTRY

from tandem.integrations.lightning.fabric_ddp import TandemFabricDDPStrategy
from tandem.integrations.lightning.fabric_fsdp import TandemFabricFSDPStrategy
from tandem.integrations.lightning.trainer_ddp import TandemDDPStrategy
from tandem.integrations.lightning.trainer_fsdp import TandemFSDPStrategy

__all__ = ["register_strategies"]


def register_strategies() -> None:
    """Register ``tandem_ddp`` (Trainer and Fabric), ``tandem_ddp_spawn`` (Trainer and
    Fabric: processes started by ``torch.multiprocessing`` instead of running the
    script again) and ``tandem_fsdp`` (Trainer and Fabric). Idempotent: registering again
    replaces the entries with the same ones."""
    for registry, ddp in ((TRAINER_REGISTRY, TandemDDPStrategy), (FABRIC_REGISTRY, TandemFabricDDPStrategy)):
        registry.register("tandem_ddp", ddp, description="tandem.DistributedDataParallel, the script run per process",
                          override=True, start_method="popen")
        registry.register("tandem_ddp_spawn", ddp, description="tandem.DistributedDataParallel, spawned processes",
                          override=True, start_method="spawn")
    for registry, fsdp in ((TRAINER_REGISTRY, TandemFSDPStrategy), (FABRIC_REGISTRY, TandemFabricFSDPStrategy)):
        registry.register("tandem_fsdp", fsdp, description="tandem.fully_shard over the model's layers",
                          override=True)
