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
# (arguments.py: meshes for FSDP and HSDP, lists of modules, shard dims), one unit
# at run time (unit.py, composed of its buffers and parameters in unit_params.py,
# its gather and release in unit_gather.py, with that of parameters whose
# tensor subclass gathers itself, and its gradients' reduction in
# unit_reduce.py; their plain types in unit_state.py: a unit's gather reads in
# schedule.py, unit.py, unit_gather.py and unit_params.py), the forward hooks,
# the root's lazy init and the order of a root's units in an iteration
# (schedule.py), what ``to_empty``/``to`` do to a unit (convert.py), state dicts
# in and out (state_dict.py), random init of sharded parameters (init.py), the
# units laid out again over a new group in an elastic job (regroup.py), the audit
# of a unit's mixed-precision policy (precision.py), the policy of collectives
# in int8 or int4 blocks (comm_policy.py), and the public function
# (api.py) and the methods it adds to a module (module.py).

from tandem._compat import fsdp_policies
from tandem.fsdp.api import DEFAULT_MIN_UNIT_BYTES, fully_shard
from tandem.fsdp.comm_policy import QuantizedCommPolicy
from tandem.fsdp.init import init_like_unsharded
from tandem.fsdp.layout import ParamShard, UnitLayout, plan_unit
from tandem.fsdp.module import FSDPModule, UnshardHandle
from tandem.fsdp.state_dict import load_full_state_dict

MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy = fsdp_policies()

__all__ = ["CPUOffloadPolicy", "DEFAULT_MIN_UNIT_BYTES", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
           "ParamShard", "QuantizedCommPolicy", "UnitLayout", "UnshardHandle", "fully_shard", "init_like_unsharded",
           "load_full_state_dict", "plan_unit"]
