"""``tandem.prepare``: data parallelism for a training loop the user keeps writing
themselves (the role of Hugging Face Accelerate's ``Accelerator.prepare``).

One call turns a one-process script's model, optimizer and DataLoaders into
their distributed counterparts, returned in the order given::

    world = tandem.init()
    model, optimizer, train_loader, eval_loader = tandem.prepare(
        model, optimizer, train_loader, eval_loader, strategy="zero1")
    for epoch in range(epochs):
        for x, y in train_loader:             # this rank's share, on world.device
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

There is no accelerator object and no hidden global: what the loop needs later
are plain functions of the returned objects, :func:`no_sync` (gradient
accumulation), :func:`gather_for_metrics` (evaluation, each sample once) and
:func:`unwrap` (the user's module, to save or inspect).

The loaders are :class:`tandem.data.loader.DistributedLoader` s (Note
[prepared loaders] in tandem/data/loader.py).

# Note [rebuilt optimizers]
ZeRO and fully_shard need an optimizer that the user's cannot be: a
:class:`tandem.ZeroOptimizer` steps only this rank's shard of each bucket, and
``fully_shard`` replaces every parameter by a sharded DTensor, so an optimizer
built before it would step tensors the model no longer uses. ``prepare``
therefore builds a new optimizer of the same class over the same parameter
groups (matched by parameter identity, then by name across fully_shard), with
each group's hyper-parameters and the constructor's defaults. The user's
optimizer must not have stepped yet (its state would be lost), and a learning-
rate scheduler must be built on the returned optimizer, after ``prepare``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from tandem.comm.group import GroupComm
from tandem.control.generation import ElasticConfig
from tandem.comm.node_groups import node_mesh
from tandem.data.loader import LoaderSpec, distributed_loader, loader_spec
from tandem.diloco import DiLoCo, DiLoCoConfig
from tandem.fsdp import FSDPModule
from tandem.fsdp.regroup import check_regroupable
from tandem.train.strategy import Strategy, apply_strategy, param_names
from tandem.train.stragglers import LoopPhases, PhaseGather, StragglerWatch
from tandem.elastic.run import elastic_config
from tandem.elastic.loop import make_elastic
from tandem.checkpoint.state import unwrap_model

__all__ = ["Strategy", "no_sync", "prepare", "unwrap"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- prepare

def prepare(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *dataloaders: DataLoader,
            strategy: str | Strategy = "ddp", wrapper_kwargs: Mapping[str, Any] | None = None,
            shard_units: tuple[type[nn.Module], ...] = (), device: torch.device | str | None = None,
            seed: int | None = None, move_batches: bool = True,
            elastic: bool | ElasticConfig | None = None, straggler_every: int | None = 4,
            diloco: DiLoCoConfig | None = None) -> tuple[Any, ...]:
    """Make a model, its optimizer and DataLoaders data-parallel, for a training
    loop the caller writes.

    A collective: call it on every rank, with the same arguments, after
    ``tandem.init()`` (which also makes a world of one, so the same script runs
    as one process).

    Args:
        model: the plain module (not yet wrapped). It is moved to ``device``
            first, then wrapped according to ``strategy``.
        optimizer: built over ``model``'s parameters, not stepped yet; None for
            inference. Kept as it is under ``"ddp"``; otherwise rebuilt, of the
            same class over the same parameter groups and hyper-parameters (ZeRO
            steps only this rank's shards, and ``fully_shard`` replaces the
            parameters): use the returned one, and build schedulers on it.
        *dataloaders: ``torch.utils.data.DataLoader`` s over map-style datasets,
            with the default sampler (``shuffle=True`` or ``False``). Each is
            rebuilt over a :class:`tandem.DistributedSampler`, with the
            original's batch size (per rank), collate function, workers,
            pinning, ``drop_last`` and generator.
        strategy: ``"ddp"``, ``"zero1"``, ``"zero2"``, or ``"fsdp"`` /
            ``"fully_shard"`` (see :class:`Strategy`).
        wrapper_kwargs: keyword arguments for ``tandem.DistributedDataParallel``
            (``"ddp"``, ``"zero1"``, ``"zero2"``: e.g. ``bucket_cap_mb``,
            ``find_unused_parameters``, ``zero_config``) or for every
            ``tandem.fully_shard`` call (``"fsdp"``: e.g. ``mp_policy``).
        shard_units: ``"fsdp"`` only: module classes (e.g. a transformer
            block) whose instances each become a unit of their own, sharded
            bottom-up before the root; by default the items of every
            ``nn.ModuleList`` do, the units ``tandem check`` and ``tandem
            plan`` make too.
        device: where the model and batches go. Default: ``cuda:<current
            device>`` when the backend is NCCL (``tandem.init`` made it
            current), else the CPU.
        seed: base seed of every shuffling loader's order (``seed + epoch``
            each epoch). Default: the initial seed of the loader's generator
            (the ``generator=`` given to the DataLoader), else 0.
        move_batches: move every tensor of each batch to ``device`` (nested in
            tuples, lists, dicts and dataclasses).
        elastic: keep training when a rank dies, and admit replacements: True,
            or an :class:`~tandem.control.generation.ElasticConfig`; None follows
            ``tandem run --elastic`` (``TANDEM_ELASTIC=1``). Every strategy: under
            ZeRO and fully_shard each rank also holds a copy of the previous
            rank's shard, so that a lost rank's shard survives. The
            optimizer returned is then an :class:`~tandem.elastic.loop.ElasticOptimizer`
            whose ``step()`` drops a step that a rank's death interrupted
            (``optimizer.step_abandoned``), regroups, and lets the loaders give
            that step's samples again; ``optimizer.world_changes`` lists the changes.
        straggler_every: every this many optimizer steps the ranks share how
            long each phase of their steps took (waiting for data, compute,
            waiting on communication, the optimizer), and rank 0 says on stderr
            when a rank is consistently slower than the others in a phase
            (``tandem: rank 2 slow: data 3.1x the median``). One small
            all-gather each time; None turns it off. Not yet with ``elastic``.
        diloco: train with local steps (DiLoCo, LocalSGD, Streaming DiLoCo:
            :class:`tandem.DiLoCoConfig`), synced in the optimizer's ``step()``
            every ``diloco.sync_every`` steps. With ``strategy="ddp"`` the model
            is not wrapped: each rank trains its own copy between syncs. With
            ``strategy="fsdp"`` the model is sharded over the ranks of each node
            (every step's collectives stay inside it) and the nodes sync their
            shards (the node of each rank is ``GROUP_RANK``, else the host).
            ``tandem.DiLoCo.of(optimizer)`` is the object that syncs: save its
            ``state_dict()`` with a checkpoint, and ``flush()`` it at the end.
            With ``elastic``, a change of world takes every rank back to the
            last sync and the new world trains the steps since again (every
            sample once); it needs ``strategy="ddp"`` and syncs of the whole
            model (one fragment, no overlap, no mix), and every epoch's end is a
            sync too. Not with ``"zero1"`` or ``"zero2"``.

    Returns:
        ``(model, optimizer, *dataloaders)``, in the order given: the wrapped
        model, the optimizer to step (None if None was given), and a
        :class:`DistributedLoader` per DataLoader.

    Raises:
        ValueError: an unknown ``strategy`` (naming the choices); a model that
            is already wrapped; an optimizer that has stepped or holds a tensor
            that is not a parameter of the model (naming it); a DataLoader
            whose sampler cannot be split across ranks (a custom sampler or
            batch sampler, an IterableDataset); loaders or strategy that
            differ across ranks (on every rank, naming the ranks).
        RuntimeError: torch.distributed is not initialised (call ``tandem.init()``).
        TypeError: ``elastic`` is not a bool, an ElasticConfig or None.

    Warning:
        ``batch_size`` stays per rank: R ranks train on a global batch
        of R * batch_size. A learning-rate scheduler built on the optimizer
        before ``prepare`` keeps stepping the old optimizer under ``"zero1"``,
        ``"zero2"`` and ``"fsdp"``; build it on the returned one.

    Warning:
        With ``elastic``, a replacement rank starts the same script and
        takes up the members' epoch: loop over ``range(train_loader.epoch, epochs)``,
        not ``range(epochs)``; step a scheduler only when
        ``not optimizer.step_abandoned``, and pass it to
        ``optimizer.register_for_replacements``.
    """
    # For developers: the optimizer is Note [rebuilt optimizers] above; the loaders Note [prepared loaders] in
    # tandem/data/loader.py; shard_units Note [one strategy vocabulary] in strategy.py; elastic Notes
    # [elastic prepare] in tandem/elastic/loop.py and [buddy copies] in tandem/elastic/buddy.py.
    chosen = Strategy.parse(strategy)
    comm = _world_comm()
    kwargs = dict(wrapper_kwargs or {})
    _check_inputs(model, optimizer, chosen, kwargs, shard_units)
    elastic_settings = elastic_config(elastic, "prepare")
    if elastic is None and optimizer is None:
        elastic_settings = None  # `tandem run --elastic` and a model prepared for inference: nothing to step
    if elastic_settings is not None:
        _check_elastic(optimizer, comm.rank)
    if diloco is not None:
        _check_diloco(diloco, chosen, optimizer, elastic_settings is not None, kwargs, comm.rank)
    specs = [loader_spec(loader, i, seed) for i, loader in enumerate(dataloaders)]
    _agree(comm, chosen, specs)
    target = _resolve_device(device)
    sync_comm = comm
    if diloco is not None and chosen is Strategy.FULLY_SHARD:
        # Note [DiLoCo across nodes, fully_shard inside] in tandem/diloco/diloco.py
        mesh = node_mesh(target.type, who="prepare(strategy='fsdp', diloco=...)")
        kwargs["mesh"] = mesh["local"]
        sync_comm = GroupComm(mesh["node"].get_group())

    model.to(target)
    param_names(model, optimizer)  # every tensor it steps is the model's, or fail by name
    if diloco is not None and chosen is Strategy.DDP:
        wrapped, stepped = model, optimizer  # each rank's own copy between syncs
    else:
        wrapped, stepped = _wrap(model, optimizer, chosen, kwargs, shard_units, target, comm.size,
                                 elastic=elastic_settings is not None)
    if diloco is not None:
        assert stepped is not None  # _check_diloco
        DiLoCo(wrapped, stepped, diloco, comm=sync_comm)  # it lives in the optimizer's step hook
    loaders = [distributed_loader(loader, spec, comm, target if move_batches else None)
               for loader, spec in zip(dataloaders, specs)]
    if elastic_settings is not None:
        assert stepped is not None  # _check_elastic
        if chosen is Strategy.FULLY_SHARD:
            check_regroupable(wrapped, comm.rank)  # Note [regrouped units] in tandem/fsdp/regroup.py
        stepped = make_elastic(elastic_settings, wrapped, stepped, loaders,
                               agree=lambda: _agree(GroupComm(None), chosen, specs))
    elif straggler_every is not None and stepped is not None and comm.size > 1:
        # Note [naming a straggler] in tandem/train/stragglers.py
        LoopPhases(wrapped, stepped, StragglerWatch(PhaseGather(comm.size), every=straggler_every), comm.rank)
    logger.info("prepare: rank %d of %d, strategy %s on %s, optimizer %s, %d loader(s) of %s batches",
                comm.rank, comm.size, chosen.value, target,
                None if stepped is None else type(stepped).__name__, len(loaders),
                "/".join(str(s.batch_size) for s in specs) or "no")
    return (wrapped, stepped, *loaders)


def _world_comm() -> GroupComm:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("prepare needs torch.distributed: call tandem.init() first (with no "
                           "launcher it makes a world of one, so the same script runs as one process)")
    return GroupComm(None)


def _check_inputs(model: nn.Module, optimizer: torch.optim.Optimizer | None, strategy: Strategy,
                  kwargs: dict[str, Any], shard_units: tuple[type[nn.Module], ...]) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare: model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, FSDPModule) or _is_ddp(model):
        raise ValueError(f"prepare: the model is already a {type(model).__name__}; pass the plain "
                         "module and let strategy= wrap it")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"prepare: optimizer must be a torch.optim.Optimizer or None, got "
                        f"{type(optimizer).__name__}; pass DataLoaders after the optimizer "
                        "(None if there is none)")
    if optimizer is not None and strategy is not Strategy.DDP and optimizer.state:
        raise ValueError(
            f"prepare: strategy={strategy.value!r} builds a new optimizer, but this "
            f"{type(optimizer).__name__} already holds state for {len(optimizer.state)} parameter(s), "
            "which would be lost; call prepare before the first optimizer.step(), and load saved "
            "state into the optimizer it returns")
    if "zero_stage" in kwargs:
        raise ValueError(f"prepare: wrapper_kwargs has zero_stage={kwargs['zero_stage']!r}; choose the "
                         "stage with strategy='zero1' or 'zero2' instead")
    if shard_units and strategy is not Strategy.FULLY_SHARD:
        raise ValueError(f"prepare: shard_units={shard_units!r} applies to strategy='fsdp' only, "
                         f"got strategy={strategy.value!r}")


def _check_elastic(optimizer: torch.optim.Optimizer | None, rank: int) -> None:
    if optimizer is None:
        raise ValueError(f"prepare (rank {rank}): elastic=... needs the optimizer: its step() is where "
                         "the ranks agree on each step; pass it, or leave elastic unset for inference")


def _check_diloco(diloco: DiLoCoConfig, strategy: Strategy, optimizer: torch.optim.Optimizer | None,
                  elastic: bool, kwargs: dict[str, Any], rank: int) -> None:
    if not isinstance(diloco, DiLoCoConfig):
        raise TypeError(f"prepare (rank {rank}): diloco must be a tandem.DiLoCoConfig or None, got {diloco!r}")
    if optimizer is None:
        raise ValueError(f"prepare (rank {rank}): diloco=... needs the optimizer: the syncs happen in its step()")
    if elastic and strategy is not Strategy.DDP:
        raise ValueError(f"prepare (rank {rank}): diloco=... in an elastic job goes back to the last sync of each "
                         f"rank's own model: it needs strategy='ddp', got strategy={strategy.value!r}; or run "
                         "without --elastic (elastic=False)")
    if elastic:
        diloco.check_elastic(f"prepare (rank {rank})")
    if strategy not in (Strategy.DDP, Strategy.FULLY_SHARD):
        raise ValueError(f"prepare (rank {rank}): diloco=... with strategy={strategy.value!r}: DiLoCo trains each "
                         "rank's own copy between syncs; use strategy='ddp' (each rank alone) or 'fsdp' (sharded "
                         "inside each node, the nodes synced)")
    if strategy is Strategy.DDP and kwargs:
        raise ValueError(f"prepare (rank {rank}): diloco=... with strategy='ddp' does not wrap the model, so "
                         f"wrapper_kwargs={sorted(kwargs)} would do nothing; drop them")
    if "mesh" in kwargs:
        raise ValueError(f"prepare (rank {rank}): diloco=... with strategy='fsdp' shards over each node's ranks "
                         "and syncs across the nodes: it builds that mesh itself; drop wrapper_kwargs['mesh']")


def _resolve_device(device: torch.device | str | None) -> torch.device:
    """The device of this process: the one given, else what ``tandem.init`` bound."""
    if device is not None:
        return torch.device(device)
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _is_ddp(model: nn.Module) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel) or (
        hasattr(model, "no_sync") and isinstance(getattr(model, "module", None), nn.Module))


# ---------------------------------------------------------------------- the model and its optimizer

def _wrap(model: nn.Module, optimizer: torch.optim.Optimizer | None, strategy: Strategy,
          kwargs: dict[str, Any], shard_units: tuple[type[nn.Module], ...], device: torch.device,
          world_size: int, *, elastic: bool) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """The wrapped model and the optimizer that steps it (Note [rebuilt optimizers];
    Note [one strategy vocabulary] in strategy.py: what tandem check builds too)."""
    if strategy is not Strategy.FULLY_SHARD and device.type == "cuda" and "device_ids" not in kwargs:
        kwargs["device_ids"] = [device.index]
    return apply_strategy(model, optimizer, strategy, options=kwargs, shard_units=shard_units,
                          world_size=world_size, elastic=elastic)


# ---------------------------------------------------------------------- the loaders

def _agree(comm: GroupComm, strategy: Strategy, specs: list[LoaderSpec]) -> None:
    """Raise the same ValueError on every rank unless all ranks prepare alike: a
    seed or dataset that differs would silently overlap the ranks' shares."""
    mine = (strategy.value, [s.describe() for s in specs])
    if comm.size == 1:
        return
    shares = comm.all_gather_object(mine, tag="prepare")
    if all(share == shares[0] for share in shares):
        return
    per_rank = "; ".join(f"rank {r}: strategy {s[0]!r}, " + (", ".join(s[1]) or "no loaders")
                         for r, s in enumerate(shares))
    raise ValueError(f"prepare (rank {comm.rank}): every rank must pass the same strategy and "
                     f"DataLoaders (dataset size, batch size, shuffle, seed); got {per_rank}. Seed "
                     "the loaders' generators alike, or pass seed=")


# ---------------------------------------------------------------------- in the loop

@contextlib.contextmanager
def no_sync(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Backward inside accumulates gradients locally, without communication.

    For gradient accumulation over ``n`` micro-batches: run the first ``n - 1``
    backwards inside ``no_sync(model)``, the last outside (it reduces the sum),
    then step. ``enabled=False`` makes it a no-op, so one loop body serves both::

        with tandem.no_sync(model, enabled=(i + 1) % accumulate != 0):
            (loss_fn(model(x), y) / accumulate).backward()

    Works for each ``prepare`` strategy: a DDP or ZeRO model's ``no_sync()``,
    a fully-sharded model's ``set_requires_gradient_sync(False)`` (set back to
    True on exit), and a plain module (nothing to skip).
    """
    if not enabled:
        yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif hasattr(model, "no_sync"):
        with cast(Any, model).no_sync():  # nn.Module's typing hides the wrapper's method
            yield
    else:
        yield


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside what ``prepare`` returned: a DDP's ``module``; a
    fully-sharded model is the user's module itself (sharded in place, so its
    ``state_dict()`` holds DTensors: use ``tandem.fsdp``/``torch.distributed.checkpoint``
    to save it whole)."""
    if isinstance(model, FSDPModule):
        return model
    return unwrap_model(model)
