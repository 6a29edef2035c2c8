"""The Trainer's side of a fully-sharded model (``tandem.fully_shard``): its
full state out to a checkpoint and back in.

# Note [full checkpoints of a sharded model]
Under fully_shard each rank holds one dim-0 slice of every parameter and of its
optimizer state. The Trainer saves that sharded, every rank its slice (Note
[sharded trainer checkpoints] in sharded_checkpoint.py); the full format is
what ``checkpoint_format="full"`` and ``Trainer.export`` write: the *full*
state, in the format an unsharded run writes: plain tensors from ``model.state_dict()``,
and ``optimizer.state_dict()``'s layout, keyed by each parameter's position in
the param groups. One file thus resumes at any world size, sharded or not, and
a single process loads it with plain ``load_state_dict``. torch's
``get_state_dict`` gathers the state onto rank 0's CPU and ``set_state_dict``
cuts each rank's slice back out of it; both are collectives. They key the
optimizer state by parameter name; the names map to positions through the
order of the optimizer's parameters, which is how torch numbers them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["check_optimizer", "full_state_dicts", "is_fully_sharded", "load_full_state_dicts"]

# torch.distributed.checkpoint and fully_shard are imported where they are used:
# a process that never shards does not load them, nor DTensor (0.9 s of CPU at
# its start), and no model can have gone through fully_shard before its module
# was imported.


def is_fully_sharded(model: nn.Module) -> bool:
    """Whether ``model`` went through ``tandem.fully_shard``."""
    module = sys.modules.get("tandem.fsdp.module")
    return module is not None and isinstance(model, module.FSDPModule)


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Check that ``optimizer`` steps the fully-sharded ``model``'s parameters.

    Raises:
        ValueError: naming a tensor of the optimizer that is not a parameter of
            the model (an optimizer built before fully_shard, which replaces
            every parameter, would step tensors the model no longer uses).
    """
    _param_names(model, optimizer)


def full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None
                     ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The full model and optimizer state of a fully-sharded ``model``, on the
    CPU of rank 0 of the default group, in an unsharded run's format (Note [full
    checkpoints of a sharded model]). A collective: call it on every rank.

    Returns:
        ``(model_state, optimizer_state)`` on rank 0 (``optimizer_state`` None
        without an optimizer); elsewhere their contents are unspecified.

    Raises:
        ValueError: the optimizer holds a tensor that is not a parameter of the model.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizer is None:
        return get_model_state_dict(model, options=options), None
    names = _param_names(model, optimizer)  # first: a foreign parameter fails here, by name
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    if not optimizer_state:  # ranks other than 0 receive empty dicts
        return model_state, optimizer_state
    position = {name: i for i, name in enumerate(names)}
    return model_state, _rekey(optimizer_state, position.__getitem__)


def load_full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                          model_state: dict[str, Any], optimizer_state: dict[str, Any] | None) -> None:
    """Load full state, as :func:`full_state_dicts` returns it or an unsharded run
    saves it, into a fully-sharded ``model`` and its optimizer: each rank keeps
    its own slice. A collective: every rank passes the whole state.

    Raises:
        ValueError: the saved optimizer's parameter groups differ in size from
            ``optimizer``'s (checked before anything is loaded).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    options = StateDictOptions(full_state_dict=True)
    if optimizer is None or optimizer_state is None:
        set_model_state_dict(model, model_state, options=options)
        return
    saved = [len(group["params"]) for group in optimizer_state["param_groups"]]
    ours = [len(group["params"]) for group in optimizer.param_groups]
    if saved != ours:
        raise ValueError(f"the saved optimizer state has parameter groups of {saved} parameters, this "
                         f"optimizer {ours}; resume with the model and optimizer set up as when saving")
    names = _param_names(model, optimizer)
    set_state_dict(model, optimizer, model_state_dict=model_state,
                   optim_state_dict=_rekey(optimizer_state, names.__getitem__), options=options)


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The model's name of each of the optimizer's parameters, in torch's numbering."""
    names = {id(p): name for name, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        if id(p) not in names:
            raise ValueError(f"the optimizer's parameter {i} (shape {tuple(p.shape)}) is not a parameter of "
                             "the fully-sharded model; build the optimizer over model.parameters() after "
                             "fully_shard, which replaces every parameter")
    return [names[id(p)] for p in params]


def _rekey(optimizer_state: dict[str, Any], key: Callable[[Any], Any]) -> dict[str, Any]:
    """``optimizer_state`` with every parameter key replaced by ``key(it)``."""
    return {"state": {key(k): v for k, v in optimizer_state["state"].items()},
            "param_groups": [{**group, "params": [key(k) for k in group["params"]]}
                             for group in optimizer_state["param_groups"]]}
