"""The planner: what a job would hold and send, computed from the model's
shapes, dtypes and the world size before anything runs (no process group, no
hooks, nothing launched). ``tandem plan`` (tandem/tools/plan/) is the tool over
it: it measures the activations with one forward and backward and writes the
report.

The files:

- ``memory/``: the bytes per rank of parameters, gradients and optimizer state
  under DDP, ZeRO-1, ZeRO-2 and fully_shard (:func:`estimate_memory`), and
  fully_shard's peak over a measured step (:func:`stage3_peak`); its own
  docstring lists its files.
- ``traffic.py``: the bytes one rank sends per optimizer step under DDP, ZeRO,
  fully_shard and HSDP, and what crosses the links between nodes (Notes
  [traffic per step], [bytes between nodes]).
- ``tensor_parallel.py``: what torch's tensor parallelism would make of each
  parameter, for the shapes one rank of a dp x tp mesh holds (Note [planning a
  tensor-parallel mesh]).

:mod:`tandem.zero` re-exports the memory and traffic planners' public names
(``tandem.zero.estimate_memory``).
"""

from tandem.planner.memory import FullyShardSpec, MemoryEstimate, StepActivity, UnitEstimate, estimate_memory, \
    format_memory_table, stage3_peak
from tandem.planner.tensor_parallel import TensorParallelShard, parse_mesh, tensor_parallel_shards
from tandem.planner.traffic import Traffic, between_nodes, ddp_traffic, fully_shard_traffic, zero_traffic

__all__ = ["FullyShardSpec", "MemoryEstimate", "StepActivity", "TensorParallelShard", "Traffic", "UnitEstimate",
           "between_nodes", "ddp_traffic", "estimate_memory", "format_memory_table", "fully_shard_traffic",
           "parse_mesh", "stage3_peak", "tensor_parallel_shards", "zero_traffic"]
