"""``tandem plan``: will it fit, and how should I shard it? Answered before
anything is launched, from the model's shapes and one small forward on CPU.

Two parts, as everywhere in tandem: :func:`plan_report` is pure (a
:class:`PlanReport` from the model's parameters and buffers, what was
measured, and the options: DDP's buckets, the memory per rank under DDP,
ZeRO-1, ZeRO-2 and fully_shard (and HSDP with ``hsdp`` replicas: fully_shard's
at ``world_size // hsdp`` ranks) from :func:`tandem.planner.estimate_memory`, the
bytes each rank sends per step (:class:`tandem.planner.Traffic`), which strategy
fits, the batch arithmetic, the warnings); :func:`measure` runs the forward and backward that
measure the activations and find the parameters the forward does not reach;
:func:`plan` and :func:`main` (the command line) tie them together.

On a dp x tp mesh the sizes are per rank of the mesh: the planner resolves the
same ``tp_plan`` that ``parallelize_module`` takes, without applying it, and
plans every size on the parameters' local shapes, with ``world_size`` the
data-parallel size. Activations are still measured on the unsharded model, so
they are overestimated for a tensor-parallel rank.
"""

# The package's files, one concept each:
#
# - ``report.py`` (pure): the :class:`PlanReport`, each strategy's
#   :class:`StrategyMemory`, and the report as text.
# - ``build.py`` (pure): :func:`plan_report`: the report from the model's shapes
#   and a measurement (memory and traffic per strategy, the choice, the warnings),
#   and the options it takes (:func:`parse_bytes`, :data:`OPTIMIZER_STATE_BYTES`,
#   :func:`default_fsdp_units`).
# - ``measure.py``: :func:`measure`: one forward and backward with a sample batch,
#   and the :class:`Measurement` it returns (Note [measured activations]).
# - ``api.py``: :func:`plan`: load the entry points, measure, build the report.
# - ``cli.py``: the command line, ``tandem plan ...`` (:func:`main`).
#
# On a dp x tp mesh: Note [planning a tensor-parallel mesh] in tandem/planner/tensor_parallel.py.

from tandem.tools.plan.api import plan
from tandem.tools.plan.build import OPTIMIZER_STATE_BYTES, default_fsdp_units, parse_bytes, plan_report
from tandem.tools.plan.cli import build_parser as build_parser
from tandem.tools.plan.cli import main
from tandem.tools.plan.measure import Measurement, measure
from tandem.tools.plan.report import PlanReport, StrategyMemory

__all__ = ["OPTIMIZER_STATE_BYTES", "Measurement", "PlanReport", "StrategyMemory", "default_fsdp_units",
           "main", "measure", "parse_bytes", "plan", "plan_report"]
