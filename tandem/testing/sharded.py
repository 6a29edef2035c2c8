"""What fully_shard (or tensor parallelism) made of a module and its
parameters, as a test reads them: torch types a sharded parameter and its
``.grad`` as plain tensors, and a submodule as ``Tensor | Module``, so a test
names what it knows they are."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

# Imported where they are used: a test process that never shards (most) does not
# load torch's FSDP2 and DTensor (0.8 s of CPU at its start).
if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from tandem.fsdp import FSDPModule
    from tandem.fsdp.unit import ShardedUnit

__all__ = ["as_dtensor", "as_fsdp", "sharded_unit"]


def as_dtensor(tensor: torch.Tensor | None) -> DTensor:
    """``tensor`` as the DTensor it is: a sharded parameter, its gradient, or
    an optimizer state of one.

    Raises:
        AssertionError: ``tensor`` is None or a plain tensor.
    """
    from torch.distributed.tensor import DTensor

    assert isinstance(tensor, DTensor), f"expected a DTensor, got {type(tensor).__name__}"
    return tensor


def as_fsdp(module: object) -> FSDPModule:
    """``module`` as the FSDPModule that ``fully_shard`` made it, whose methods
    (``set_requires_gradient_sync``, ``unshard``, ...) a test calls; torch's
    fully_shard makes a module with the same methods and arguments (checked
    by tests/fsdp/test_fsdp_module_api.py), so a test that compares the two
    calls them alike.

    Raises:
        AssertionError: neither fully_shard was applied to ``module``.
    """
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from tandem.fsdp import FSDPModule

    assert isinstance(module, (FSDPModule, TorchFSDPModule)), \
        f"expected a module that fully_shard sharded, got {type(module).__name__}"
    return cast(FSDPModule, module)


def sharded_unit(module: object) -> ShardedUnit:
    """The unit that tandem's ``fully_shard`` made of ``module``.

    Raises:
        AssertionError: tandem's fully_shard was not applied to ``module``.
    """
    from tandem.fsdp.unit import unit_of

    assert isinstance(module, torch.nn.Module)
    unit = unit_of(module)
    assert unit is not None, f"fully_shard was not applied to this {type(module).__name__}"
    return unit
