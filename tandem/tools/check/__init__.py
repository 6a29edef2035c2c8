"""``tandem check``: does my distributed run train the same model as one process?

The user's own model, data, loss and optimizer are trained for a few steps
twice: once as ONE process on each global batch (the reference, in the calling
process), and once as N ranks under DDP, ZeRO-1, ZeRO-2 or fully_shard, each
rank on its shard of every global batch. The parameters (and floating buffers)
after every step are compared, and the report names the largest divergence per
tensor and per step, the first divergence, and what probably caused it.

Two parts, as everywhere in tandem: :func:`compare_snapshots` and
:func:`build_report` are pure (a :class:`CheckReport` from per-step snapshots
and what the runs observed); :func:`check` runs the reference here and the
ranks with :func:`tandem.spawn`, and :func:`main` is the command line.
"""

# The package's files, one concept each:
#
# - ``compare.py`` (pure): tolerances, the snapshot comparison and the first
#   divergence (Notes [what is compared], [first divergence]).
# - ``records.py``: what the two runs observed, the report's inputs.
# - ``diagnose.py`` (pure): what the numbers cannot say alone: rounding-noise
#   gradients (Note [rounding-noise gradients]), batches that do not split the
#   global batch, the first module whose output differs.
# - ``report.py`` (pure): the :class:`CheckReport`, built from the records.
# - ``inputs.py``: the user's model, data, loss and optimizer, from objects or
#   entry points, and the global batch split into the ranks' shards (Note [what
#   the factories are]).
# - ``run.py``: the training both ways: the one-process reference here and each
#   rank's run under a strategy (Note [dropout]).
# - ``api.py``: :func:`check` and :func:`check_strategies`: validate, run the
#   reference, launch the ranks, build the reports.
# - ``cli.py``: the command line, ``tandem check ...`` (:func:`main`).

from tandem.tools.check.api import _check_specs as _check_specs
from tandem.tools.check.api import _make_spec as _make_spec
from tandem.tools.check.api import check, check_strategies
from tandem.tools.check.cli import EXIT_DIVERGES as EXIT_DIVERGES
from tandem.tools.check.cli import EXIT_EQUAL as EXIT_EQUAL
from tandem.tools.check.cli import EXIT_USAGE as EXIT_USAGE
from tandem.tools.check.cli import build_parser, main
from tandem.tools.check.inputs import _Batches as _Batches
from tandem.tools.check.inputs import sample_keys, shard_batch
from tandem.tools.check.compare import (
    DEFAULT_TOLERANCES,
    Comparison,
    Divergence,
    Tolerance,
    compare_snapshots,
    default_tolerance,
)
from tandem.tools.check.records import RankRecord, ReferenceRun
from tandem.tools.check.report import CheckReport, build_report
from tandem.tools.check.run import STRATEGIES

__all__ = ["DEFAULT_TOLERANCES", "STRATEGIES", "CheckReport", "Comparison", "Divergence", "RankRecord",
           "ReferenceRun", "Tolerance", "build_parser", "build_report", "check", "check_strategies",
           "compare_snapshots", "default_tolerance", "main", "sample_keys", "shard_batch"]
