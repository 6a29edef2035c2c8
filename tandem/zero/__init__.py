"""ZeRO: sharding optimizer state, gradients and parameters across ranks.

So far: the pure shard layout over DDP's flat bucket buffers (layout.py) and the
memory planner (memory.py). The sharded optimizer builds on both.
"""

from tandem.zero.layout import BucketShard, ShardPiece, shard_bucket
from tandem.zero.memory import MemoryEstimate, estimate_memory, format_memory_table

__all__ = ["BucketShard", "MemoryEstimate", "ShardPiece", "estimate_memory",
           "format_memory_table", "shard_bucket"]
