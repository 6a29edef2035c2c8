"""The :class:`PlanReport`: what ``tandem plan`` found, per strategy
(:class:`StrategyMemory`), and how it reads (:meth:`PlanReport.describe`).
Plain data; :func:`tandem.tools.plan.plan_report` computes it."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.ddp.plan import BucketPlan
from tandem.planner.memory import MemoryEstimate
from tandem.planner.tensor_parallel import TensorParallelShard
from tandem.planner.traffic import Traffic, between_nodes
from tandem.tools.plan.measure import Measurement
from tandem.train.strategy import Strategy

__all__ = ["STRATEGIES", "PlanReport", "StrategyMemory"]

STRATEGIES = tuple(s.label for s in Strategy)  # Note [one strategy vocabulary] in tandem/train/strategy.py
"""The strategies every report plans, in this order; with ``hsdp`` replicas an
``HSDP RxS`` row follows, and is preferred to fully_shard when both fit (the
first that fits in order of communication and complexity is chosen)."""


@dataclass(frozen=True)
class StrategyMemory:
    """One strategy's bytes per rank (:class:`tandem.planner.MemoryEstimate`) with
    the measured activations."""

    name: str
    estimate: MemoryEstimate
    activations: int
    refused: str | None = None
    """Why tandem cannot run this strategy on this model (None: it can)."""
    step_peak: int | None = None  # Note [stage 3 peak] in tandem/planner/memory/phases.py
    """fully_shard's peak over the phases of a measured step (the largest of what
    each phase holds at once, rather than every transient added together);
    None: :meth:`MemoryEstimate.peak`."""

    @property
    def peak(self) -> int:
        """The most this rank holds at once: :attr:`step_peak` where a step was
        measured for fully_shard, else :meth:`MemoryEstimate.peak`."""
        return self.step_peak if self.step_peak is not None else self.estimate.peak(self.activations)


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    """Everything ``tandem plan`` prints (:meth:`describe`)."""

    model: str
    """The model's class name."""
    world_size: int
    """Data-parallel ranks planned for (all the ranks without tensor parallelism)."""
    tensor_parallel: int = 1
    """Ranks of each tensor-parallel group (``mesh["tp"]``); the mesh has
    ``world_size * tensor_parallel`` ranks."""
    tp_shards: tuple[TensorParallelShard, ...] = ()
    """The parameters ``tp_plan`` makes DTensors, with their local shapes."""
    optimizer: str
    """The optimizer's name."""
    elastic: bool = False
    """Planned for an elastic job: ZeRO-1/2 hold a buddy copy of a state shard, fully_shard
    of a parameter shard and its state."""
    optimizer_bytes_per_param: int
    """Its state per parameter element."""
    num_params: int
    """Parameter elements, frozen ones included (of the whole model)."""
    num_local: int
    """Parameter elements one rank holds (its tensor-parallel shards; ``num_params`` without)."""
    num_trainable: int
    """Elements DDP reduces on one rank."""
    param_bytes: int
    """Bytes of the parameters one rank holds."""
    buffers: tuple[tuple[str, int], ...]
    """Buffers DDP broadcasts before every forward (name, bytes); empty with ``broadcast_buffers=False``."""
    buckets: BucketPlan
    """The buckets DDP plans at construction."""
    param_names: tuple[str, ...]
    """The trainable parameters, by the indices the buckets use."""
    strategies: tuple[StrategyMemory, ...]
    """DDP, ZeRO-1, ZeRO-2 and fully_shard, in that order (ZeRO-1/2 refused
    with tensor-parallel parameters: :attr:`StrategyMemory.refused`)."""
    measurement: Measurement | None
    """What the sample forward measured (None: no sample given)."""
    grad_accum: int
    """Micro-batches per optimizer step."""
    device_memory: int | None
    """Bytes of one device, to choose a strategy (None: no choice)."""
    fsdp_units: tuple[str, ...]
    """The modules fully_shard is planned on (besides the root)."""
    hsdp: int = 1
    """Replicas of an HSDP mesh ``(hsdp, world_size // hsdp)`` planned beside
    fully_shard (1: none)."""
    traffic: tuple[tuple[str, Traffic], ...] = ()  # Note [traffic per step] in tandem/planner/traffic.py
    """Bytes one rank sends per step under DDP, ZeRO-1/2, fully_shard and HSDP,
    counted as ring algorithms send them (:class:`tandem.planner.Traffic`)."""
    nodes: int = 1
    """The nodes the ranks are on, ``world_size // nodes`` each."""
    activation_checkpointing: bool = False
    """Every block in ``measurement.blocks`` is checkpointed: the strategies'
    activations are :attr:`Measurement.checkpointed_bytes`."""
    warnings: tuple[str, ...]
    """What to change before launching."""

    def between_nodes(self, strategy: str, backend: str = "gloo") -> int | None:
        """Bytes per step over the links between :attr:`nodes` nodes under
        ``strategy`` (a name of :attr:`traffic`), both directions summed, with
        the ranks laid out node by node as ``tandem run`` numbers them; None for
        HSDP whose replicas are not the nodes."""
        # Note [bytes between nodes] in tandem/planner/traffic.py.
        t = dict(self.traffic)[strategy]
        replicas = self.hsdp if strategy.startswith("HSDP") else 1
        if replicas not in (1, self.nodes):
            return None
        return between_nodes(t, world_size=self.world_size, nodes=self.nodes, replicas=replicas,
                             backend=backend)

    @property
    def ranks(self) -> int:
        """Ranks of the whole mesh: ``world_size * tensor_parallel``."""
        return self.world_size * self.tensor_parallel

    @property
    def global_batch(self) -> int | None:
        """Per-rank batch x gradient accumulation x data-parallel size (the
        ranks of a tensor-parallel group share one batch; None: no sample)."""
        if self.measurement is None or self.measurement.batch_size is None:
            return None
        return self.measurement.batch_size * self.grad_accum * self.world_size

    @property
    def choice(self) -> StrategyMemory | None:
        """The first strategy (in :data:`STRATEGIES` order) that tandem can run
        and whose peak fits ``device_memory``; None when none does or no device
        memory was given."""
        if self.device_memory is None:
            return None
        preferred = sorted(self.strategies, key=lambda s: (s.name == "fully_shard", self.strategies.index(s)))
        return next((s for s in preferred if s.refused is None and s.peak <= self.device_memory), None)

    def describe(self) -> str:
        """The report as text (what ``tandem plan`` prints)."""
        return "\n".join(_describe(self))


