"""Two collectives that send int8 or int4 blocks (Note [block-wise quantization]
in blocks.py) and decode what they receive: :func:`all_gather_quantized` and
:func:`reduce_scatter_quantized`, each issued through a :class:`GroupComm`, so
that the ledger records the quantized payload, and waited on through a
:class:`QuantizedWork`.

# Note [quantized collectives]
Neither a sum nor a concatenation can be taken of quantized blocks by the
backend: each rank's blocks have their own scales. So:

- the all-gather sends this rank's row quantized (``pack_rows``: its values,
  then its scales) and every rank decodes every row it received: the result is
  each rank's input quantized and dequantized, the same on every rank;
- the reduce-scatter is an all-to-all: this rank quantizes the chunk meant for
  each rank on its own (its blocks start at the chunk's start), sends chunk r
  to rank r, and sums the chunks it received, decoded, in fp32, in rank order.
  Values that must arrive exact (fully_shard's gradient flags, which count the
  ranks that produced a gradient) travel beside each chunk as fp32, summed the
  same way.

Each rank hands the collective ``wire_bytes(n)`` bytes a row: about a quarter
of fp32's at int8 and an eighth at int4, the scales (4 bytes a block) aside.
The decoding happens in :meth:`QuantizedWork.wait`, after the collective has
completed, one row at a time, so that no fp32 copy of the whole received
payload is alive beside the output. ZeRO++ (arXiv 2306.10209) sends its
weights' all-gather (qwZ) and its gradients' reduce-scatter (qgZ) so; the
quantized average (average.py) is the reduce-scatter followed by
the all-gather.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.comm.group import GroupComm, Work
from tandem.quantized.blocks import BLOCK, fp32_rows, pack_rows, unpack_rows, wire_bytes

__all__ = ["QuantizedWork", "all_gather_quantized", "reduce_scatter_quantized"]


class QuantizedWork:
    """A quantized collective in flight: :meth:`wait` waits for it and decodes
    what arrived into the output it was given.

    Attributes:
        sent: the payload this rank handed to the collective (uint8, one row per
            destination), kept alive until the collective has completed.
    """

    __slots__ = ("_work", "_decode", "sent")

    def __init__(self, work: Work, decode: Callable[[], None], sent: torch.Tensor) -> None:
        self._work = work
        self._decode: Callable[[], None] | None = decode
        self.sent = sent

    def wait(self) -> None:
        """Wait for the collective and decode its result (once)."""
        if self._decode is None:
            return
        self._work.wait()
        decode, self._decode = self._decode, None
        decode()

    def is_completed(self) -> bool:
        """Whether the collective has completed (:meth:`wait` then only decodes)."""
        return self._work.is_completed()


def all_gather_quantized(comm: GroupComm, output: torch.Tensor, input: torch.Tensor, bits: int = 8,
                         block: int = BLOCK, *, tag: str = "", async_op: bool = False) -> QuantizedWork:
    """Every rank's flat ``input`` (``n`` elements) quantized, gathered and
    decoded into ``output`` (``comm.size * n`` elements, any floating dtype), in
    rank order (Note [quantized collectives]). Rank r's part of ``output`` is
    rank r's ``input`` quantized in blocks of ``block`` and dequantized."""
    n = input.numel()
    if output.numel() != comm.size * n:
        raise ValueError(f"all_gather_quantized: output has {output.numel()} elements, expected "
                         f"{comm.size} ranks x {n}")
    sent = pack_rows(input.reshape(1, n), bits, block)
    received = torch.empty(comm.size, sent.shape[1], dtype=torch.uint8, device=input.device)
    work = comm.all_gather_into(received.view(-1), sent.view(-1), tag=tag, async_op=True)

    def decode() -> None:
        rows = output.view(comm.size, n)
        for r in range(comm.size):  # a row at a time: Note [quantized collectives]
            rows[r].copy_(unpack_rows(received[r:r + 1], n, bits, block)[0])
    handle = QuantizedWork(work, decode, sent)
    if not async_op:
        handle.wait()
    return handle


def reduce_scatter_quantized(comm: GroupComm, output: torch.Tensor, input: torch.Tensor, bits: int = 8,
                             block: int = BLOCK, *, exact: torch.Tensor | None = None, tag: str = "",
                             async_op: bool = False) -> QuantizedWork:
    """The sum over ranks of row ``comm.rank`` of each rank's ``input`` (``comm.size``
    rows of ``n``), each row quantized on its own, sent by an all-to-all and
    summed in fp32 into ``output[:n]`` (Note [quantized collectives]).

    Args:
        exact: ``comm.size`` rows of ``k`` values sent as fp32 beside the chunks
            and summed exactly into ``output[n:]`` (``output`` then has ``n + k``
            elements).
    """
    size, n = input.shape
    k = 0 if exact is None else exact.shape[1]
    if size != comm.size or output.numel() != n + k or (exact is not None and exact.shape[0] != size):
        raise ValueError(f"reduce_scatter_quantized: input {tuple(input.shape)}, exact "
                         f"{None if exact is None else tuple(exact.shape)} and output of {output.numel()} "
                         f"elements do not fit a group of {comm.size}: input (size, n), exact (size, k), "
                         "output n + k")
    sent = pack_rows(input, bits, block)
    if exact is not None:
        sent = torch.cat([sent, exact.to(torch.float32).contiguous().view(torch.uint8)], dim=1)
    received = torch.empty_like(sent)
    work = comm.all_to_all(received, sent, tag=tag, async_op=True)
    value_bytes = wire_bytes(n, bits, block)

    def decode() -> None:
        total = torch.zeros(n + k, dtype=torch.float32, device=output.device)
        exact_sums = fp32_rows(received[:, value_bytes:]) if k else None
        for r in range(size):  # in rank order, a row at a time
            total[:n].add_(unpack_rows(received[r:r + 1, :value_bytes], n, bits, block)[0])
            if exact_sums is not None:
                total[n:].add_(exact_sums[r])
        output.copy_(total.view_as(output))
    handle = QuantizedWork(work, decode, sent)
    if not async_op:
        handle.wait()
    return handle
