"""The ways tandem distributes a model, named once: :class:`Strategy`; the
modules ``fully_shard`` makes units of by default: :func:`fully_shard_units`;
and how each is applied to a model and its optimizer: :func:`apply_strategy`,
which ``prepare``, the Trainer and ``tandem check`` call.

# Note [one strategy vocabulary]
``prepare``, the Trainer's configuration, ``tandem check`` and ``tandem plan``
each named the strategies their own way (``"fully_shard"``, ``"fsdp"``,
``"ZeRO-1"``), and ``tandem check`` chose fully_shard's units by a rule of its
own (the items of every ``nn.ModuleList``) where ``prepare`` sharded the root
alone: check could verify another sharding than the one the user runs. Here
is the one vocabulary (:meth:`Strategy.parse` reads every spelling the tools
print or take) and the one rule for the units, which ``prepare``, ``tandem
check`` and ``tandem plan`` all use: the instances of the classes the caller
names (``shard_units``), or else the items of every ``nn.ModuleList`` (the
repeated blocks, as torchtitan shards ``model.layers``), deeper ones first, so
that a unit nested in another is made before it, in the model's order
otherwise; the root is always the last unit. And one way to apply each
(:func:`apply_strategy`, torchtitan's ``apply_*`` in one function): the model
wrapped or sharded, and the optimizer that steps it (the user's over DDP, a
``ZeroOptimizer`` over ZeRO, a rebuilt one over fully_shard's shards: Note
[rebuilt optimizers] in prepare.py).
"""

from __future__ import annotations

import inspect
import logging
from enum import Enum
from typing import Any

import torch
from torch import nn

__all__ = ["Strategy", "apply_strategy", "fully_shard_units"]

logger = logging.getLogger(__name__)


class Strategy(Enum):
    """How a model is distributed."""

    DDP = "ddp"                  # tandem.DistributedDataParallel; the user's optimizer as it is
    ZERO1 = "zero1"              # DDP with zero_stage=1 and a tandem.ZeroOptimizer
    ZERO2 = "zero2"              # DDP with zero_stage=2 and a tandem.ZeroOptimizer
    FULLY_SHARD = "fully_shard"  # tandem.fully_shard (ZeRO-3); the optimizer rebuilt on the shards

    @classmethod
    def parse(cls, value: str | Strategy, *, who: str = "prepare") -> Strategy:
        """``value`` in any of the spellings tandem uses: ``"ddp"``, ``"zero1"``,
        ``"zero2"``, ``"fully_shard"``, ``"fsdp"`` (check's), ``"DDP"``,
        ``"ZeRO-1"``, ``"ZeRO-2"`` (plan's).

        Raises:
            ValueError: any other value, naming the choices (and ``who`` asked).
        """
        if isinstance(value, Strategy):
            return value
        name = value.lower().replace("-", "") if isinstance(value, str) else value
        if name == "fsdp":
            return cls.FULLY_SHARD
        try:
            return cls(name)
        except ValueError:
            choices = ", ".join(repr(s.value) for s in cls) + ", 'fsdp' (= 'fully_shard')"
            raise ValueError(f"{who}: strategy={value!r} is not one of {choices}") from None

    @property
    def label(self) -> str:
        """The name ``tandem plan`` prints."""
        return {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "fully_shard": "fully_shard"}[self.value]

    @property
    def zero_stage(self) -> int:
        """0 for DDP, 1 and 2 for ZeRO, 3 for fully_shard."""
        return {"ddp": 0, "zero1": 1, "zero2": 2, "fully_shard": 3}[self.value]


def fully_shard_units(model: nn.Module, shard_units: tuple[type[nn.Module], ...] = ()) -> list[str]:
    """The names of the submodules to call ``fully_shard`` on before the root,
    innermost first (Note [one strategy vocabulary]): every instance of the
    ``shard_units`` classes, or, without them, the items of every ``nn.ModuleList``."""
    if shard_units:
        chosen = [name for name, module in model.named_modules() if name and isinstance(module, shard_units)]
    else:
        chosen = [f"{name}.{k}" if name else k for name, module in model.named_modules()
                  if isinstance(module, nn.ModuleList) for k, _ in module.named_children()]
    # Deeper names first, so that a unit nested in another is made before it; the
    # model's order among names of one depth.
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(chosen, key=lambda name: (-name.count("."), order.get(name, 0)))


def apply_strategy(model: nn.Module, optimizer: torch.optim.Optimizer | None, strategy: Strategy, *,
                   options: dict[str, Any] | None = None, shard_units: tuple[type[nn.Module], ...] = (),
                   world_size: int = 1, elastic: bool = False) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """``model`` distributed by ``strategy``, and the optimizer that steps it.

    Args:
        model: the plain model, on its device.
        optimizer: built over ``model``'s parameters (None: no optimizer).
        strategy: how.
        options: keyword arguments of ``DistributedDataParallel`` (DDP, ZeRO) or
            of ``fully_shard``.
        shard_units: fully_shard's unit classes (:func:`fully_shard_units`).
        world_size: the group's size: ZeRO in a world of one is plain DDP,
            unless ``elastic`` (the world may grow: a replacement starts alone).

    Returns:
        The wrapped model, and the user's optimizer (DDP), a ``ZeroOptimizer``
        with its classes and groups (ZeRO) or a rebuilt one over the shards
        (fully_shard).
    """
    options = dict(options or {})
    names = param_names(model, optimizer)
    if strategy is Strategy.FULLY_SHARD:
        from tandem.fsdp import fully_shard

        for name in fully_shard_units(model, shard_units):
            fully_shard(model.get_submodule(name), **options)
        fully_shard(model, **options)
        if optimizer is None:
            return model, None
        current = dict(model.named_parameters(remove_duplicate=False))
        return model, rebuild_optimizer(optimizer, [current[name] for name in names])

    from tandem.ddp import DistributedDataParallel
    from tandem.zero import ZeroOptimizer

    stage = strategy.zero_stage
    if stage and world_size == 1 and not elastic:
        # ZeRO shards over ranks; a world of one has nothing to shard (and no reducer to
        # shard with), so it trains as plain DDP with the user's optimizer.
        logger.info("strategy %s in a world of one is plain DDP", strategy.value)
        stage = 0
        options.pop("zero_config", None)
    ddp = DistributedDataParallel(model, zero_stage=stage, **options)
    if optimizer is None or not stage:
        return ddp, optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = _groups_over(optimizer, params, drop=("param_names",))  # names would not fit the shards
    return ddp, ZeroOptimizer(ddp, type(optimizer), groups, **_constructor_defaults(optimizer))


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[str]:
    """The model's name of each of the optimizer's parameters, in param-group order.

    Raises:
        ValueError: a parameter of the optimizer that is not the model's, by group and index.
    """
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


def rebuild_optimizer(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> torch.optim.Optimizer:
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
