"""Lightning strategies that train with tandem: a Lightning user changes the
``strategy=`` argument and keeps the LightningModule, the callbacks, the loggers
and Lightning's own launcher.

- :class:`TandemDDPStrategy` (``Trainer(strategy="tandem_ddp")``): Lightning's
  ``DDPStrategy`` with ``tandem.DistributedDataParallel`` as the wrapper; the DDP
  paths Lightning takes only for torch's class (manual optimization, comm hooks,
  unwrapping at teardown) taken for tandem's (trainer_ddp.py, building the
  wrapper through wrap.py).
- :class:`TandemFabricDDPStrategy` (``Fabric(strategy="tandem_ddp")``): the same
  for Fabric (fabric_ddp.py, wrap.py).
- :class:`TandemFSDPStrategy` (``Trainer(strategy="tandem_fsdp")``): shards the
  LightningModule's layers with ``tandem.fully_shard`` and checkpoints sharded
  state with torch.distributed.checkpoint (trainer_fsdp.py, sharding through
  shard.py).
- :class:`TandemFabricFSDPStrategy` (``Fabric(strategy="tandem_fsdp")``): the
  same for Fabric (fabric_fsdp.py, shard.py).

Importing this package registers the short names in Lightning's strategy
registries, Lightning's documented way to name a strategy (registry.py), so that
the strings work once ``import tandem.integrations.lightning`` has run.
"""

from tandem.integrations.lightning.fabric_ddp import TandemFabricDDPStrategy
from tandem.integrations.lightning.fabric_fsdp import TandemFabricFSDPStrategy
from tandem.integrations.lightning.registry import register_strategies
from tandem.integrations.lightning.trainer_ddp import TandemDDPStrategy
from tandem.integrations.lightning.trainer_fsdp import TandemFSDPStrategy

register_strategies()

__all__ = ["TandemDDPStrategy", "TandemFSDPStrategy", "TandemFabricDDPStrategy", "TandemFabricFSDPStrategy",
           "register_strategies"]
