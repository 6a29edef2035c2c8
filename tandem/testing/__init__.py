"""Tools for testing distributed code: a multi-process harness and a collective recorder."""

from tandem.testing.harness import RankFailure, run_distributed

__all__ = ["RankFailure", "run_distributed"]
