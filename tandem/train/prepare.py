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

# Note [prepared loaders]
A prepared loader is a new ``torch.utils.data.DataLoader`` over the same
dataset, with the original's batch size, collate function, workers, pinning,
``drop_last`` and generator, whose sampler is a :class:`tandem.DistributedSampler`
(shuffling when the original's sampler was a ``RandomSampler``). Three choices:

- ``batch_size`` stays per rank, as in Accelerate's default (``split_batches=False``):
  one step of R ranks consumes R * batch_size samples. Global batch size, and
  so learning rate, scale with the world size; keep them fixed by dividing the
  batch size by R before ``prepare``.
- The sampler pads (never drops): every rank gets ``ceil(n / R)`` samples, the
  last ``R * ceil(n / R) - n`` positions repeating samples from the start of the
  epoch's order, as torch's sampler and Accelerate's ``even_batches`` do, so no
  rank waits in a collective for a batch that never comes.
  :func:`gather_for_metrics` drops exactly those repeats.
- Each ``iter(loader)`` starts the next epoch: the first iteration yields epoch
  0, the k-th epoch k - 1, as if ``sampler.set_epoch`` had been called before
  each (the classic pitfall of a forgotten ``set_epoch`` cannot happen).
  Accelerate counts the same way. :meth:`DistributedLoader.set_epoch` chooses
  the epoch (and resume position) of the next iteration explicitly.

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
import inspect
import logging
from collections.abc import Iterator, Mapping, Sized
from dataclasses import dataclass
from enum import Enum
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from tandem._tree import iter_tensors, to_device
from tandem.comm.group import GroupComm
from tandem.data.metrics import Samples, gather_samples
from tandem.data.sampler import DistributedSampler
from tandem.ddp import DistributedDataParallel
from tandem.fsdp import FSDPModule, fully_shard
from tandem.train.state import unwrap_model
from tandem.zero import ZeroOptimizer

__all__ = ["DistributedLoader", "Strategy", "gather_for_metrics", "no_sync", "prepare", "unwrap"]

logger = logging.getLogger(__name__)


class Strategy(Enum):
    """How ``prepare`` distributes the model (the ``strategy`` argument)."""

    DDP = "ddp"                  # tandem.DistributedDataParallel; the user's optimizer as it is
    ZERO1 = "zero1"              # DDP with zero_stage=1 and a tandem.ZeroOptimizer
    ZERO2 = "zero2"              # DDP with zero_stage=2 and a tandem.ZeroOptimizer
    FULLY_SHARD = "fully_shard"  # tandem.fully_shard (ZeRO-3); the optimizer rebuilt on the shards

    @classmethod
    def parse(cls, value: str | Strategy) -> Strategy:
        if isinstance(value, Strategy):
            return value
        name = value.lower() if isinstance(value, str) else value
        if name == "fsdp":
            return cls.FULLY_SHARD
        try:
            return cls(name)
        except ValueError:
            choices = ", ".join(repr(s.value) for s in cls) + ", 'fsdp' (= 'fully_shard')"
            raise ValueError(f"prepare: strategy={value!r} is not one of {choices}") from None


# ---------------------------------------------------------------------- prepare

def prepare(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *dataloaders: DataLoader,
            strategy: str | Strategy = "ddp", wrapper_kwargs: Mapping[str, Any] | None = None,
            shard_units: tuple[type[nn.Module], ...] = (), device: torch.device | str | None = None,
            seed: int | None = None, move_batches: bool = True) -> tuple[Any, ...]:
    """Make a model, its optimizer and DataLoaders data-parallel, for a training
    loop the caller writes.

    A collective: call it on every rank, with the same arguments, after
    ``tandem.init()`` (which also makes a world of one, so the same script runs
    as one process).

    Args:
        model: the plain module (not yet wrapped). It is moved to ``device``
            first, then wrapped according to ``strategy``.
        optimizer: built over ``model``'s parameters, not stepped yet; None for
            inference. Kept as it is under ``"ddp"``; rebuilt otherwise (Note
            [rebuilt optimizers]): use the returned one, and build schedulers on it.
        *dataloaders: ``torch.utils.data.DataLoader`` s over map-style datasets,
            with the default sampler (``shuffle=True`` or ``False``). Each is
            rebuilt over a :class:`tandem.DistributedSampler` (Note [prepared loaders]).
        strategy: ``"ddp"``, ``"zero1"``, ``"zero2"``, or ``"fsdp"`` /
            ``"fully_shard"`` (see :class:`Strategy`).
        wrapper_kwargs: keyword arguments for ``tandem.DistributedDataParallel``
            (``"ddp"``, ``"zero1"``, ``"zero2"``: e.g. ``bucket_cap_mb``,
            ``find_unused_parameters``, ``zero_config``) or for every
            ``tandem.fully_shard`` call (``"fsdp"``: e.g. ``mp_policy``).
        shard_units: ``"fsdp"`` only: module classes (e.g. a transformer
            block) whose instances each become a unit of their own, sharded
            bottom-up before the root; by default the root is the only unit.
        device: where the model and batches go. Default: ``cuda:<current
            device>`` when the backend is NCCL (``tandem.init`` made it
            current), else the CPU.
        seed: base seed of every shuffling loader's order (``seed + epoch``
            each epoch). Default: the initial seed of the loader's generator
            (the ``generator=`` given to the DataLoader), else 0.
        move_batches: move every tensor of each batch to ``device`` (nested in
            tuples, lists, dicts and dataclasses).

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

    .. warning:: ``batch_size`` stays per rank: R ranks train on a global batch
        of R * batch_size. A learning-rate scheduler built on the optimizer
        before ``prepare`` keeps stepping the old optimizer under ``"zero1"``,
        ``"zero2"`` and ``"fsdp"``; build it on the returned one.
    """
    chosen = Strategy.parse(strategy)
    comm = _world_comm()
    kwargs = dict(wrapper_kwargs or {})
    _check_inputs(model, optimizer, chosen, kwargs, shard_units)
    specs = [_loader_spec(loader, i, seed) for i, loader in enumerate(dataloaders)]
    _agree(comm, chosen, specs)
    target = _resolve_device(device)

    model.to(target)
    names = _param_names(model, optimizer)  # every tensor it steps is the model's, or fail by name
    wrapped, stepped = _wrap(model, optimizer, names, chosen, kwargs, shard_units, target, comm.size)
    loaders = [_distributed_loader(loader, spec, comm, target if move_batches else None)
               for loader, spec in zip(dataloaders, specs)]
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

def _wrap(model: nn.Module, optimizer: torch.optim.Optimizer | None, names: list[str], strategy: Strategy,
          kwargs: dict[str, Any], shard_units: tuple[type[nn.Module], ...], device: torch.device,
          world_size: int) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """The wrapped model and the optimizer that steps it (Note [rebuilt optimizers]);
    ``names`` are the model's names of the optimizer's parameters, in group order."""
    if strategy is Strategy.FULLY_SHARD:
        # modules() lists a parent before its descendants: reversed, units are made bottom-up.
        for module in list(model.modules())[::-1]:
            if module is not model and isinstance(module, shard_units):
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
        if optimizer is None:
            return model, None
        current = dict(model.named_parameters(remove_duplicate=False))
        return model, _rebuild(optimizer, [current[name] for name in names])

    if device.type == "cuda" and "device_ids" not in kwargs:
        kwargs["device_ids"] = [device.index]
    stage = {Strategy.DDP: 0, Strategy.ZERO1: 1, Strategy.ZERO2: 2}[strategy]
    if stage and world_size == 1:
        # ZeRO shards over ranks; a world of one has nothing to shard (and no reducer to
        # shard with), so it trains as plain DDP with the user's optimizer.
        logger.info("prepare: strategy %s in a world of one is plain DDP", strategy.value)
        stage = 0
        kwargs.pop("zero_config", None)
    ddp = DistributedDataParallel(model, zero_stage=stage, **kwargs)
    if optimizer is None or not stage:
        return ddp, optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = _groups_over(optimizer, params, drop=("param_names",))  # names would not fit the shards
    return ddp, ZeroOptimizer(ddp, type(optimizer), groups, **_constructor_defaults(optimizer))


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[str]:
    """The model's name of each of the optimizer's parameters, in param-group order."""
    if optimizer is None:
        return []
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) not in names:
                raise ValueError(
                    f"prepare: parameter {i} of the optimizer's param group {g} (shape "
                    f"{tuple(p.shape)}) is not a parameter of the model; build the optimizer over "
                    "this model's parameters (model.parameters()) before calling prepare")
            out.append(names[id(p)])
    return out


