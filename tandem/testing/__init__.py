"""Tools for testing distributed code: a multi-process harness, comparisons, a
parameter's gradient and a sharded module as a test reads them, samples that
carry their index, nodes on one machine as network namespaces, and one rank of
a large world in one process (a fake process group)."""

from tandem.testing.cases import Case, CaseResults, run_cases
from tandem.testing.cluster import Cluster, cluster_unavailable
from tandem.testing.compare import first_difference, max_abs_diff, prefixed, raised_by
from tandem.testing.concurrent import start_concurrently
from tandem.testing.fake_world import fake_world
from tandem.testing.grads import grad_of
from tandem.testing.harness import RankFailure, run_distributed, still_running
from tandem.testing.indexed import IndexedSamples
from tandem.testing.sharded import as_dtensor, as_fsdp, sharded_unit

__all__ = ["Case", "CaseResults", "Cluster", "IndexedSamples", "RankFailure", "as_dtensor", "as_fsdp",
           "cluster_unavailable", "fake_world", "first_difference", "grad_of", "max_abs_diff", "prefixed", "raised_by",
           "run_cases", "run_distributed", "sharded_unit", "start_concurrently", "still_running"]
