"""The memory planner: per-rank bytes of parameters, gradients and optimizer
state under ZeRO stages 0 to 3, before running anything.

Stage 0 is tandem's DistributedDataParallel (a full copy of everything on every
rank), stage 1 shards the optimizer state (:class:`tandem.ZeroOptimizer`),
stage 2 also the gradients (both over DDP's buckets, Note [stages 0 to 2
memory]), stage 3 also the parameters (Rajbhandari et al., 2020): that is
``tandem.fully_shard``, planned from the units it would build (Note [stage 3
memory]). ``tandem plan`` (tandem/tools/plan/) adds the activations, measured.

# Note [stages 0 to 2 memory]
The buckets are the ones DDP plans at construction (:func:`ddp_bucket_plan`);
every bucket is padded to a multiple of the world size ``w`` and the last one
carries one flag element (Note [flat buffer layout] in tandem/ddp/plan.py).
``params`` is every parameter of the model, frozen ones included, at every
stage. With ``F`` the flat bucket buffer (the non-solo buckets), ``G`` the
trainable parameters' bytes and ``M`` rank 0's owned elements (its shard of
each bucket without the padding; rank 0 owns the most):

- stage 0 ``grads``: ``F``, which DDP holds for the whole run and whose views
  are ``param.grad`` after a step (Note [gradients born in their bucket] in
  tandem/ddp/reducer.py), plus the ``param.grad`` of solo parameters (Note
  [solo buckets]: reduced in place, no bucket memory). Tensor-parallel
  parameters keep a ``param.grad`` of their own: ``G`` plus ``F``. With
  ``gradient_as_bucket_view`` nothing is solo: ``F`` only. A world of one
  builds no reducer: ``G`` only. ``reducing`` at stage 0: after
  ``zero_grad(set_to_none=True)`` backward makes fresh gradients that live
  beside ``F`` until it ends (``F`` again).
- stage 1 ``grads``: ``param.grad`` (this rank's local gradients, kept) plus the
  gradient shards ``F / w``; stage 2: ``F / w`` only (``param.grad`` is freed as
  its bucket is launched, and after backward).
- stages 1 and 2 ``optimizer``: the master copies of the owned elements (fp32,
  or the parameters' dtype when wider: :class:`tandem.ZeroOptimizer` steps
  those) plus ``optimizer_bytes_per_param`` per owned element; stage 0 has no
  master copy, ``optimizer_bytes_per_param`` per trainable element.
- ``reducing``, during backward: ``F`` is released between ZeRO steps and
  allocated again from forward to the end of backward; at stage 2 the
  ``param.grad`` of a bucket not yet launched add up to about one bucket (the
  largest is counted).
- ``gathered``, during the ZeRO step: the all-gather of the updated
  parameters, one output of each bucket's padded size and one input of its
  shard size, all alive until the last is written back (``F + F / w``).

Per-tensor scalars (Adam's step count, 4 bytes per tensor), the optimizer's
temporaries and the collectives' own scratch space are not counted. The
backward buffers and the step's gathers are never alive together: ``total``
adds the larger (and :meth:`MemoryEstimate.peak` adds activations to the
backward's).

# Note [stage 3 memory]
Stage 3 is computed from the layout of each fully_shard unit
(:func:`tandem.fsdp.plan_unit`, Note [unit buffers] in tandem/fsdp/layout.py),
rank 0's: every rank's shard buffer has the same size, and rank 0 holds the
most optimizer state (later ranks' last chunks can be shorter, and optimizer
state has no padding). Per unit, with ``S`` its shard elements, ``n`` its
parameters, ``w`` the world size:

- ``params``: the shard buffer, ``S`` elements of the parameters' dtype.
- ``grads``: the sharded gradients are views of the reduce-scatter output,
  ``S + n`` elements (the ``n`` gradient flags, Note [gradient flags] in
  tandem/fsdp/unit.py, share its storage) of the reduce dtype; a reduce dtype
  other than the parameters' casts them into a new ``S``-element tensor.
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
  tandem/fsdp/schedule.py), with its ``S``-element cast input under a
  ``param_dtype``.
- ``reducing``, gradients in flight in backward: the reduce-scatter input
  (``w * (S + n)`` elements of the reduce dtype) and output (``S + n``) of at
  most two units at once (Note [two reductions in flight] in
  tandem/fsdp/schedule.py), counted as the two largest, plus the full-size
  gradients (param dtype, zeros for frozen parameters) of the unit being
  reduced and of the units enclosing it (the root's first gradients wait for
  the root's last), the largest such sum over units.

Activations, the autograd graph and the collectives' own scratch space are
not included, and ``ignored_params``, CPU offloading and
``reshard_after_forward=k`` are not modelled.

# Note [local shapes]
Under tensor parallelism (Note [tensor-parallel parameters] in
tandem/dtensor.py) a rank holds its shard of a parameter, and tandem's data
parallelism reduces and shards that local tensor: DDP's buckets hold its
elements, fully_shard chunks its rows across the data-parallel ranks (Note
[2-D parameters] in tandem/fsdp/tensor_parallel.py). :func:`estimate_memory`
therefore takes the shapes one rank holds (``local_shapes``, tensor-parallel
rank 0's, the largest chunks) in place of the parameters' own, with
``world_size`` the data-parallel size, and every formula above applies to
them unchanged. ``tandem plan`` (tandem/tools/plan/) derives them from a
tensor-parallel plan. ``total`` adds the peaks of
``gathered`` and ``reducing`` to the steady state: an upper bound on what
fully_shard holds at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from tandem.ddp.plan import BucketPlan, ParamInfo, cap_bytes_from_mb, plan_ddp_buckets
from tandem.fsdp.layout import DEFAULT_MIN_UNIT_BYTES, UnitLayout, plan_unit
from tandem.fsdp.units import walk_unit

__all__ = ["FullyShardSpec", "MemoryEstimate", "UnitEstimate", "ddp_bucket_plan", "estimate_memory",
           "format_memory_table"]


@dataclass(frozen=True, kw_only=True)
class FullyShardSpec:
    """How ``tandem.fully_shard`` will be applied, for :func:`estimate_memory`'s stage 3."""

    units: tuple[str, ...] = ()
    """Submodules fully_shard is called on, by their names in ``named_modules()``
    (``("layers.0", "layers.1")``); the root ``""`` is always a unit, and the
    calls are taken bottom-up, as fully_shard requires."""
    param_dtype: torch.dtype | None = None
    """``MixedPrecisionPolicy.param_dtype``: the dtype units are gathered and
    computed in (None: the parameters' own)."""
    reduce_dtype: torch.dtype | None = None
    """``MixedPrecisionPolicy.reduce_dtype`` (None: ``param_dtype``)."""
    reshard_after_forward: bool = True
    """fully_shard's argument for the units in ``units``; the root keeps its
    parameters from forward to backward either way."""
    min_unit_bytes: int = DEFAULT_MIN_UNIT_BYTES
    """fully_shard's ``min_unit_bytes``: smaller units join the unit of an
    enclosing call (Note [tiny units] in tandem/fsdp/api.py)."""

    def __post_init__(self) -> None:
        units = (self.units,) if isinstance(self.units, str) else self.units
        if not all(isinstance(u, str) for u in units):
            raise ValueError(f"FullyShardSpec.units must be module names (str), got {self.units!r}")
        object.__setattr__(self, "units", tuple(units))
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"FullyShardSpec.{name} must be a floating torch.dtype or None, got {value!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"FullyShardSpec.reshard_after_forward must be a bool, got "
                             f"{self.reshard_after_forward!r} (partial resharding to k ranks is not planned)")
        if not isinstance(self.min_unit_bytes, int) or self.min_unit_bytes < 0:
            raise ValueError(f"FullyShardSpec.min_unit_bytes must be an int >= 0, got {self.min_unit_bytes!r}")


