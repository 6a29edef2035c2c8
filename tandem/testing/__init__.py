"""Tools for testing distributed code: a multi-process harness and a collective recorder."""

from tandem.testing.compare import max_abs_diff
from tandem.testing.harness import RankFailure, run_distributed, still_running

__all__ = ["RankFailure", "max_abs_diff", "run_distributed", "still_running"]
