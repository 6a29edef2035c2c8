"""The user's side of ``tandem check``: the model, data, loss and optimizer,
given as objects or entry points (``"package.module:function"``), what a rank
is sent (:class:`_Spec`), and the global batch split into the ranks' shards.

# Note [what the factories are]
``model()`` builds the model. The tool seeds every generator
(:func:`tandem.seed_everything` with ``seed``) before calling it, in the
reference and on every rank, so a factory that does not seed still builds the
same model everywhere. The factory stands for the part of a training script
from seeding to the finished model: a script that seeds each rank differently
for dropout after building the model (``seed_everything(seed, per_rank=True)``)
must do so at the end of the factory too (Note [dropout]).

``data(step)`` returns the GLOBAL batch of a step as ``(inputs, targets)``;
the tool gives rank r the r-th of N equal dim-0 slices of every tensor in it.
A factory that also takes ``rank`` and ``world_size`` keywords is asked for
each rank's batch itself (``data(step, rank=r, world_size=n)``): that tests the
user's own sharding, and the report says when the ranks' batches are not a
split of ``data(step)`` into equal parts (checked per sample, in any order).
A ``torch.utils.data.Dataset`` with ``batch_size`` works too: step s is
samples ``[s*B, (s+1)*B)`` (wrapping around), collated by torch's default.
Inputs are passed as ``model(x)``, ``model(*x)`` for a tuple or list,
``model(**x)`` for a dict.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem._tree import iter_tensors, map_tensors
from tandem.tools.check.compare import Tolerance
from tandem.tools.entry import load_entry

__all__ = ["sample_keys", "shard_batch"]


@dataclass(frozen=True, kw_only=True)
class _Spec:
    """Everything a rank needs, picklable (entry points as strings or importable objects)."""

    model: Any
    data: Any
    batch_size: int | None
    loss: Any
    optimizer: Any
    optimizer_kwargs: dict[str, Any]
    steps: int
    seed: int
    strategies: tuple[str, ...]
    tolerance: Tolerance | None
    mp_policy: Any = None  # fully_shard's MixedPrecisionPolicy (fsdp only)

_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "mse": nn.functional.mse_loss, "cross_entropy": nn.functional.cross_entropy, "l1": nn.functional.l1_loss}


def _resolve(obj: Any, what: str) -> Any:
    return load_entry(obj, what=what) if isinstance(obj, str) else obj


def _build_model(spec: _Spec) -> nn.Module:
    from tandem.checkpoint.rng import seed_everything

    seed_everything(spec.seed)  # Note [what the factories are]
    model = _resolve(spec.model, "--model")()
    if not isinstance(model, nn.Module):
        raise ValueError(f"the model factory {spec.model!r} returned a {type(model).__name__}, not an nn.Module")
    return model.train()


class _Batches:
    """Global and per-rank batches from ``data`` (Note [what the factories are])."""

    def __init__(self, data: Any, batch_size: int | None) -> None:
        from torch.utils.data import Dataset

        self.dataset = data if isinstance(data, Dataset) else None
        self.fn = None if self.dataset is not None else _resolve(data, "--data")
        if self.dataset is None and isinstance(self.fn, Dataset):
            self.dataset, self.fn = self.fn, None
        if self.dataset is not None and not (isinstance(batch_size, int) and batch_size > 0):
            raise ValueError(f"a Dataset needs a global batch_size (--batch-size), got {batch_size!r}")
        self.batch_size = batch_size
        self.per_rank = self.fn is not None and _takes_rank(self.fn)

    def global_batch(self, step: int) -> tuple[Any, Any]:
        if self.dataset is not None:
            from torch.utils.data import default_collate

            n, b = len(self.dataset), self.batch_size  # type: ignore[arg-type]
            assert b is not None
            return _as_pair(default_collate([self.dataset[(step * b + i) % n] for i in range(b)]), "dataset")
        assert self.fn is not None
        return _as_pair(self.fn(step), f"data({step})")

    def rank_batch(self, step: int, rank: int, world_size: int) -> tuple[Any, Any]:
        if self.per_rank:
            assert self.fn is not None
            return _as_pair(self.fn(step, rank=rank, world_size=world_size),
                            f"data({step}, rank={rank}, world_size={world_size})")
        return shard_batch(self.global_batch(step), rank, world_size, step=step)


def _takes_rank(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return False  # **kwargs alone does not say the factory shards
    return "rank" in params and "world_size" in params


def _as_pair(batch: Any, what: str) -> tuple[Any, Any]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ValueError(f"{what} must return (inputs, targets), got {type(batch).__name__}")
    return batch[0], batch[1]


def _batch_size(batch: Any, what: str) -> int:
    sizes = {t.shape[0] for t in iter_tensors(batch) if t.dim()}
    if len(sizes) != 1:
        raise ValueError(f"{what}: the tensors of a batch must share their first (batch) dimension, "
                         f"got sizes {sorted(sizes)}")
    return sizes.pop()


def shard_batch(batch: tuple[Any, Any], rank: int, world_size: int, *, step: int = 0) -> tuple[Any, Any]:
    """Rank ``rank``'s equal dim-0 slice of every tensor in a global batch.

    Raises:
        ValueError: the global batch does not divide by ``world_size``.
    """
    size = _batch_size(batch, f"data({step})")
    if size % world_size:
        raise ValueError(f"the global batch of step {step + 1} has {size} samples, which {world_size} ranks cannot "
                         f"share equally (DDP averages the ranks' mean losses); use a global batch that is a "
                         f"multiple of {world_size}")
    per = size // world_size
    inputs, targets = map_tensors(lambda t: t[rank * per:(rank + 1) * per] if t.dim() else t, batch)
    return inputs, targets


def sample_keys(batch: tuple[Any, Any]) -> tuple[bytes, ...]:
    """A fingerprint of each sample of a batch: its rows of every batched tensor."""
    tensors = [t for t in iter_tensors(batch) if t.dim()]
    if not tensors:
        return ()
    size = tensors[0].shape[0]
    rows = [t.detach().cpu().contiguous().view(torch.uint8).reshape(size, -1).numpy() if t.numel() else None
            for t in tensors]
    keys = []
    for i in range(size):
        h = hashlib.blake2b(digest_size=16)
        for r in rows:
            if r is not None:
                h.update(r[i].tobytes())
        keys.append(h.digest())
    return tuple(keys)


def _loss_fn(spec: Any) -> Callable[[Any, Any], torch.Tensor]:
    if isinstance(spec, str) and spec in _LOSSES:
        return _LOSSES[spec]
    if spec == "auto":
        return _auto_loss
    return _resolve(spec, "--loss")


def _auto_loss(outputs: Any, targets: Any) -> torch.Tensor:
    """Cross-entropy for integer targets (class indices), MSE for floating ones."""
    if torch.is_floating_point(targets):
        return nn.functional.mse_loss(outputs, targets)
    return nn.functional.cross_entropy(outputs, targets)


def _loss_name(spec: Any, targets: Any) -> str:
    if spec == "auto":
        floating = isinstance(targets, torch.Tensor) and torch.is_floating_point(targets)
        return f"{'mse' if floating else 'cross_entropy'} (auto)"
    return spec if isinstance(spec, str) else getattr(spec, "__name__", repr(spec))


def _optimizer_class(spec: Any) -> type[torch.optim.Optimizer]:
    if isinstance(spec, type) and issubclass(spec, torch.optim.Optimizer):
        return spec
    if isinstance(spec, str):
        for name in dir(torch.optim):
            obj = getattr(torch.optim, name)
            if name.lower() == spec.lower() and isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer):
                return obj
    raise ValueError(f"optimizer {spec!r} is not a torch.optim class: name one (sgd, adam, adamw, ...) "
                     "or pass the class")


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)