def _rebuild(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class and groups over ``params`` (one per
    old parameter, in param-group order)."""
    return type(optimizer)(_groups_over(optimizer, params), **_constructor_defaults(optimizer))


def _groups_over(optimizer: torch.optim.Optimizer, params: list[Any],
                 drop: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """``optimizer``'s param groups, hyper-parameters and all, holding ``params``
    (in the order of the groups' parameters) instead of their own."""
    groups, start = [], 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params" and k not in drop},
                       "params": params[start:start + count]})
        start += count
    return groups


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.defaults`` that its class's constructor accepts (torch's AdamW
    records ``decoupled_weight_decay`` in its defaults but takes no such argument)."""
    parameters = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in parameters}


# ---------------------------------------------------------------------- the loaders

@dataclass(frozen=True)
class _LoaderSpec:
    """What a prepared loader keeps of the original, and what the ranks must agree on."""

    index: int
    dataset_size: int
    batch_size: int
    shuffle: bool
    seed: int
    drop_last: bool

    def describe(self) -> str:
        return (f"loader {self.index}: {self.dataset_size} samples, batch_size {self.batch_size}, "
                f"shuffle={self.shuffle}, seed {self.seed}, drop_last={self.drop_last}")


def _loader_spec(loader: DataLoader, index: int, seed: int | None) -> _LoaderSpec:
    """Read (and check) what a DistributedSampler needs from ``loader``."""
    where = f"prepare: dataloader {index}"
    if not isinstance(loader, DataLoader):
        raise TypeError(f"{where} is a {type(loader).__name__}, not a torch.utils.data.DataLoader")
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(f"{where} reads an IterableDataset ({type(loader.dataset).__name__}), which a "
                         "sampler cannot split across ranks; shard it yourself by rank, or use a "
                         "map-style dataset")
    if loader.batch_size is None:
        raise ValueError(f"{where} has a custom batch_sampler ({type(loader.batch_sampler).__name__}); "
                         "prepare splits samples, not batches: pass batch_size= (and shuffle=) instead")
    sampler = loader.sampler
    if isinstance(sampler, (DistributedSampler, torch.utils.data.distributed.DistributedSampler)):
        raise ValueError(f"{where} already has a DistributedSampler; pass the loader over the whole "
                         "dataset (shuffle=True or False) and prepare splits it")
    if isinstance(sampler, RandomSampler):
        size = len(cast(Sized, loader.dataset))
        if sampler.replacement or sampler.num_samples != size:
            raise ValueError(f"{where}: a RandomSampler with replacement={sampler.replacement}, "
                             f"num_samples={sampler.num_samples} (dataset of {size}) cannot be split "
                             "across ranks; use shuffle=True without them")
        shuffle = True
    elif isinstance(sampler, SequentialSampler):
        shuffle = False
    else:
        raise ValueError(f"{where} has a {type(sampler).__name__} sampler; prepare knows how to split "
                         "a RandomSampler (shuffle=True) or a SequentialSampler (shuffle=False) only")
    if seed is None:
        generator = getattr(sampler, "generator", None) or loader.generator
        seed = generator.initial_seed() if generator is not None else 0
    return _LoaderSpec(index=index, dataset_size=len(cast(Sized, loader.dataset)),
                       batch_size=loader.batch_size, shuffle=shuffle, seed=int(seed),
                       drop_last=bool(loader.drop_last))


def _agree(comm: GroupComm, strategy: Strategy, specs: list[_LoaderSpec]) -> None:
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


_PASSED_THROUGH = ("num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
                   "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers",
                   "pin_memory_device", "in_order")


def _distributed_loader(loader: DataLoader, spec: _LoaderSpec, comm: GroupComm,
                        device: torch.device | None) -> DistributedLoader:
    sampler = DistributedSampler(cast(Sized, loader.dataset), num_replicas=comm.size, rank=comm.rank,
                                 shuffle=spec.shuffle, seed=spec.seed, drop_last=False)
    accepted = inspect.signature(DataLoader.__init__).parameters
    options = {name: getattr(loader, name) for name in _PASSED_THROUGH
               if name in accepted and hasattr(loader, name)}
    return DistributedLoader(DataLoader(loader.dataset, batch_size=spec.batch_size, sampler=sampler,
                                        **options), device)


class DistributedLoader:
    """This rank's share of a DataLoader, one epoch per iteration (Note [prepared loaders]).

    Iterating it yields what the original DataLoader would for this rank's
    samples under a :class:`tandem.DistributedSampler`, each batch moved to
    ``device``. Each ``iter()`` starts the next epoch (0, 1, 2, ...), so the
    order reshuffles without a ``set_epoch`` call; :meth:`set_epoch` sets the
    next one explicitly (e.g. when resuming).

    Attributes:
        loader: the underlying ``torch.utils.data.DataLoader``.
        sampler: its :class:`tandem.DistributedSampler`.
        device: where batches are moved, or None to leave them where collate put them.
    """

    def __init__(self, loader: DataLoader, device: torch.device | None) -> None:
        self.loader = loader
        self.sampler = cast(DistributedSampler, loader.sampler)
        self.device = device
        self._epoch = 0
        self._fresh = True     # the sampler is set for _epoch, and no iteration has used it yet
        self._yielded = 0      # samples this rank received in the current iteration
        self._remaining = self.sampler.dataset_size  # positions of the epoch left at its start

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_size(self) -> int:
        """Samples per batch on this rank (not across ranks)."""
        return cast(int, self.loader.batch_size)

    @property
    def drop_last(self) -> bool:
        return self.loader.drop_last

    @property
    def epoch(self) -> int:
        """The epoch of the iteration in progress, or of the next one after :meth:`set_epoch`."""
        return self._epoch

    @property
    def yielded(self) -> int:
        """Samples this rank has received so far in the current iteration."""
        return self._yielded

    @property
    def remaining(self) -> int:
        """Samples of the dataset the current iteration covers, all ranks together
        (the dataset size, less a resume position)."""
        return self._remaining

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Make the next iteration yield ``epoch``, after the first ``start`` samples
        the whole job consumed (see :meth:`tandem.DistributedSampler.set_epoch`);
        later iterations continue with ``epoch + 1``, ``epoch + 2``, ... from their start."""
        self.sampler.set_epoch(epoch, start)
        self._epoch = epoch
        self._fresh = True

    def __len__(self) -> int:
        """Batches of this rank in an epoch (that of :attr:`epoch`)."""
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if not self._fresh:
            self.sampler.set_epoch(self._epoch + 1)
            self._epoch += 1
        self._fresh = False
        self._yielded = 0
        self._remaining = self.sampler.dataset_size - self.sampler.start
        return self._batches(iter(self.loader), len(self.sampler))

    def _batches(self, batches: Iterator[Any], share: int) -> Iterator[Any]:
        for index, batch in enumerate(batches):
            self._yielded = min((index + 1) * self.batch_size, share)
            yield batch if self.device is None else to_device(batch, self.device)

    def __repr__(self) -> str:
        return (f"DistributedLoader(rank {self.sampler.rank} of {self.sampler.num_replicas}, "
                f"{len(self.sampler)} of {self.sampler.dataset_size} samples, batch_size "
                f"{self.batch_size}, shuffle={self.sampler.shuffle}, epoch {self._epoch})")


