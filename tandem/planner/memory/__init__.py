"""The memory planner: per-rank bytes of parameters, gradients and optimizer
state under ZeRO stages 0 to 3, before running anything.

Stage 0 is tandem's DistributedDataParallel (a full copy of everything on every
rank), stage 1 shards the optimizer state (:class:`tandem.ZeroOptimizer`),
stage 2 also the gradients (both over DDP's buckets, Note [stages 0 to 2
memory] in buckets.py), stage 3 also the parameters (Rajbhandari et al., 2020):
that is ``tandem.fully_shard``, planned from the units it would build (Note
[stage 3 memory] in fully_shard.py). ``tandem plan`` (tandem/tools/plan/) adds
the activations, measured.

The files, one concept each:

- ``estimate.py``: what is planned and what comes out: :class:`FullyShardSpec`,
  :class:`UnitEstimate`, :class:`MemoryEstimate`.
- ``buckets.py``: stages 0 to 2, from DDP's buckets (:func:`ddp_bucket_plan`).
- ``units.py``: the units ``fully_shard`` would build, its calls replayed.
- ``fully_shard.py``: stage 3's bytes, from those units' layouts.
- ``phases.py``: stage 3's peak over the phases of a measured step.
- ``stages.py``: :func:`estimate_memory`, all four stages of one model (Note
  [local shapes]), and :func:`format_memory_table`.
"""

from tandem.planner.memory.buckets import ddp_bucket_plan
from tandem.planner.memory.estimate import FullyShardSpec, MemoryEstimate, StepActivity, UnitEstimate
from tandem.planner.memory.phases import stage3_peak
from tandem.planner.memory.stages import estimate_memory, format_memory_table

__all__ = ["FullyShardSpec", "MemoryEstimate", "StepActivity", "UnitEstimate", "ddp_bucket_plan",
           "estimate_memory", "format_memory_table", "stage3_peak"]
