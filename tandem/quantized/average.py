"""The average of a flat tensor across a group, sent in int8 or int4 blocks:
:class:`QuantizedAverage`.

# Note [a quantized average]
An all-reduce cannot sum quantized blocks (each rank's have their own scales),
so the average takes two collectives, as ZeRO++'s quantized gradient
reduce-scatter does (arXiv 2306.10209):

    x (+ residual)                       this rank's values, n elements, in W chunks
    q1 = quantize(each chunk)            blocks of Note [block-wise quantization]
    all-to-all q1                        rank r receives everyone's chunk r
    a_r = mean of the dequantized chunks this rank's chunk of the average
    q2 = quantize(a_r)
    all-gather q2                        everyone receives every chunk
    x = dequantize(all of q2)

The two collectives are collectives.py's (Note [quantized
collectives]), which fully_shard's quantized gathers and reductions use
alone. Each rank sends about 2 (W-1)/W n bytes at int8 (half at int4), plus 4 bytes
of scale a block, where a ring all-reduce of fp32 sends 2 (W-1)/W 4n: 3.9x
fewer bytes at int8 with blocks of 256, 7.5x at int4.

Error feedback: what the first quantization lost on this rank, ``e1 = x -
dequantize(q1)``, and what the second lost on the chunk this rank owns, ``e2
= a_r - dequantize(q2)``, are kept as the residual ``e1 + W e2`` (the second
on the owned chunk only) and added to the next call's input. The mean of the
ranks' next residuals is then exactly what this call's result missed, so over
any number of calls the sum of the results equals the sum of the true
averages less the mean of the last residuals: bounded by one call's error,
never growing (tests/quantized/test_quantized_average.py holds it to that).

Across nodes (``node_groups``, Note [ranks by node] in tandem/comm/node_groups.py), the ranks
of each node first reduce-scatter in fp32 (inside the node: no link crossed),
each rank's share of its node's mean is averaged across the nodes as above,
among the ranks holding the same share, and the node all-gathers the result
in fp32. Only that middle step crosses the link, on 1/L of the values for L
ranks a node: with 2 nodes of 2 ranks, 1/6 of the bytes a ring all-reduce of
fp32 sends over it at int8, where the flat exchange sends 1/3.4 (its
all-to-all sends two thirds of its chunks to the other node). The residual is
kept on the share this rank averages, times L (so that the mean of all the
ranks' residuals is again what the sum of the results missed).
"""

from __future__ import annotations

import torch

from tandem.comm.group import GroupComm
from tandem.comm.node_groups import NodeGroups
from tandem.quantized.blocks import BLOCK, qmax, unpack_rows
from tandem.quantized.collectives import all_gather_quantized, reduce_scatter_quantized

__all__ = ["QuantizedAverage"]


class QuantizedAverage:
    """Averages flat fp32 tensors over ``comm`` in ``bits``-bit blocks (Note
    [a quantized average]).

    Args:
        comm: the group.
        bits: 8 or 4.
        block: elements per block (even).
        node_groups: ``comm``'s ranks by node, to reduce inside each node first (``comm``
            must then be the default group).
    """

    def __init__(self, comm: GroupComm, bits: int = 8, block: int = BLOCK,
                 node_groups: NodeGroups | None = None) -> None:
        qmax(bits)  # 8 or 4, or a ValueError naming the value
        self.comm, self.bits, self.block, self.node_groups = comm, bits, block, node_groups
        self._across = None if node_groups is None else QuantizedAverage(node_groups.cross, bits, block)

    def average_(self, x: torch.Tensor, residual: torch.Tensor | None = None, *, tag: str = "") -> torch.Tensor:
        """Replace flat ``x`` by its average over the group, the same on every rank.
        With ``residual`` (flat, ``x``'s length, zeros at first) it is added to
        ``x`` first and then holds what this call lost. Returns ``x``."""
        if self.node_groups is not None and self._across is not None:
            return self._by_node(self.node_groups, self._across, x, residual, tag)
        size, n = self.comm.size, x.numel()
        if size == 1:
            return x
        chunk = -(-n // size)  # elements per rank's chunk (the last padded with zeros)
        work = x.new_zeros(size * chunk, dtype=torch.float32)
        work[:n].copy_(x.reshape(-1))
        if residual is not None:
            work[:n].add_(residual)
        mine = torch.empty(chunk, dtype=torch.float32, device=x.device)
        first = reduce_scatter_quantized(self.comm, mine, work.view(size, chunk), self.bits, self.block,
                                         tag=f"{tag} quantized chunks")
        if residual is not None:
            back = unpack_rows(first.sent, chunk, self.bits, self.block).reshape(-1)
            residual.copy_(work[:n] - back[:n])
        mine.div_(size)
        gathered = torch.empty(size, chunk, dtype=torch.float32, device=x.device)
        all_gather_quantized(self.comm, gathered, mine, self.bits, self.block, tag=f"{tag} quantized average")
        if residual is not None:  # what the second quantization lost of this rank's chunk
            lost = (mine - gathered[self.comm.rank]).mul_(size)
            start = self.comm.rank * chunk
            if start < n:
                end = min(n, start + chunk)
                residual[start:end].add_(lost[: end - start])
        x.copy_(gathered.view(-1)[:n].view_as(x))
        return x

    def _by_node(self, node_groups: NodeGroups, across: QuantizedAverage, x: torch.Tensor,
                 residual: torch.Tensor | None, tag: str) -> torch.Tensor:
        """Reduce inside the node, average this rank's share across the nodes, gather
        inside the node (Note [a quantized average])."""
        local, n = node_groups.local, x.numel()
        share = -(-n // local.size)
        work = x.new_zeros(local.size * share, dtype=torch.float32)
        work[:n].copy_(x.reshape(-1))
        mine = torch.empty(share, dtype=torch.float32, device=x.device)
        local.reduce_scatter(mine, work, tag=f"{tag} node sum")
        mine.div_(local.size)
        start = local.rank * share
        kept = None
        if residual is not None:  # this rank's share of it, times the ranks of a node
            padded = x.new_zeros(local.size * share, dtype=torch.float32)
            padded[:n].copy_(residual)
            kept = padded[start:start + share].div_(local.size)
        across.average_(mine, kept, tag=f"{tag} across nodes")
        if residual is not None and kept is not None:
            end = min(n, start + share)
            if start < end:
                residual[start:end].copy_(kept[: end - start].mul_(local.size))
        local.all_gather_into(work, mine, tag=f"{tag} node gather")
        x.copy_(work[:n].view_as(x))
        return x
