"""Stage 3 of the memory planner: the bytes ``fully_shard`` holds per rank,
from the layouts of the units it would build (units.py; Note [stage 3 memory]).

# Note [stage 3 memory]
Stage 3 is computed from the layout of each fully_shard unit
(:func:`tandem.fsdp.plan_unit`, Note [unit buffers] in tandem/fsdp/layout.py),
rank 0's: every rank's shard buffer has the same size, and rank 0 holds the
most optimizer state (later ranks' last chunks can be shorter, and optimizer
state has no padding). Per unit, with ``S`` its shard elements, ``n`` its
parameters, ``w`` the world size:

- ``params``: the shard buffer, ``S`` elements of the parameters' dtype.
- ``grads``: the sharded gradients, ``S`` elements of the parameters' dtype,
  copied out of the reduce-scatter's input (Note [reduce-scatter in place] in
  tandem/fsdp/unit.py).
- ``optimizer``: ``optimizer_bytes_per_param`` per shard element of the
  trainable parameters. Per-tensor scalars (Adam's step count, 4 bytes per
  parameter) are not counted.
- ``gathered``, the peak while a unit computes, over forward and backward:
  the unsharded buffers (``w * S`` elements of the param dtype) of the root
  (kept from its forward to its backward), of the unit and of the units that
  enclose it (with ``reshard_after_forward=False``: of every unit that ran
  before it), plus one all-gather output of the same size as an unsharded
  buffer, the unit's own (alive with its unsharded buffer during the copy-out)
  or the prefetched neighbour's (the next unit in module order in forward, the
  one that finished forward before it in backward; Note [prefetch] in
  tandem/fsdp/schedule.py); a cast to ``param_dtype`` is written into the
  output (Note [gather input in place] in tandem/fsdp/unit.py).
- ``reducing``, gradients in flight in backward: the reduce-scatter input
  (``w * (S + n)`` elements of the reduce dtype, the ``n`` gradient flags of
  Note [gradient flags] in tandem/fsdp/unit.py included; its output is
  a chunk of it) of at most two units at once (two where a wait holds the
  host, as on gloo; one on NCCL: Note [reductions in flight] in
  tandem/fsdp/schedule.py), counted as the two largest, plus the full-size
  gradients (param dtype, zeros for frozen parameters) of the unit being
  reduced and of the units enclosing it (the root's first gradients wait for
  the root's last), the largest such sum over units.

Under ``CPUOffloadPolicy`` (``spec.cpu_offload``) ``params``, ``grads`` and
``optimizer`` are held on the host (``host``), and 0 on the device; each
gather copies its unit's shard to the device first, in ``param_dtype``, so
and the reduced gradients are copied back to the host from the reduce-scatter
input.

``total`` adds both peaks to the steady state: an upper bound without
activations. Activations, the autograd graph and the collectives' own scratch
space are not included, and ``ignored_params`` and ``reshard_after_forward=k``
are not modelled; with a measured step, Note [stage 3 peak] in phases.py
follows the phases of a step instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.planner.memory.estimate import FullyShardSpec, MemoryEstimate, UnitEstimate

__all__ = ["UnitBytes", "enclosing_units", "stage3_estimate", "unit_bytes"]


@dataclass(frozen=True)
class UnitBytes:
    """One unit's buffers in bytes (Note [stage 3 memory])."""

    shard: int             # the shard buffer
    full: int              # the unsharded buffer, and each all-gather output
    grads: int             # the sharded gradients
    optimizer: int         # optimizer state of the trainable shards
    full_grads: int        # the unsharded gradients, before the reduce-scatter input is built
    reduce_input: int      # the reduce-scatter's input (its output is a chunk of it)


def unit_bytes(u: UnitEstimate, spec: FullyShardSpec, optimizer_bytes_per_param: int) -> UnitBytes:
    param_dtype = spec.param_dtype or u.dtype
    reduce_dtype = spec.reduce_dtype or param_dtype
    layout, world = u.layout, u.layout.world_size
    flagged = layout.shard_numel + len(layout.params)
    trains = any(u.trainable)
    trainable_numel = sum(p.chunk_numel for p, t in zip(layout.params, u.trainable) if t)
    return UnitBytes(
        shard=layout.shard_numel * u.dtype.itemsize,
        full=layout.unsharded_numel * param_dtype.itemsize,
        grads=layout.shard_numel * u.dtype.itemsize if trains else 0,
        optimizer=trainable_numel * optimizer_bytes_per_param,
        full_grads=layout.numel * param_dtype.itemsize if trains else 0,
        reduce_input=world * flagged * reduce_dtype.itemsize if trains else 0,
    )


def enclosing_units(units: tuple[UnitEstimate, ...]) -> dict[str, list[str]]:
    """Each unit's name -> the names of the units that enclose it (the root among them)."""
    return {u.name: [v.name for v in units if _encloses(v.name, u.name)] for u in units}


def stage3_estimate(units: tuple[UnitEstimate, ...], spec: FullyShardSpec, optimizer_bytes_per_param: int
            ) -> MemoryEstimate:
    sizes = {u.name: unit_bytes(u, spec, optimizer_bytes_per_param) for u in units}
    enclosing = enclosing_units(units)
    steady = (sum(b.shard for b in sizes.values()), sum(b.grads for b in sizes.values()),
              sum(b.optimizer for b in sizes.values()))
    (params, grads, optimizer), host = ((0, 0, 0), sum(steady)) if spec.cpu_offload else (steady, 0)
    return MemoryEstimate(
        3,
        params=params,
        grads=grads,
        optimizer=optimizer,
        host=host,
        gathered=_gathered_peak(units, sizes, enclosing, spec.reshard_after_forward),
        reducing=sum(sorted(b.reduce_input for b in sizes.values())[-2:])
        + max(sum(sizes[n].full_grads for n in [name, *outer]) for name, outer in enclosing.items()),
        units=units,
    )


def _gathered_peak(units: tuple[UnitEstimate, ...], sizes: dict[str, UnitBytes], enclosing: dict[str, list[str]],
                   reshard_after_forward: bool) -> int:
    """The most bytes of unsharded buffers and all-gathers alive while one unit
    computes (Note [stage 3 memory]); ``units`` are in module order, root first."""
    forward = [u.name for u in units]
    finished = sorted(forward, key=lambda n: _post_rank(n, forward))  # the order forwards finish
    peak = 0
    for k, name in enumerate(forward):
        gathered = set(forward[:k + 1]) if not reshard_after_forward else {"", name, *enclosing[name]}
        neighbours = [name, *_next(forward, name)]
        if reshard_after_forward:
            neighbours += _next(finished[::-1], name)  # backward prefetches the one finished before
        in_flight = max(sizes[n].full for n in neighbours)
        peak = max(peak, sum(sizes[n].full for n in gathered) + in_flight)
    return peak


def _encloses(outer: str, inner: str) -> bool:
    return outer != inner and (outer == "" or inner.startswith(outer + "."))


def _post_rank(name: str, forward: list[str]) -> tuple[int, int]:
    """Sort key of the order in which units' forwards finish: after every unit
    they enclose, otherwise in module order."""
    last_inside = max(k for k, n in enumerate(forward) if n == name or _encloses(name, n))
    return last_inside, -forward.index(name)


def _next(order: Sequence[str], name: str) -> list[str]:
    k = order.index(name)
    return list(order[k + 1:k + 2])
