"""ZeRO: sharding optimizer state, gradients and parameters across ranks.

The pure shard layout over DDP's flat bucket buffers (layout.py), the memory
planner (memory.py), the stages and overlap options (config.py), and the sharded
optimizer (optimizer.py), which steps the gradient shards that
``DistributedDataParallel(zero_stage=1 or 2)`` reduce-scatters.
"""

from tandem.ddp.zero_config import ZeroConfig, ZeroStage
from tandem.zero.layout import BucketShard, ShardPiece, shard_bucket
from tandem.zero.memory import FullyShardSpec, MemoryEstimate, UnitEstimate, estimate_memory, format_memory_table
from tandem.zero.optimizer import ZeroOptimizer

__all__ = ["BucketShard", "FullyShardSpec", "MemoryEstimate", "ShardPiece", "UnitEstimate", "ZeroConfig",
           "ZeroOptimizer", "ZeroStage", "estimate_memory", "format_memory_table", "shard_bucket"]