# ---------------------------------------------------------------------- the text

def _describe(r: PlanReport) -> list[str]:
    mesh = r.tp_shards or r.tensor_parallel > 1
    where = (f"a {r.world_size} x {r.tensor_parallel} mesh (dp={r.world_size} x tp={r.tensor_parallel} = "
             f"{r.ranks} ranks)" if mesh else f"{r.world_size} rank(s)")
    lines = [f"tandem plan: {r.model} on {where}, optimizer {r.optimizer} "
             f"({r.optimizer_bytes_per_param} bytes of state per parameter element)", ""]
    frozen = r.num_local - r.num_trainable
    per_rank = f", {r.num_local:,} per rank" if mesh else ""
    lines.append(f"model        {r.num_params:,} parameter elements{per_rank} ({_size(r.param_bytes)})"
                 + (f", {frozen:,} of them frozen" if frozen else "")
                 + f"; {len(r.buffers)} buffer(s) broadcast by DDP")
    m = r.measurement
    if m is None:
        lines.append("batch        no sample given (--sample): activations not measured, not included below")
    else:
        if r.global_batch is not None:
            ranks = f"{r.world_size} data-parallel rank(s)" if mesh else f"{r.world_size} rank(s)"
            lines.append(f"batch        {m.batch_size} per rank x {r.grad_accum} accumulation step(s) x "
                         f"{ranks} = global batch {r.global_batch}"
                         + (f" (the {r.tensor_parallel} ranks of a tensor-parallel group share a batch)"
                            if mesh else ""))
        lines.append(f"activations  {_size(m.activation_bytes)} per rank per micro-batch "
                     "(measured: tensors saved for backward in one forward"
                     + ("; unsharded, in one process: an overestimate for the tensor-parallel layers)"
                        if mesh else ")"))
        if m.blocks:
            lines += _checkpoint_lines(r, m)
    if mesh:
        lines += ["", *_mesh_lines(r)]
    lines += ["", *_bucket_lines(r), "", *_memory_lines(r), "", *_traffic_lines(r)]
    if r.device_memory is not None:
        lines.append("")
        choice = r.choice
        if choice is None:
            best = min((s for s in r.strategies if s.refused is None), key=lambda s: s.peak)
            lines.append(f"fits in {_size(r.device_memory)}: nothing; the smallest is {best.name} at "
                         f"{_size(best.peak)} ({_size(best.peak - r.device_memory)} over): use more ranks, "
                         "a smaller per-rank batch with more accumulation steps, or activation checkpointing")
        else:
            margin = r.device_memory - choice.peak
            lines.append(f"fits in {_size(r.device_memory)}: {choice.name}, peak {_size(choice.peak)}, "
                         f"margin {_size(margin)} ({margin / r.device_memory:.0%})")
    if r.warnings:
        lines += ["", "warnings:", *(f"  - {w}" for w in r.warnings)]
    return lines


def _checkpoint_lines(r: PlanReport, m: Measurement, limit: int = 8) -> list[str]:
    used = "used below" if r.activation_checkpointing else "not used below: pass --activation-checkpointing"
    lines = [f"  with activation checkpointing of {len(m.blocks)} block(s): {_size(m.checkpointed_bytes)} "
             f"({used}); per block: saved without, kept with (its inputs)"]
    width = max(len(b.name) for b in m.blocks)
    for b in m.blocks[:limit]:
        lines.append(f"    {b.name:<{width}}  {_size(b.saved):>10}  {_size(b.inputs):>10}")
    if len(m.blocks) > limit:
        lines.append(f"    ... and {len(m.blocks) - limit} more")
    return lines


