"""Values sent in int8 or int4 blocks, for the hooks and wrappers that send
them: ZeRO++'s quantized collectives and a quantized average, over
tandem.comm's :class:`~tandem.comm.group.GroupComm`.

The files, bottom up:

- ``blocks.py``: a flat tensor quantized in blocks and back, and rows laid out
  as the bytes a collective sends (Notes [block-wise quantization], [quantized
  rows]); pure arithmetic, no communication.
- ``collectives.py``: :func:`all_gather_quantized` and
  :func:`reduce_scatter_quantized`, decoded when waited on (Note [quantized
  collectives]); fully_shard's quantized gathers and reductions
  (tandem/fsdp/comm_policy.py).
- ``average.py``: :class:`QuantizedAverage`, the reduce-scatter then the
  all-gather, with error feedback and an fp32 step inside each node (Note [a
  quantized average]); the quantized comm hook (tandem/comm_hooks/quantized.py)
  and DiLoCo's quantized outer sync (tandem/diloco/fragment_sync.py).
"""

from tandem.quantized.average import QuantizedAverage
from tandem.quantized.blocks import BLOCK, Quantized, dequantize, quantize
from tandem.quantized.collectives import QuantizedWork, all_gather_quantized, reduce_scatter_quantized

__all__ = ["BLOCK", "Quantized", "QuantizedAverage", "QuantizedWork", "all_gather_quantized", "dequantize",
           "quantize", "reduce_scatter_quantized"]
