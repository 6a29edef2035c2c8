"""Block-wise quantization (Note [block-wise quantization] in
tandem/quantized/blocks.py): the round trip within its stated bound, on grids of
sizes, scales and bits, and the bound itself checked against exact arithmetic."""

from __future__ import annotations

import pytest
import torch

from tandem.quantized.blocks import dequantize, error_bound, qmax, quantize, wire_bytes


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 7, 255, 256, 257, 1000, 4096 + 3])
@pytest.mark.parametrize("block", [2, 64, 256])
def test_a_round_trip_is_within_half_a_step_of_its_block(bits: int, numel: int, block: int) -> None:
    g = torch.Generator().manual_seed(numel * 31 + block + bits)
    # Blocks of very different magnitudes: one block's scale must not flatten another's.
    x = torch.randn(numel, generator=g) * torch.logspace(-6, 3, numel)
    q = quantize(x, bits, block)
    back = dequantize(q)
    assert back.shape == (numel,) and back.dtype == torch.float32
    top = qmax(bits)
    # The bound, computed here from its definition (not by error_bound): half of absmax / qmax.
    padded = torch.cat([x, x.new_zeros((-numel) % block)]).view(-1, block)
    half = (padded.abs().amax(dim=1) / top / 2).repeat_interleave(block)[:numel]
    assert torch.equal(error_bound(x, bits, block), half)
    assert ((back - x).abs() <= half * (1 + 1e-6) + 1e-30).all()
    # Each block's largest element comes back (up to float rounding), and zeros stay zero.
    assert torch.allclose(back.view(-1).abs().max(), x.abs().max(), rtol=1e-6)
    assert (quantize(torch.zeros(numel), bits, block).scales == 0).all()
    assert (dequantize(quantize(torch.zeros(numel), bits, block)) == 0).all()
    assert q.values.numel() * q.values.element_size() + q.scales.numel() * 4 == wire_bytes(numel, bits, block)


def test_the_bound_is_reached_not_just_respected() -> None:
    # Values half-way between two steps: the error is exactly half a step (a bound that holds tightly).
    step = 1.0 / 127
    x = torch.tensor([1.0] + [(k + 0.5) * step for k in range(10)] + [0.0] * 245)
    err = (dequantize(quantize(x, 8, 256)) - x).abs()
    assert err[1:11].max() == pytest.approx(step / 2, rel=1e-4)


def test_int4_uses_all_fifteen_levels_and_packs_two_a_byte() -> None:
    x = torch.arange(-7, 8, dtype=torch.float32).repeat(2)[:30]
    q = quantize(x, 4, 30)
    assert q.values.dtype == torch.uint8 and q.values.numel() == 15
    assert torch.equal(dequantize(q), x)


@pytest.mark.parametrize("bad", [{"bits": 16}, {"bits": 2}, {"block": 3}, {"block": 0}])
def test_bad_settings_are_refused_by_name(bad: dict) -> None:
    with pytest.raises(ValueError, match="bits must be 8 or 4|block must be an even number"):
        quantize(torch.ones(8), **{"bits": 8, "block": 4, **bad})


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel,block", [(1, 2), (7, 2), (300, 256), (512, 256), (1001, 64)])
def test_rows_pack_as_each_row_quantized_alone_and_unpack_to_its_round_trip(bits: int, numel: int,
                                                                             block: int) -> None:
    from tandem.quantized.blocks import pack_rows, unpack_rows

    g = torch.Generator().manual_seed(numel + bits)
    rows = torch.randn(3, numel + 5, generator=g)[:, :numel] * torch.tensor([[1e-3], [1.0], [1e3]])  # not contiguous
    packed = pack_rows(rows, bits, block)
    assert packed.dtype == torch.uint8 and packed.shape == (3, wire_bytes(numel, bits, block))
    back = unpack_rows(packed, numel, bits, block)
    for r in range(3):
        # Note [quantized rows]: a row's bytes are its values then its scales, as if quantized alone.
        q = quantize(rows[r], bits, block)
        assert torch.equal(packed[r], torch.cat([q.values.view(torch.uint8), q.scales.view(torch.uint8)]))
        assert torch.equal(back[r], dequantize(q))
    with pytest.raises(ValueError, match=f"rows of {numel} elements at {bits} bits in blocks of {block} are"):
        unpack_rows(packed[:, 1:], numel, bits, block)
