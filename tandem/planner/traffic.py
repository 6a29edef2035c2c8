"""The traffic planner: bytes one rank sends per optimizer step under DDP,
fully_shard and HSDP, from the planned buckets and units (nothing runs).

# Note [traffic per step]
Counted as ring algorithms send (NCCL's and gloo's for large messages), per
rank: an all-gather of an ``n``-element input over ``g`` ranks sends
``(g - 1) * n`` elements, a reduce-scatter of a ``g * m``-element input
``(g - 1) * m``, an all-reduce of ``n`` elements ``2 * (g - 1) / g * n``.
Per fully_shard unit (:class:`tandem.planner.UnitEstimate`, rank 0's layout:
every rank's shard buffer has the same size) and step:

- all-gathers over the shard group of its shard buffer, in ``param_dtype``:
  one per micro-batch in forward, and one more in backward unless the unit
  keeps its parameters (the root, or ``reshard_after_forward=False``);
- if it has trainable parameters, one reduce-scatter over the shard group of
  the gradients and their flags (Note [gradient flags] in
  tandem/fsdp/unit.py), ``shard + n`` elements per rank, in ``reduce_dtype``;
  accumulation micro-batches without gradient sync reduce nothing;
- under HSDP (Note [hybrid sharding] in tandem/fsdp/unit.py), then one
  all-reduce of that reduced shard over the replicate group.

DDP, for comparison: one all-reduce of each bucket (padded) per step.
Which link carries the bytes is what HSDP is for: its gathers and
reduce-scatters stay within a shard group (a node), and only the all-reduce
of ``1 / shards`` of the gradients crosses the replicas.

# Note [bytes between nodes]
What crosses the links between nodes, per step, summed over both directions
(:func:`between_nodes`), with the ranks laid out node by node as ``tandem
run`` numbers them. A ring over a group sends each rank's bytes to the next
rank of the group: over the whole world the ring crosses from one node to the
next ``nodes`` times, so ``nodes`` ranks' sends cross; under HSDP the shard
groups stay within a node and each replicate group has one rank per node, so
every rank's all-reduce crosses and nothing else does. gloo (torch's
ProcessGroupGloo, 2.13) runs ``reduce_scatter_tensor`` as an all-reduce of the
whole input, which sends twice a ring reduce-scatter's bytes: measured on two
namespace nodes (benchmarks/bench_nodes.py), an all-reduce, a reduce-scatter
and an all-gather of 4 MiB over 2 x 2 ranks put 1.50, 1.50 and 0.75 times 4 MiB
on the link each way. ZeRO-1/2 (:func:`zero_traffic`): a reduce-scatter of
each bucket (on gloo an all-reduce in place, the same bytes without the clone:
Note [gloo's reduce-scatter] in tandem/comm/group.py), then an all-gather of
each bucket's updated parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.ddp.plan import BucketPlan
from tandem.planner.memory import FullyShardSpec, UnitEstimate

__all__ = ["Traffic", "between_nodes", "ddp_traffic", "fully_shard_traffic", "zero_traffic"]


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends per optimizer step, by collective, counted as ring
    algorithms send them: over ``g`` ranks, an all-gather of an ``n``-element
    input sends ``(g - 1) * n`` elements, a reduce-scatter of a ``g * m``-element
    input ``(g - 1) * m``, an all-reduce of ``n`` elements ``2 * (g - 1) / g * n``."""

    # Note [traffic per step] at the top of this file.

    all_gather: int = 0
    reduce_scatter: int = 0
    all_reduce: int = 0

    @property
    def total(self) -> int:
        return self.all_gather + self.reduce_scatter + self.all_reduce


def ddp_traffic(plan: BucketPlan, world_size: int) -> Traffic:
    """One ring all-reduce of every bucket of ``plan`` over ``world_size`` ranks."""
    numel = sum(b.padded_numel * b.dtype.itemsize for b in plan.buckets)
    return Traffic(all_reduce=_all_reduce(numel, world_size))


