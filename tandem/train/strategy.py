"""The ways tandem distributes a model, named once: :class:`Strategy`, and the
modules ``fully_shard`` makes units of by default: :func:`fully_shard_units`.

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
otherwise; the root is always the last unit.
"""

from __future__ import annotations

from enum import Enum

from torch import nn

__all__ = ["Strategy", "fully_shard_units"]


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
