"""The per-collective cost of tandem's own wrapper (``GroupComm``: the ledger,
the failure gate): one all-reduce of 8 floats in a gloo world of one, issued
20,000 times, 5 rounds. Compare two checkouts by running it under each::

    PYTHONPATH=<checkout> python benchmarks/bench_group_call.py
"""

import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    from tandem.comm.group import GroupComm

    comm, tensor = GroupComm(), torch.zeros(8)
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(20000):
            comm.all_reduce(tensor, tag="bucket")
        rounds.append((time.perf_counter() - started) / 20000 * 1e6)
    print(f"us per all_reduce: median {statistics.median(rounds):.2f}, rounds {[round(r, 2) for r in rounds]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
