"""Block-wise quantization of a flat tensor to int8 or int4, and back:
:func:`quantize`, :func:`dequantize`, :func:`error_bound`; rows of a 2-D
tensor as the bytes a collective sends, each row quantized on its own:
:func:`pack_rows`, :func:`unpack_rows`. Pure arithmetic, no communication.

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

# Note [quantized rows]
A quantized collective sends one payload per rank (an all-gather's own row, an
all-to-all's chunk for each peer), and each must decode without the others:
its blocks start at the row's first element and the last one is padded, as if
the row were quantized alone. :func:`pack_rows` lays each row out as its values
then its scales, ``wire_bytes(n)`` bytes for ``n`` elements, so that the rows of
a ``(rows, wire_bytes(n))`` uint8 tensor travel as one collective's input.
Quantizing all rows in one call (each padded to whole blocks) gives the same
bytes as a call per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BLOCK", "Quantized", "dequantize", "error_bound", "fp32_rows", "pack_rows", "qmax", "quantize",
           "unpack_rows", "wire_bytes"]

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
    values = _decode(q.values.view(1, -1), q.scales.view(1, -1), q.numel, q.bits, q.block).view(-1)
    if out is None:
        return values
    return out.copy_(values.view_as(out))


def _decode(values: torch.Tensor, scales: torch.Tensor, numel: int, bits: int, block: int) -> torch.Tensor:
    """Rows of ``numel`` fp32 from each row's stored values (int8, or uint8 holding
    two int4) and its fp32 scales, one per block."""
    if bits == 4:
        low = (values & 0x0F).to(torch.int8) - 8
        high = (values >> 4).to(torch.int8) - 8
        ints = torch.stack([low, high], dim=2).reshape(values.shape[0], -1)
    else:
        ints = values.view(torch.int8)
    padded = ints.new_zeros(ints.shape[0], scales.shape[1] * block)
    padded[:, :numel] = ints[:, :numel]
    return (padded.view(ints.shape[0], -1, block).float() * scales[:, :, None]).view(ints.shape[0], -1)[:, :numel]


def fp32_rows(raw: torch.Tensor) -> torch.Tensor:
    """Rows of bytes read as fp32, from a contiguous copy (a slice's start may not be aligned)."""
    return raw.clone(memory_format=torch.contiguous_format).view(torch.float32)


def pack_rows(rows: torch.Tensor, bits: int = 8, block: int = BLOCK) -> torch.Tensor:
    """Each row of the 2-D ``rows`` quantized on its own and laid out as bytes, its
    values then its scales (Note [quantized rows]): a ``(len(rows),
    wire_bytes(n))`` uint8 tensor for rows of ``n`` elements, which
    :func:`unpack_rows` reads."""
    count, n = rows.shape
    width = -(-n // block) * block
    if width == n:
        flat = rows.reshape(-1)
    else:  # each row padded to whole blocks, so that no block spans two rows
        padded = torch.zeros(count, width, dtype=torch.float32, device=rows.device)
        padded[:, :n] = rows
        flat = padded.view(-1)
    q = quantize(flat, bits, block)
    values = q.values.view(torch.uint8).view(count, width * bits // 8)[:, : -(-n * bits // 8)]
    return torch.cat([values, q.scales.view(torch.uint8).view(count, width // block * 4)], dim=1)


def unpack_rows(payload: torch.Tensor, numel: int, bits: int = 8, block: int = BLOCK) -> torch.Tensor:
    """The fp32 rows, ``(len(payload), numel)``, that :func:`pack_rows` wrote as ``payload``.

    Raises:
        ValueError: ``payload``'s rows are not ``wire_bytes(numel, bits, block)`` long.
    """
    value_bytes = -(-numel * bits // 8)
    if payload.dim() != 2 or payload.shape[1] != wire_bytes(numel, bits, block):
        raise ValueError(f"unpack_rows: rows of {numel} elements at {bits} bits in blocks of {block} are "
                         f"{wire_bytes(numel, bits, block)} bytes, got a payload of shape {tuple(payload.shape)}")
    if not numel:
        return torch.zeros(payload.shape[0], 0, device=payload.device)
    scales = fp32_rows(payload[:, value_bytes:])
    return _decode(payload[:, :value_bytes], scales, numel, bits, block)


def error_bound(x: torch.Tensor, bits: int = 8, block: int = BLOCK) -> torch.Tensor:
    """Per element of flat ``x``, the most its round trip may be off: half its block's step."""
    top = qmax(bits)
    blocks = _blocks(x, block)
    half_step = blocks.abs().amax(dim=1) / top / 2
    return half_step[:, None].expand_as(blocks).reshape(-1)[: x.numel()]


def wire_bytes(numel: int, bits: int = 8, block: int = BLOCK) -> int:
    """Bytes of ``numel`` elements quantized: the values and the scales."""
    return -(-numel * bits // 8) + -(-numel // block) * 4