# ---------------------------------------------------------------------- in the loop

def gather_for_metrics(values: Samples, loader: DistributedLoader,
                       group: dist.ProcessGroup | None = None) -> Samples:
    """Every rank's results for the samples ``loader`` yielded last, each sample
    once, in the epoch's order, on every rank.

    ``values`` holds this rank's results (one row per sample) of the last ``k``
    samples ``loader`` yielded in its current iteration: one batch, inside the
    loop, or ``torch.cat`` of every batch, after it. The rows of all ranks are
    gathered and interleaved back into the sampler's order, and the padding
    that made the ranks' shares equal (Note [prepared loaders]) is dropped: a
    metric over the result counts each sample of the dataset once. A
    collective: call it on every rank, at the same point of the loop.

    Args:
        values: a tensor, or a tuple, list or dict of tensors, each with ``k``
            rows (the same ``k`` on every rank).
        loader: the :class:`DistributedLoader` the samples came from.
        group: the process group the loader's sampler splits over (default:
            the default group).

    Returns:
        The same kind of value, each tensor with at most ``k * world_size`` rows.

    Raises:
        TypeError: ``values`` holds no tensor with a first dimension.
        ValueError: ``k`` exceeds what ``loader`` yielded in this iteration, or
            the ranks' values differ in rows, shapes or kinds (on every rank).
    """
    rows = _rows(values)
    if rows > loader.yielded:
        raise ValueError(
            f"gather_for_metrics (rank {loader.sampler.rank}): values hold {rows} rows, but the loader "
            f"yielded {loader.yielded} samples in this iteration; pass the results of the samples it "
            "yielded last (one batch, or every batch since the iteration started)")
    world = loader.sampler.num_replicas
    # Rank-local sample i stands at position i * world + rank of what the iteration covers
    # (tandem/data/sampler.py); positions past `remaining` are padding.
    before = loader.yielded - rows
    keep = max(0, min(rows * world, loader.remaining - before * world))
    return gather_samples(values, keep, group)


def _rows(values: Samples) -> int:
    first = next(iter_tensors(values), None)
    if first is None or first.dim() == 0:
        raise TypeError("gather_for_metrics takes a tensor, or a tuple, list or dict of tensors, each "
                        f"with one row per sample; got {type(values).__name__} without such a tensor")
    return first.shape[0]


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
