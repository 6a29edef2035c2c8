"""Block-wise quantization of a flat tensor to int8 or int4, and back:
:func:`quantize`, :func:`dequantize`, :func:`error_bound`. Pure arithmetic,
no communication.

# Note [block-wise quantization]
The tensor is cut into blocks of ``block`` elements (the last one padded with
zeros). Each block keeps one fp32 scale, its largest magnitude over ``qmax``
(127 for int8, 7 for int4), and each element becomes ``round(x / scale)``, an
integer in ``[-qmax, qmax]``: symmetric, so zero stays exactly zero and a
block's sign pattern survives. Dequantized, an element is off by at most half
a step, ``scale / 2``: :func:`error_bound` gives that bound per element, the
one the tests hold the round trip to. int4 values are stored two to a byte
(``q + 8`` in the low, then the high, nibble). The values are kept for the
tensor's own elements only (the padding of the last block is not stored). A
block of 256 adds 4 bytes of scale to 256 (int8) or 128 (int4) bytes of
values: 1.6% or 3.1%. This is the
scheme of ZeRO++'s quantized collectives (arXiv 2306.10209) and of DiLoCo's
quantized outer sync; block-wise scales keep one large gradient entry from
flattening the rest of the tensor to zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BLOCK", "Quantized", "dequantize", "error_bound", "qmax", "quantize", "wire_bytes"]

BLOCK = 256
"""Elements per block, by default."""


def qmax(bits: int) -> int:
    """The largest integer a value of ``bits`` bits (8 or 4) takes: 127 or 7."""
    if bits not in (8, 4):
        raise ValueError(f"quantization bits must be 8 or 4, got {bits!r}")
    return (1 << (bits - 1)) - 1


@dataclass(frozen=True)
class Quantized:
    """A quantized flat tensor: ``values`` (``numel`` int8, or ``ceil(numel / 2)``
    uint8 holding two int4 each), one fp32 ``scale`` per block, and the length."""

    values: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int
    block: int


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.detach().reshape(-1).float()
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def quantize(x: torch.Tensor, bits: int = 8, block: int = BLOCK) -> Quantized:
    """``x`` (any shape, floating) as ``bits``-bit integers with a scale per block
    of ``block`` elements (Note [block-wise quantization])."""
    top = qmax(bits)
    if block < 2 or block % 2:
        raise ValueError(f"quantization block must be an even number >= 2, got {block!r}")
    blocks = _blocks(x, block)
    scales = blocks.abs().amax(dim=1) / top
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-top, top).to(torch.int8).reshape(-1)
    if bits == 4:
        nibbles = (q + 8).to(torch.uint8).view(-1, 2)
        return Quantized((nibbles[:, 0] | (nibbles[:, 1] << 4))[: (x.numel() + 1) // 2], scales, x.numel(), 4, block)
    return Quantized(q[: x.numel()], scales, x.numel(), bits, block)


def dequantize(q: Quantized, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 tensor (flat, ``q.numel`` long) that ``q`` stands for; into ``out`` if given."""
    if q.bits == 4:
        low = (q.values & 0x0F).to(torch.int8) - 8
        high = (q.values >> 4).to(torch.int8) - 8
        ints = torch.stack([low, high], dim=1).reshape(-1)
    else:
        ints = q.values
    padded = ints.new_zeros(q.scales.numel() * q.block)
    padded[: q.numel] = ints[: q.numel]
    values = (padded.view(-1, q.block).float() * q.scales[:, None]).reshape(-1)[: q.numel]
    if out is None:
        return values
    return out.copy_(values.view_as(out))


def error_bound(x: torch.Tensor, bits: int = 8, block: int = BLOCK) -> torch.Tensor:
    """Per element of flat ``x``, the most its round trip may be off: half its block's step."""
    top = qmax(bits)
    blocks = _blocks(x, block)
    half_step = blocks.abs().amax(dim=1) / top / 2
    return half_step[:, None].expand_as(blocks).reshape(-1)[: x.numel()]


def wire_bytes(numel: int, bits: int = 8, block: int = BLOCK) -> int:
    """Bytes of ``numel`` elements quantized: the values and the scales."""
    return -(-numel * bits // 8) + -(-numel // block) * 4