def zero_traffic(plan: BucketPlan, world_size: int) -> Traffic:
    """ZeRO-1/2 over ``world_size`` ranks: each bucket reduce-scattered, and its
    parameters all-gathered after the step (Note [bytes between nodes])."""
    numel = sum(b.padded_numel * b.dtype.itemsize for b in plan.buckets)
    shard = numel // world_size
    return Traffic(reduce_scatter=(world_size - 1) * shard, all_gather=(world_size - 1) * shard)


def between_nodes(traffic: Traffic, *, world_size: int, nodes: int, replicas: int = 1,
                  backend: str = "gloo") -> int:
    """Bytes per step over the links between ``nodes`` nodes, both directions
    summed, for ``traffic`` of one rank (Note [bytes between nodes]).

    Args:
        traffic: one rank's bytes per step (:func:`ddp_traffic`, ...).
        world_size: every rank of the job, ``world_size // nodes`` per node.
        nodes: how many nodes.
        replicas: HSDP's replicate groups, one rank per node (``replicas ==
            nodes``); 1: every collective is over the whole world.
        backend: ``"gloo"`` (its reduce-scatter is an all-reduce) or ``"nccl"``.

    Raises:
        ValueError: a layout this does not model.
    """
    if nodes < 1 or world_size % nodes or replicas not in (1, nodes):
        raise ValueError(f"between_nodes: world_size={world_size} on nodes={nodes} with replicas={replicas}: "
                         "the ranks must divide evenly over the nodes, and HSDP replicate across them")
    if nodes == 1:
        return 0
    if replicas > 1:  # shard groups within nodes; replicate groups cross at every edge
        return world_size * traffic.all_reduce
    scatter = traffic.reduce_scatter * (2 if backend == "gloo" else 1)
    return nodes * (traffic.all_gather + scatter + traffic.all_reduce)


def fully_shard_traffic(units: Sequence[UnitEstimate], spec: FullyShardSpec, *, replicate: int = 1,
                        micro_batches: int = 1) -> Traffic:
    """What fully_shard's ``units`` send per step: per unit, all-gathers of its
    shard in ``param_dtype`` (one per micro-batch in forward, and as many again
    in backward unless the unit keeps its parameters: the root, or
    ``reshard_after_forward=False``), one reduce-scatter of its
    gradients in ``reduce_dtype`` if it has trainable parameters, and under
    HSDP an all-reduce of the reduced shard across the replicas.

    Args:
        units: the planned units (``estimate_memory(...)[3].units``), laid out
            over the shard group: its size is their layout's world size.
        spec: how fully_shard is applied (dtypes, ``reshard_after_forward``).
        replicate: ranks of the replicate group under HSDP (1: plain fully_shard).
        micro_batches: forwards and backwards per optimizer step, the last
            one synchronising gradients.

    Raises:
        ValueError: ``replicate`` or ``micro_batches`` below 1.
    """
    # Note [traffic per step] at the top of this file.
    if replicate < 1 or micro_batches < 1:
        raise ValueError(f"replicate and micro_batches must be >= 1, got {replicate} and {micro_batches}")
    gather = scatter = reduce = 0
    for u in units:
        shards = u.layout.world_size
        param_dtype = spec.param_dtype or u.dtype
        reduce_dtype = spec.reduce_dtype or param_dtype
        keeps = u.name == "" or not spec.reshard_after_forward
        gathers = micro_batches * (1 if keeps else 2)
        gather += gathers * (shards - 1) * u.layout.shard_numel * param_dtype.itemsize
        if any(u.trainable):
            flagged = (u.layout.shard_numel + len(u.layout.params)) * reduce_dtype.itemsize
            scatter += (shards - 1) * flagged
            reduce += _all_reduce(flagged, replicate)
    return Traffic(all_gather=gather, reduce_scatter=scatter, all_reduce=reduce)


def _all_reduce(nbytes: int, ranks: int) -> int:
    return 2 * (ranks - 1) * nbytes // ranks
