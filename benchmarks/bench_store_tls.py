"""What the stores behind TLS cost (issue 54): a store operation's latency,
and a 64-rank gloo group's build time, through the tunnels of
tandem/launch/tunnel.py (Note [stores behind TLS]) against the plain TCPStore.

Run book::

    python benchmarks/bench_store_tls.py                      # about 1 minute on 2 cores
    python benchmarks/bench_store_tls.py --ops 2000 --rounds 7 --ranks 64 --json /tmp/tls.json

What runs: one TCPStore server on 127.0.0.1, as a node hosting a store runs
it; a server tunnel in front of it (as that node's launcher runs) and a client
tunnel to the server tunnel (as another node's launcher runs), each one
``stunnel`` process keyed by the same secret. "plain" is a client of the store
itself; "tls" a client of the client tunnel, so every operation crosses both
tunnels and the TLS, as one from another node does (both on this machine's
loopback: the network's own time is not in either).

1. Latency (``--ops`` operations a round, ``--rounds`` rounds, the two
   alternating): ``get`` of a small value and ``add`` to a counter, each a
   round trip (torch's ``set`` does not wait for an answer), each round's
   median.
2. A group's build (``--ranks`` ranks, ``--rounds`` rounds alternating):
   ``--ranks`` threads of one process, each with a store client of its own,
   build one ``ProcessGroupGloo`` (the address exchange through the store,
   then the pairs' connections on loopback): the wall time until every rank
   has its group. Threads, not processes: 64 interpreters with torch do not
   fit 2 cores; the group's constructor releases the GIL. Each build runs in
   a process of its own, which exits without tearing the groups down.

Reported: the medians and spread (min-max) of each, and the ratio tls/plain.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.store.listening_store import listening_store  # noqa: E402
from tandem.launch.tunnel import Tunnels  # noqa: E402

_TIMEOUT = datetime.timedelta(seconds=60)


def latency(address: tuple[str, int], ops: int) -> dict[str, float]:
    client = dist.TCPStore(*address, None, False, _TIMEOUT)
    out = {}
    client.set("n", b"0")
    for name, call in (("get", lambda i: client.get("n")), ("add", lambda i: client.add(f"c{i % 64}", 1))):
        call(0)
        times = []
        for i in range(ops):
            t = time.perf_counter()
            call(i)
            times.append(time.perf_counter() - t)
        out[name] = statistics.median(times) * 1e6
    return out


def group_build(address: tuple[str, int], ranks: int, round_: int) -> float:
    clients = [dist.PrefixStore(f"build/{round_}", dist.TCPStore(*address, None, False, _TIMEOUT))
               for _ in range(ranks)]
    groups: list[object] = [None] * ranks
    errors: list[BaseException] = []

    def build(rank: int) -> None:
        try:
            groups[rank] = dist.ProcessGroupGloo(clients[rank], rank, ranks, _TIMEOUT)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(ranks)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    took = time.perf_counter() - t
    if errors:
        raise errors[0]
    groups.clear()  # the groups end here, as the next round builds its own
    return took


def build_in_a_process(address: tuple[str, int], ranks: int, round_: int) -> float:
    """:func:`group_build` in a process of its own, so that its 64 groups' teardown
    does not run beside the next measurement."""
    out = subprocess.run([sys.executable, __file__, "--build", f"{address[0]}:{address[1]}", "--ranks", str(ranks),
                          "--round", str(round_)], capture_output=True, text=True, timeout=300, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--build", default=None, help=argparse.SUPPRESS)  # HOST:PORT: one group build, then exit
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.build:
        host, port = a.build.rsplit(":", 1)
        print(group_build((host, int(port)), a.ranks, a.round), flush=True)
        os._exit(0)  # the groups' teardown is not measured
    server = listening_store("127.0.0.1", 0, timeout=_TIMEOUT)
    key = secrets.token_hex(32).encode()
    with Tunnels(key) as hosting, Tunnels(key) as other:
        public = hosting.serve("127.0.0.1", 0, server.port, "the store")
        ends = {"plain": ("127.0.0.1", server.port),
                "tls": other.reach("127.0.0.1", public, "the store", timeout_s=10)}
        lat: dict[str, dict[str, list[float]]] = {k: {"get": [], "add": []} for k in ends}
        build: dict[str, list[float]] = {k: [] for k in ends}
        for r in range(a.rounds):
            for kind in (("plain", "tls") if r % 2 == 0 else ("tls", "plain")):
                for op, us in latency(ends[kind], a.ops).items():
                    lat[kind][op].append(us)
                build[kind].append(build_in_a_process(ends[kind], a.ranks, 2 * r + (kind == "tls")))
    result = {
        "latency_us": {k: {op: spread(v) for op, v in ops.items()} for k, ops in lat.items()},
        "build_s": {k: spread(v) for k, v in build.items()},
        "ranks": a.ranks, "ops": a.ops, "rounds": a.rounds,
    }
    for op in ("get", "add"):
        plain, tls = (result["latency_us"][k][op] for k in ("plain", "tls"))
        print(f"{op:>4}: plain {plain['median']:.0f} us ({plain['min']:.0f}-{plain['max']:.0f}), "
              f"tls {tls['median']:.0f} us ({tls['min']:.0f}-{tls['max']:.0f}), "
              f"ratio {tls['median'] / plain['median']:.2f}")
    plain_b, tls_b = result["build_s"]["plain"], result["build_s"]["tls"]
    print(f"{a.ranks}-rank gloo group built: plain {plain_b['median']:.2f} s ({plain_b['min']:.2f}-"
          f"{plain_b['max']:.2f}), tls {tls_b['median']:.2f} s ({tls_b['min']:.2f}-{tls_b['max']:.2f}), "
          f"ratio {tls_b['median'] / plain_b['median']:.2f}")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
