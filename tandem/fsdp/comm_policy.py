"""fully_shard's ``comm_policy``: a unit's parameter all-gather in int8 blocks
and its gradient reduce-scatter in int8 or int4 blocks
(:class:`QuantizedCommPolicy`), ZeRO++'s qwZ and qgZ (arXiv 2306.10209).

# Note [quantized units]
What travels, and what does not change:

- The gather (unit.py). Each rank quantizes what it would have sent,
  its shard buffer in ``param_dtype`` (the parameters' own dtype without a
  MixedPrecisionPolicy), in blocks of ``block`` elements from the buffer's
  start (a block may span two parameters' chunks; the padding is zeros); the
  int8 values and the fp32 scales are all-gathered, and every rank decodes
  every rank's row into the gather's output, which is copied out into the
  parameters as usual (Note [quantized collectives] in
  tandem/quantized/collectives.py). Only the gathered copy that forward
  and backward compute with is approximate: the shards, which the optimizer
  steps, are never quantized. The shard does not change between a unit's
  forward and its backward, and quantizing is deterministic, so backward's
  gather gives exactly forward's parameters. With ``reshard_after_forward=k``
  the 1/k slice kept after forward is of the decoded parameters, and its
  gather over the k ranks in backward sends it as it is, in ``param_dtype``
  (quantizing it again would add a second error).
- The reduce-scatter (unit.py). Its input, ``world`` rows of the
  unit's gradients in ``reduce_dtype`` plus one flag per parameter (Note
  [gradient flags] in unit.py), is sent by an all-to-all: each row's
  gradients quantized on their own, int8 or int4, its flags as fp32 (a flag
  counts the ranks that produced a gradient and must arrive exact). Each rank
  sums the rows it received in fp32, in rank order, and writes the sum, in
  ``reduce_dtype``, where the reduce-scatter would have: the division, the
  hooks, HSDP's all-reduce and the sharded ``.grad`` follow unchanged. The
  input is freed once quantized, so in flight a unit holds its payloads (a
  quarter or an eighth of an fp32 input, sent and received) rather than the
  input; quantizing makes fp32 temporaries of the input's size while it runs.
- HSDP: the collectives of the shard group are quantized; the all-reduce of
  the reduced shard over the replicate group is not (it carries 1/shards of
  the unit's gradients; quantized, it would be a second exchange of two
  collectives, as the quantized average).
- A group of one sends nothing, so nothing is quantized. Tensor-parallel
  parameters (Note [2-D parameters] in tensor_parallel.py) are gathered and
  reduced over ``mesh["dp"]`` as their local shards, quantized the same way.

No error feedback. What a step's quantization loses of a gradient is not
carried into the next step, as in ZeRO++'s qgZ: a residual would hold, on
every rank, what was lost of each row it sent, a full unsharded gradient per
rank kept across steps, the memory that sharding exists to save. Without it,
an entry smaller than half a step of its block (its block's largest over 254
at int8, over 14 at int4) is rounded to zero at every step; DDP's int8 hook
(tandem/comm_hooks/quantized.py) keeps a residual, DDP holding whole
gradients anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.quantized.blocks import BLOCK

__all__ = ["QuantizedCommPolicy", "check_quantizable"]


@dataclass(frozen=True, kw_only=True)
class QuantizedCommPolicy:
    """Send a unit's parameter all-gather in int8 blocks and its gradient
    reduce-scatter in int8 or int4 blocks, each block of ``block`` values with
    one fp32 scale (ZeRO++'s quantized weights and gradients, arXiv
    2306.10209). Pass it as ``fully_shard(module, comm_policy=...)``.

    The sharded parameters the optimizer steps stay exact; forward and
    backward compute with the gathered parameters quantized and dequantized
    (each element within half a step, its block's largest over 254, of its
    value), and each rank's gradient loses up to half a step of its block
    before the average (no error feedback: a gradient entry below half a step
    is lost at every step). A unit's collectives hand about a quarter of
    fp32's bytes (int8) or an eighth (int4) to the network, the scales aside.

    Under HSDP the shard group's collectives are quantized, the all-reduce
    across replicas is not. With ``reshard_after_forward=k`` the gather over
    the k ranks in backward sends the slice kept after forward, already
    decoded, in ``param_dtype``.
    """

    weight_bits: int | None = 8
    """8: the parameter all-gather sends int8 blocks of the ``param_dtype`` shard;
    None: it sends the shard in ``param_dtype``, as without the policy."""
    grad_bits: int | None = 8
    """8 or 4: the reduce-scatter sends int8 or int4 (two a byte) blocks of the
    ``reduce_dtype`` gradients; None: it sends them in ``reduce_dtype``."""
    block: int = BLOCK
    """Values sharing one fp32 scale: smaller blocks follow the values more
    closely and send more scale bytes (4 a block)."""

    def __post_init__(self) -> None:
        if self.weight_bits is not None and (isinstance(self.weight_bits, bool) or self.weight_bits != 8):
            extra = (": int4 weights would put every forward's parameters up to 1/14 of their block's "
                     "largest off; ZeRO++ sends weights in int8 too" if self.weight_bits == 4 else "")
            raise ValueError(f"QuantizedCommPolicy.weight_bits must be 8 or None (gather in param_dtype), "
                             f"got {self.weight_bits!r}{extra}")
        if self.grad_bits is not None and (isinstance(self.grad_bits, bool) or self.grad_bits not in (8, 4)):
            raise ValueError(f"QuantizedCommPolicy.grad_bits must be 8, 4 or None (reduce in reduce_dtype), "
                             f"got {self.grad_bits!r}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 2 or self.block % 2:
            raise ValueError(f"QuantizedCommPolicy.block must be an even int >= 2 (values per fp32 scale; "
                             f"int4 packs two a byte), got {self.block!r}; the default is {BLOCK}")


def check_quantizable(unit: str, dtype: torch.dtype, policy: QuantizedCommPolicy | None) -> None:
    """Refuse a policy that would quantize a unit of integer (or bool) parameters,
    whose values must arrive exact."""
    if policy is None or (policy.weight_bits is None and policy.grad_bits is None):
        return
    if not dtype.is_floating_point:
        raise ValueError(f"fully_shard unit '{unit}' holds {dtype} parameters, and comm_policy={policy} would "
                         "quantize them: quantized collectives are for floating-point values. Call fully_shard on "
                         "this module without comm_policy (or with QuantizedCommPolicy(weight_bits=None, "
                         "grad_bits=None))")
