"""ZeRO: sharding optimizer state, gradients and parameters across ranks.

:class:`ZeroOptimizer` steps the gradient shards that
``DistributedDataParallel(zero_stage=1 or 2)`` reduce-scatters, and gathers the
updated parameters; :class:`ZeroStage` and :class:`ZeroConfig` are the stages
and overlap options; :func:`shard_bucket` is the pure shard layout over DDP's
flat bucket buffers. Re-exported from the planner (:mod:`tandem.planner`),
computed without running anything: the memory per rank under DDP, ZeRO-1,
ZeRO-2 and fully_shard (:func:`estimate_memory`) and the bytes each rank sends
per step (:func:`ddp_traffic`, :func:`fully_shard_traffic`).
"""

# The package's files: the pure shard layout over DDP's flat bucket buffers
# (layout.py) and the sharded optimizer (optimizer.py, over this rank's shards
# in shards.py, gathering the updated parameters in param_gather.py). The
# stages and overlap options are tandem/ddp/zero_config.py's.

from tandem.ddp.zero_config import ZeroConfig, ZeroStage
from tandem.planner.memory import FullyShardSpec, MemoryEstimate, UnitEstimate, estimate_memory, format_memory_table
from tandem.planner.traffic import Traffic, ddp_traffic, fully_shard_traffic
from tandem.zero.layout import BucketShard, ShardPiece, shard_bucket
from tandem.zero.optimizer import ZeroOptimizer

__all__ = ["BucketShard", "FullyShardSpec", "MemoryEstimate", "ShardPiece", "Traffic", "UnitEstimate", "ZeroConfig",
           "ZeroOptimizer", "ZeroStage", "ddp_traffic", "estimate_memory", "format_memory_table",
           "fully_shard_traffic", "shard_bucket"]
