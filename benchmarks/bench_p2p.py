"""What waiting on a message's parts costs: an elastic replacement's state sent point to point.

Run book::

    python benchmarks/bench_p2p.py                 # 4 ranks, 60 rounds, the soak's MLP (width 512)
    python benchmarks/bench_p2p.py --rounds 100 --hidden 1024

``tandem run`` starts 4 ranks on this host. Rank 0 sends rank 3 what a DDP
replacement receives from it (the model's and an SGD optimizer's state: 12
tensors, 4.5 MB at width 512) with ``tandem.send``/``tandem.recv``, while ranks 1
and 2 compute, as the members of a job on a shared host do. Two ways of waiting
alternate round by round: ``per message``, tandem's (Note [one wait for a
message's parts] in tandem/comm/p2p.py: every part handed to the pair's waiter
thread at once, one watched wait on the last), and ``per part``, the way before
(a watched wait on each part in turn, a handover to the waiter thread each).
Rank 0 prints the median, quartiles and extremes of the send and the receive
for each, and per message / per part.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

ROUNDS, HIDDEN, WORLD = 60, 512, 4


def _summary(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=4)
    return {"median_ms": round(statistics.median(times) * 1e3, 2), "q1_ms": round(q[0] * 1e3, 2),
            "q3_ms": round(q[2] * 1e3, 2), "min_ms": round(min(times) * 1e3, 2),
            "max_ms": round(max(times) * 1e3, 2)}


def worker(rounds: int, hidden: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import tandem
    from tandem.comm import p2p

    tandem.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                          nn.Linear(hidden, 2)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.randn(4, 32, dtype=torch.float64)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    tandems = p2p._wait_all

    def per_part(works: list[Any], peer: int, group: Any, direction: str, during: str, *,
                 header: bool = False) -> None:
        """The way before: one watched wait for each part, in turn."""
        for one in works:
            tandems([one], peer, group, direction, during, header=header)

    ways = {"per message": tandems, "per part": per_part}
    times: dict[str, list[float]] = {name: [] for name in ways}
    work = torch.randn(256, 256)
    for i in range(2 * rounds):
        name = list(ways)[i % 2]
        p2p._wait_all = ways[name]  # type: ignore[assignment]
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            p2p.send(state, WORLD - 1)
            times[name].append(time.perf_counter() - start)
        elif rank == WORLD - 1:
            p2p.recv(0)
            times[name].append(time.perf_counter() - start)
        else:
            while time.perf_counter() - start < 0.03:
                work = torch.tanh(work @ work / 256)
    p2p._wait_all = tandems
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {name: _summary(t) for name, t in times.items() if t})
    if rank == 0:
        sent, received = gathered[0], gathered[WORLD - 1]
        print(json.dumps({"rounds": rounds, "hidden": hidden, "send": sent, "recv": received,
                          "per message / per part, median": {
                              "send": round(sent["per message"]["median_ms"] / sent["per part"]["median_ms"], 3),
                              "recv": round(received["per message"]["median_ms"]
                                            / received["per part"]["median_ms"], 3)}}, indent=1), flush=True)
    tandem.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="rounds of each way, alternated")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="the MLP's width")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds, args.hidden)
        return
    command = [sys.executable, "-m", "tandem", "run", "--nproc-per-node", str(WORLD), os.path.abspath(__file__),
               "--worker", "--rounds", str(args.rounds), "--hidden", str(args.hidden)]
    sys.exit(subprocess.call(command))


if __name__ == "__main__":
    main()
