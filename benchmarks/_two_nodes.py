"""What the benchmarks over two namespaced nodes share: the link's byte
counters and a job of ``tandem run --nnodes 2 --nproc-per-node 2`` on a
:class:`tandem.testing.Cluster`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["launch", "link_bytes", "require_cluster"]


def link_bytes() -> int:
    """Bytes this node's ``eth0`` sent and received: all that crossed its link."""
    stats = Path("/sys/class/net/eth0/statistics")
    return sum(int((stats / f"{d}_bytes").read_text()) for d in ("tx", "rx"))


def launch(cluster: Any, script: Path, run_id: str, tandem_args: Sequence[str], worker_args: Sequence[str],
           env: dict[str, str] | None = None, nproc_per_node: int = 2) -> list[subprocess.Popen]:
    """``tandem run --nnodes 2 --nproc-per-node 2 ... script worker_args`` on each node
    (``nproc_per_node`` workers each), the store on node 0's address; the
    processes, their output piped."""
    procs = []
    for node in range(2):
        argv = [sys.executable, "-m", "tandem", "run", "--nnodes", "2", "--nproc-per-node", str(nproc_per_node),
                "--rdzv-endpoint", f"{cluster.address(0)}:29400", "--rdzv-id", run_id,
                "--local-addr", cluster.address(node), "--rdzv-timeout", "120", *tandem_args, str(script),
                *worker_args]
        procs.append(cluster.popen(node, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env={**os.environ, **(env or {})}))
    return procs


def require_cluster(bench: str) -> None:
    """Exit with the reason when namespaced nodes cannot be built here."""
    from tandem.testing import cluster_unavailable

    reason = cluster_unavailable()
    if reason is not None:
        raise SystemExit(f"{bench} needs network namespaces: {reason}")