@dataclass(frozen=True)
class UnitEstimate:
    """One unit fully_shard would build (stage 3 of :func:`estimate_memory`)."""

    name: str                     # the module fully_shard is called on ("": the root)
    merged: tuple[str, ...]       # tiny units that joined it (Note [tiny units] in tandem/fsdp/api.py)
    layout: UnitLayout            # rank 0's buffers
    dtype: torch.dtype            # the parameters' dtype: shards, sharded gradients
    trainable: tuple[bool, ...]   # requires_grad of each parameter, in layout order


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at ZeRO ``stage`` (Notes [stages 0 to 2 memory] and
    [stage 3 memory]); activations are not included."""

    stage: int
    params: int
    grads: int
    optimizer: int
    gathered: int = 0                                       # parameters gathered (stages 1-3)
    reducing: int = 0                                       # gradients being reduced in backward
    units: tuple[UnitEstimate, ...] = field(default=(), repr=False)   # stage 3: the units planned
    buckets: BucketPlan | None = field(default=None, repr=False)      # stages 0-2: DDP's buckets

    @property
    def steady(self) -> int:
        """What is held between steps: parameters, gradients, optimizer state."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        """The steady state plus the transient peaks: at stage 3 both (an upper
        bound), at stages 0-2 the larger (they are never alive together)."""
        if self.stage == 3:
            return self.steady + self.gathered + self.reducing
        return self.steady + max(self.gathered, self.reducing)

    def peak(self, activations: int) -> int:
        """:attr:`total` with ``activations`` bytes alive from forward through
        backward (with backward's transients; at stage 3 with everything)."""
        if self.stage == 3:
            return self.total + activations
        return self.steady + max(self.gathered, self.reducing + activations)


def ddp_bucket_plan(params: Sequence[ParamInfo], world_size: int, *, zero_stage: int = 0,
                    bucket_cap_mb: float | None = None, bucket_cap_mb_list: Sequence[float] | None = None,
                    gradient_as_bucket_view: bool = False, check_finite: bool = False) -> BucketPlan:
    """The buckets ``tandem.DistributedDataParallel`` plans at construction for
    the trainable ``params`` (in registration order), with the arguments its
    reducer passes (GradReducer._build in tandem/ddp/reducer.py).

    DDP re-plans once after its first step (not at ZeRO stages, nor with
    ``find_unused_parameters`` without ``static_graph``), in the order the
    gradients arrived: the same parameters, grouped by the same caps.
    """
    return plan_ddp_buckets(params, list(reversed(range(len(params)))),
                            cap_bytes_from_mb(bucket_cap_mb, bucket_cap_mb_list), world_size,
                            zero=bool(zero_stage), gradient_as_bucket_view=gradient_as_bucket_view,
                            check_finite=check_finite)


def estimate_memory(model: nn.Module, world_size: int, *, optimizer_bytes_per_param: int = 8,
                    bucket_cap_mb: float | None = None, fsdp: FullyShardSpec | None = None,
                    gradient_as_bucket_view: bool = False,
                    local_shapes: Mapping[str, Sequence[int]] | None = None) -> list[MemoryEstimate]:
    """Per-rank memory of ``model`` at ZeRO stages 0, 1, 2 and 3.

    Args:
        model: the model; only its parameters' shapes, dtypes and
            ``requires_grad`` are read (stages 0-2 reduce the trainable ones, as
            DDP does, skipping ``_ddp_params_and_buffers_to_ignore``; stage 3
            shards every parameter, frozen ones included).
        world_size: ranks the state would be sharded over.
        optimizer_bytes_per_param: optimizer state per parameter element; 8 is
            Adam's two fp32 moments, 4 is SGD with momentum, 0 plain SGD.
        bucket_cap_mb: DDP's bucket cap (None: DDP's default, a 1 MiB first
            bucket then 25 MiB).
        fsdp: how ``tandem.fully_shard`` is applied, for stage 3 (default: to
            the root only, one unit holding the whole model).
        gradient_as_bucket_view: DDP's argument, for stage 0.
        local_shapes: the shape one rank holds of each parameter named here
            (by its name in ``named_parameters()``) in place of its own: the
            tensor-parallel shards (Note [local shapes]); ``world_size`` is
            then the data-parallel size.

    Returns:
        One estimate per stage (Notes [stages 0 to 2 memory] and [stage 3
        memory]); stages 0-2 carry DDP's bucket plan, stage 3 its units.
        Activations are not included (:meth:`MemoryEstimate.peak` adds them).

    Raises:
        ValueError: ``world_size < 1``, a negative ``optimizer_bytes_per_param``,
            no trainable parameters, or an ``fsdp.units`` name that is not a
            submodule of ``model``; and what ``fully_shard`` would reject: a
            unit mixing dtypes, a parameter tied across units, a 0-d parameter.

    .. warning::
        Stage 3's ``gathered`` assumes forward runs the units in module
        registration order; a model that calls its blocks in another order
        prefetches other neighbours.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if optimizer_bytes_per_param < 0:
        raise ValueError(f"optimizer_bytes_per_param must be >= 0, got {optimizer_bytes_per_param}")
    shapes = _shapes_of(model, local_shapes)
    ignored = frozenset(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    infos = [ParamInfo(n, math.prod(shapes[id(p)]), p.dtype, p.device)
             for n, p in model.named_parameters() if p.requires_grad and n not in ignored]
    if not infos:
        raise ValueError("the model has no trainable parameters")
    params = sum(math.prod(shapes[id(p)]) * p.element_size() for p in model.parameters())
    ddp = ddp_bucket_plan(infos, world_size, bucket_cap_mb=bucket_cap_mb,
                          gradient_as_bucket_view=gradient_as_bucket_view)
    zero = ddp_bucket_plan(infos, world_size, zero_stage=1, bucket_cap_mb=bucket_cap_mb)
    spec = fsdp if fsdp is not None else FullyShardSpec()
    units = _plan_units(model, world_size, spec, shapes)
    return [
        _stage0(ddp, infos, params, world_size, optimizer_bytes_per_param, gradient_as_bucket_view,
                tensor_parallel=bool(local_shapes)),
        *(_zero_stage(stage, zero, infos, params, world_size, optimizer_bytes_per_param) for stage in (1, 2)),
        _stage3(units, spec, optimizer_bytes_per_param),
    ]


def _stage0(plan: BucketPlan, infos: list[ParamInfo], params: int, world_size: int,
            optimizer_bytes_per_param: int, as_view: bool, tensor_parallel: bool = False) -> MemoryEstimate:
    trainable = sum(p.nbytes for p in infos)
    flat = _flat_bytes(plan)
    reducing = 0
    if world_size == 1:
        grads = trainable   # a world of one builds no reducer (tandem/ddp/module.py)
    elif tensor_parallel:
        grads = trainable + flat  # their .grad stays a tensor of its own
    else:  # Note [gradients born in their bucket]: .grad is a view of F, solo ones apart
        grads = flat + sum(b.numel * _itemsize(b.dtype) for b in plan.buckets if b.solo)
        # after zero_grad(set_to_none=True) backward makes fresh gradients, copied into F
        reducing = flat
    return MemoryEstimate(0, params=params, grads=grads, reducing=reducing,
                          optimizer=sum(p.numel for p in infos) * optimizer_bytes_per_param, buckets=plan)


def _zero_stage(stage: int, plan: BucketPlan, infos: list[ParamInfo], params: int, world_size: int,
                optimizer_bytes_per_param: int) -> MemoryEstimate:
    flat = _flat_bytes(plan)
    shards = sum(n // world_size * _itemsize(dtype) for (_, dtype), n in plan.buffer_numel.items())
    owned = [(min(b.padded_numel // world_size, b.numel), b.dtype) for b in plan.buckets]  # rank 0's
    masters = sum(n * torch.promote_types(dtype, torch.float32).itemsize for n, dtype in owned)
    optimizer = masters + sum(n for n, _ in owned) * optimizer_bytes_per_param
    trainable = sum(p.nbytes for p in infos)
    if stage == 1:
        grads, reducing = trainable + shards, flat
    else:
        grads, reducing = shards, flat + max(b.numel * _itemsize(b.dtype) for b in plan.buckets)
    return MemoryEstimate(stage, params=params, grads=grads, optimizer=optimizer,
                          gathered=flat + shards, reducing=reducing, buckets=plan)


def _shapes_of(model: nn.Module, local_shapes: Mapping[str, Sequence[int]] | None) -> dict[int, tuple[int, ...]]:
    """``id(parameter) -> the shape a rank holds`` (Note [local shapes])."""
    named = dict(model.named_parameters())
    unknown = sorted(set(local_shapes or ()) - set(named))
    if unknown:
        raise ValueError(f"local_shapes names {unknown}, not parameters of {type(model).__name__} "
                         f"(its parameters: {', '.join(list(named)[:6])}{', ...' if len(named) > 6 else ''})")
    shapes = {id(p): tuple(p.shape) for p in named.values()}
    for name, shape in (local_shapes or {}).items():
        shapes[id(named[name])] = tuple(int(s) for s in shape)
    return shapes


def _flat_bytes(plan: BucketPlan) -> int:
    """Bytes of the flat bucket buffers (solo buckets are in none)."""
    return sum(n * _itemsize(dtype) for (_, dtype), n in plan.buffer_numel.items())


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------- stage 3: the units

@dataclass
class _Draft:
    """A unit while the calls are replayed (it may still be absorbed)."""

    name: str
    params: list[tuple[str, nn.Parameter]]
    merged: list[str]
    mergeable: bool


def _plan_units(model: nn.Module, world_size: int, spec: FullyShardSpec, shapes: dict[int, tuple[int, ...]]
                ) -> tuple[UnitEstimate, ...]:
    """The units ``fully_shard`` builds when called bottom-up on ``spec.units``
    and the root, in module order (root first), with tiny units merged as
    fully_shard merges them (Note [tiny units] in tandem/fsdp/api.py).

    Args:
        model: the model, not yet sharded.
        world_size: ranks of the mesh.
        spec: the modules and options (:class:`FullyShardSpec`).
        shapes: ``id(parameter) -> the shape a rank holds`` (Note [local shapes]).

    Returns:
        One :class:`UnitEstimate` per unit, each with rank 0's layout.

    Raises:
        ValueError: a name in ``spec.units`` that is not a submodule, a unit
            mixing dtypes, a parameter tied across units, or a 0-d parameter.
    """
    modules = dict(model.named_modules())
    missing = [name for name in spec.units if name not in modules]
    if missing:
        known = ", ".join(repr(n) for n in list(modules)[1:9])
        raise ValueError(f"FullyShardSpec.units names {missing}, not submodules of {type(model).__name__} "
                         f"(its submodules: {known}{', ...' if len(modules) > 9 else ''})")
    wanted = set(spec.units) | {""}
    unit_of: dict[int, _Draft] = {}    # id(module given to fully_shard) -> its unit now
    owner: dict[int, _Draft] = {}      # id(parameter) -> the unit holding it
    for name in _post_order(model):    # bottom-up: every call after its submodules' calls
        if name not in wanted:
            continue
        draft = _replay_call(name, modules[name], unit_of, owner, spec.min_unit_bytes, shapes)
        for p in draft.params:
            owner[id(p[1])] = draft
        unit_of.update({key: draft for key, old in unit_of.items() if old.name in draft.merged})
        unit_of[id(modules[name])] = draft
    order = {name: k for k, name in enumerate(modules)}
    drafts = sorted({id(d): d for d in unit_of.values()}.values(), key=lambda d: order[d.name])
    return tuple(UnitEstimate(name=d.name, merged=tuple(d.merged),
                              layout=plan_unit([shapes[id(p)] for _, p in d.params], world_size, 0),
                              dtype=_unit_dtype(d), trainable=tuple(p.requires_grad for _, p in d.params))
                 for d in drafts)


def _replay_call(name: str, module: nn.Module, unit_of: dict[int, _Draft], owner: dict[int, _Draft],
                 min_unit_bytes: int, shapes: dict[int, tuple[int, ...]]) -> _Draft:
    """The unit of ``fully_shard(module)``: the parameters under ``module`` that no
    earlier unit holds, walked as fully_shard walks them (depth first, a
    module's own parameters before its children's), through tiny units (which
    it absorbs) and around the others."""
    entries, absorbed = walk_unit(module, lambda m: unit_of.get(id(m)), lambda u: u.mergeable,
                                  prefix=f"{name}." if name else "")
    params: dict[int, tuple[str, nn.Parameter]] = {}
    for fqn, _, p in entries:
        holder = owner.get(id(p))
        if holder is not None and holder not in absorbed:
            raise ValueError(f"parameter '{fqn}' is also under unit '{holder.name}' (tied weights?); "
                             "fully_shard would reject it: shard a module that contains every user of it")
        params[id(p)] = (fqn, p)
    draft = _Draft(name, list(params.values()), [n for a in absorbed for n in (a.name, *a.merged)], False)
    numel = sum(math.prod(shapes[id(p)]) for _, p in draft.params)
    draft.mergeable = numel * _unit_dtype(draft).itemsize < min_unit_bytes
    return draft


def _unit_dtype(draft: _Draft) -> torch.dtype:
    dtypes = {p.dtype for _, p in draft.params}
    if len(dtypes) > 1:
        listing = ", ".join(f"{fqn}: {p.dtype}" for fqn, p in draft.params)
        raise ValueError(f"unit '{draft.name}' would mix parameter dtypes ({listing}); fully_shard gathers "
                         "a unit with one collective: shard the submodules of each dtype separately")
    return dtypes.pop() if dtypes else torch.get_default_dtype()


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[str]:
    for name, child in module.named_children():
        yield from _post_order(child, _join(prefix, name))
    yield prefix


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# ---------------------------------------------------------------------- stage 3: the bytes

@dataclass(frozen=True)
class _UnitBytes:
    """One unit's buffers in bytes (Note [stage 3 memory])."""

    shard: int             # the shard buffer
    full: int              # the unsharded buffer, and each all-gather output
    cast_input: int        # the all-gather's input, cast to param_dtype (0 without a cast)
    grads: int             # the sharded gradients
    optimizer: int         # optimizer state of the trainable shards
    full_grads: int        # the unsharded gradients, before the reduce-scatter input is built
    reduce_buffers: int    # the reduce-scatter's input and output


def _unit_bytes(u: UnitEstimate, spec: FullyShardSpec, optimizer_bytes_per_param: int) -> _UnitBytes:
    param_dtype = spec.param_dtype or u.dtype
    reduce_dtype = spec.reduce_dtype or param_dtype
    layout, world = u.layout, u.layout.world_size
    shard_numel, flagged = layout.shard_numel, layout.shard_numel + len(layout.params)
    trains = any(u.trainable)
    if reduce_dtype == u.dtype:
        grads = flagged * reduce_dtype.itemsize  # views of the reduce-scatter output
    else:
        grads = shard_numel * u.dtype.itemsize
    trainable_numel = sum(p.chunk_numel for p, t in zip(layout.params, u.trainable) if t)
    return _UnitBytes(
        shard=shard_numel * u.dtype.itemsize,
        full=layout.unsharded_numel * param_dtype.itemsize,
        cast_input=shard_numel * param_dtype.itemsize if param_dtype != u.dtype else 0,
        grads=grads if trains else 0,
        optimizer=trainable_numel * optimizer_bytes_per_param,
        full_grads=layout.numel * param_dtype.itemsize if trains else 0,
        reduce_buffers=(world + 1) * flagged * reduce_dtype.itemsize if trains else 0,
    )


def _stage3(units: tuple[UnitEstimate, ...], spec: FullyShardSpec, optimizer_bytes_per_param: int
            ) -> MemoryEstimate:
    sizes = {u.name: _unit_bytes(u, spec, optimizer_bytes_per_param) for u in units}
    enclosing = {u.name: [v.name for v in units if _encloses(v.name, u.name)] for u in units}
    return MemoryEstimate(
        3,
        params=sum(b.shard for b in sizes.values()),
        grads=sum(b.grads for b in sizes.values()),
        optimizer=sum(b.optimizer for b in sizes.values()),
        gathered=_gathered_peak(units, sizes, enclosing, spec.reshard_after_forward),
        reducing=sum(sorted(b.reduce_buffers for b in sizes.values())[-2:])
        + max(sum(sizes[n].full_grads for n in [name, *outer]) for name, outer in enclosing.items()),
        units=units,
    )


def _gathered_peak(units: tuple[UnitEstimate, ...], sizes: dict[str, _UnitBytes], enclosing: dict[str, list[str]],
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
        in_flight = max(sizes[n].full + sizes[n].cast_input for n in neighbours)
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


# ---------------------------------------------------------------------- the table

def format_memory_table(estimates: list[MemoryEstimate], world_size: int) -> str:
    """A plain-text table of :func:`estimate_memory`'s result.

    Args:
        estimates: what :func:`estimate_memory` returned.
        world_size: the world size it was given (for the title).

    Returns:
        One row per stage, and for stage 3 a line on its units.
    """
    columns = ("params", "grads", "optimizer", "gathered", "reducing", "total")
    title = (f"ZeRO memory per rank at world size {world_size} (steady state, then the transient peaks: "
             "the larger of the two at stages 0-2, both at stage 3; activations not included)")
    rows = [title, f"{'stage':>5}" + "".join(f"  {c:>10}" for c in columns)]
    for e in estimates:
        values = (e.params, e.grads, e.optimizer, e.gathered, e.reducing, e.total)
        rows.append(f"{e.stage:>5}" + "".join(f"  {_size(v):>10}" for v in values))
    for e in estimates:
        if e.units:
            largest = max(e.units, key=lambda u: u.layout.unsharded_numel)
            merged = sum(len(u.merged) for u in e.units)
            rows.append(f"stage {e.stage}: {len(e.units)} fully_shard units ({merged} tiny units merged), "
                        f"the largest '{largest.name or '<root>'}' with {largest.layout.numel:,} elements")
    return "\n".join(rows)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
