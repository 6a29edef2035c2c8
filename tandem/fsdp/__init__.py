"""Fully sharded data parallelism (ZeRO-3): ``tandem.fully_shard``, a drop-in for
torch's FSDP2 ``torch.distributed.fsdp.fully_shard``; the methods it adds to a
module (:class:`FSDPModule`); loading a full state dict into a sharded model
(:func:`load_full_state_dict`); random init of shards as if unsharded
(:func:`init_like_unsharded`); the pure layout of a unit
(:func:`plan_unit`); and collectives in int8 or int4 blocks
(:class:`QuantizedCommPolicy`).
"""

# The package's files: the pure layout of each unit's buffers (layout.py), which
# parameters a call takes (unit_walk.py), a call's arguments checked and resolved
# (arguments.py: meshes for FSDP and HSDP, lists of modules, shard dims), the
# forward hooks, the root's lazy init and the order of a root's units in an
# iteration (schedule.py), one unit at run time, its gather and release and its
# gradients' reduction (unit.py), its buffers and its parameters in both forms,
# with those whose tensor subclass gathers itself (unit_params.py), their plain
# types (unit_state.py), what ``to_empty``/``to`` do to a unit (convert.py),
# state dicts in and out (state_dict.py), random init of sharded parameters
# (init.py), the units laid out again over a new group in an elastic job
# (regroup.py), the audit of a unit's mixed-precision policy (precision.py), the
# policy of collectives in int8 or int4 blocks (comm_policy.py), and the public
# function (api.py) and the methods it adds to a module (module.py).
#
# The flows, file by file:
# - a unit's gather, from the forward pre-hook to the unsharded parameters the
#   module computes with: schedule.py (``pre_forward``, ``Schedule.pre_forward``),
#   unit.py (``ShardedUnit.unshard``: ``launch_gather``, ``wait_gather``),
#   tandem/comm/group.py (``GroupComm.all_gather_into``), unit_params.py
#   (``UnitParams.alloc_unsharded``, ``register``; ``SubclassGather``);
# - a unit's reduce-scatter, from the post-backward to the sharded ``.grad``:
#   schedule.py (``Schedule.on_grad``, ``_complete``, ``_launch_ready``,
#   ``_finish_reductions``), unit.py (``ShardedUnit.launch_reduce``,
#   ``advance_reduce``, ``_set_grads``), unit_params.py (``UnitParams.blocks``),
#   tandem/comm/group.py (``GroupComm.reduce_scatter``).

from typing import TYPE_CHECKING

# Each public name is imported on first use (PEP 562), as in tandem/__init__.py: a
# process that imports only the pure layout (tandem.fsdp.layout, which tandem
# plan and the memory planner read) does not load torch's FSDP2 and DTensor
# (0.8 s of CPU at every start). The imports below are the same names, for type
# checkers and documentation tools.
if TYPE_CHECKING:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    from tandem.fsdp.api import DEFAULT_MIN_UNIT_BYTES, fully_shard
    from tandem.fsdp.comm_policy import QuantizedCommPolicy
    from tandem.fsdp.init import init_like_unsharded
    from tandem.fsdp.layout import ParamShard, UnitLayout, plan_unit
    from tandem.fsdp.module import FSDPModule, UnshardHandle
    from tandem.fsdp.state_dict import load_full_state_dict

_FROM = {  # module: the public names taken from it
    "tandem.fsdp.api": ("DEFAULT_MIN_UNIT_BYTES", "fully_shard"),
    "tandem.fsdp.comm_policy": ("QuantizedCommPolicy",),
    "tandem.fsdp.init": ("init_like_unsharded",),
    "tandem.fsdp.layout": ("ParamShard", "UnitLayout", "plan_unit"),
    "tandem.fsdp.module": ("FSDPModule", "UnshardHandle"),
    "tandem.fsdp.state_dict": ("load_full_state_dict",),
}
_EXPORTS = {name: module for module, names in _FROM.items() for name in names}
_POLICIES = ("MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy")  # torch's, as _compat finds them


def __getattr__(name: str) -> object:
    import importlib

    if name in _POLICIES:
        from tandem._compat import fsdp_policies

        value: object = dict(zip(_POLICIES, fsdp_policies()))[name]
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'tandem.fsdp' has no attribute {name!r}")
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = ["CPUOffloadPolicy", "DEFAULT_MIN_UNIT_BYTES", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
           "ParamShard", "QuantizedCommPolicy", "UnitLayout", "UnshardHandle", "fully_shard", "init_like_unsharded",
           "load_full_state_dict", "plan_unit"]