def _mesh_lines(r: PlanReport, limit: int = 12) -> list[str]:
    modules = {s.module for s in r.tp_shards}
    lines = [f"tensor parallel  {len(r.tp_shards)} parameter(s) of {len(modules)} module(s) are DTensors over "
             f"tp={r.tensor_parallel}; every size below is one rank's: its tensor-parallel shard (tp rank 0's, "
             f"the largest), then its share over dp={r.world_size}"]
    groups: dict[tuple[str, ...], int] = {}   # one line per plan key, parameter and layout
    for s in r.tp_shards:
        attr = s.name[len(s.module) + 1:] if s.name.startswith(f"{s.module}.") else s.name
        row = (f"{s.key}: {attr}" if s.key else attr, s.style, s.placement,
               "x".join(map(str, s.shape)) + " -> " + "x".join(map(str, s.local_shape)))
        groups[row] = groups.get(row, 0) + 1
    width = max((len(row[0]) for row in groups), default=0)
    for (what, style, placement, shapes), count in list(groups.items())[:limit]:
        lines.append(f"  {what:<{width}}  {style:<8}  {placement:<11}  {shapes}"
                     + (f"  (x{count})" if count > 1 else ""))
    if len(groups) > limit:
        lines.append(f"  ... and {len(groups) - limit} more")
    return lines


def _bucket_lines(r: PlanReport, limit: int = 8) -> list[str]:
    plan = r.buckets
    solo = sum(b.solo for b in plan.buckets)
    lines = [f"DDP buckets  {plan.describe()}" + (f", {solo} solo (reduced in place)" if solo else "")
             + "; re-planned after step 1 in gradient arrival order"]
    for b in plan.buckets[:limit]:
        names = [r.param_names[i] for i in b.params]
        span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        lines.append(f"  {b.index:>4}  {len(names):>4} param(s)  {_size(b.nbytes):>10}"
                     f"{'  solo' if b.solo else ''}  {span}")
    if len(plan.buckets) > limit:
        lines.append(f"  ... and {len(plan.buckets) - limit} more")
    return lines


def _memory_lines(r: PlanReport) -> list[str]:
    columns = ("params", "grads", "optimizer", "between", "activations", "peak")
    lines = ["memory per rank (between: held between steps; peak: adds activations and the "
             "transient buffers)",
             f"  {'':<12}" + "".join(f"{c:>12}" for c in columns)]
    for s in r.strategies:
        e = s.estimate
        if s.refused is not None:
            lines.append(f"  {s.name:<12}" + f"{'n/a':>12}  {s.refused}")
            continue
        values = (e.params, e.grads, e.optimizer + e.buddy, e.steady, s.activations, s.peak)
        lines.append(f"  {s.name:<12}" + "".join(f"{_size(v):>12}" for v in values))
    units = r.strategies[3].estimate.units
    lines.append(f"  fully_shard: {len(units)} unit(s) ("
                 + (", ".join(u.name or "<root>" for u in units[:4]) + (", ..." if len(units) > 4 else ""))
                 + (")" if r.strategies[1].refused else
                    "); ZeRO-1/2 step their shard in place (fp32 masters, in optimizer, only for narrower parameters)"))
    host = r.strategies[3].estimate.host
    if host:
        lines.append(f"  fully_shard: CPUOffloadPolicy: {_size(host)} per rank on the host (shards, gradients, "
                     "optimizer state), not in its row")
    if r.elastic:
        buddy = r.strategies[1].estimate.buddy
        lines.append(f"  elastic: ZeRO-1/2 also hold a copy of the previous rank's optimizer-state shard and "
                     f"rows of the parameters, and their own as before the last update ({_size(buddy)} at "
                     "ZeRO-1), fully_shard the same of its parameter and optimizer-state shards "
                     f"({_size(r.strategies[3].estimate.buddy)}), counted as optimizer; sent to the next rank "
                     "after every step")
    return lines


def _traffic_lines(r: PlanReport) -> list[str]:
    lines = [f"traffic per rank per step (bytes sent, ring algorithms; {r.grad_accum} micro-batch(es))"
             + (f"; and between the {r.nodes} nodes, both ways, over gloo" if r.nodes > 1 else "")]
    for name, t in r.traffic:
        hybrid = name.startswith("HSDP")
        parts = [f"{what} {_size(n)}" for what, n in (("all-gather", t.all_gather),
                                                        ("reduce-scatter", t.reduce_scatter)) if n]
        text = ", ".join(parts) + (f" within shard groups of {r.world_size // r.hsdp}" if hybrid and parts else "")
        if t.all_reduce:
            text += ("; " if parts else "") + f"all-reduce {_size(t.all_reduce)}" + (
                f" across the {r.hsdp} replicas" if hybrid else "")
        if r.nodes > 1:
            crossing = r.between_nodes(name)
            text += ("; between nodes: not modelled (HSDP's replicas are not the nodes)" if crossing is None
                     else f"; between nodes {_size(crossing)}")
        lines.append(f"  {name:<12}{_size(t.total):>12}  {text}")
    return lines


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
