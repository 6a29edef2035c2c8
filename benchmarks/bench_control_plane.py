"""The elastic control plane at a thousand nodes, by simulation: one judge,
one beat per node (issue 55, items 1 and 3).

Run book::

    python benchmarks/bench_control_plane.py                       # 16 to 8,192 ranks: about 10 minutes on 2 cores
    python benchmarks/bench_control_plane.py --ranks 64 --json /tmp/cp.json

What runs: one TCPStore server (libuv, torch's default) in a process of its
own, and N ranks in nodes of ``--per-node`` (8). Each node is its launcher's
:class:`tandem.launch.node_reports.NodeReports` (the real one: a thread and a
client connection of its own, beating every 0.25 s and naming a worker that
ended at once), and each rank the real :class:`tandem.control.membership.Membership`
with ``node=`` that node (as ``tandem run --elastic`` sets ``TANDEM_NODE``): it
does not beat, the generation's rank 0 judges for all and its deputies (the
middle and last ranks) take over when it is gone (Note [judge once] in
tandem/control/judge.py). Ranks and nodes are threads, ``--hosts`` processes of
them (forked from one forkserver that imported torch once); every store client
is wrapped to count its operations (bench_store_scale's CountingStore), the
reports' too. A rank's pid in its node's beat is a number of its own (the
threads share their process's).

Rounds, for each N (every member but a slow one, which never counts itself done,
waits on the decision of a step that cannot commit):

1. idle (``--seconds``): the nodes beat, and each rank's monitor (one thread a
   process beats for its ranks, set and check, as the monitors do: Note [dead
   peers], Note [cut off]), the ranks do nothing else: the load of a job that trains.
   Then every rank waits in a collective of the whole world for ``--seconds``,
   its watch looking once a slice (Note [a watch reads the verdict] in
   tandem/comm/peers.py): at the generation's verdict, and, up to
   ``--sweep-up-to`` ranks, as before, at every peer's beat and process.
2. a worker dies: ``--pre-kill`` seconds into the step (the load of N ranks waiting
   on a late decision), a rank's node reports it ended (what its launcher does
   within ``--monitor-interval``, 0.1 s, of its process's end; the benchmark
   stops its threads at the same moment). Measured: until every survivor's
   ``decide_step`` returned ``abort``; then until every survivor has agreed on
   the next generation (``next_generation``: the store's part of a world change).
3. the judge dies: the same with the generation's rank 0: a deputy takes over.
4. a node goes silent (its launcher and workers with it; the judge's node): from
   its last beat until every survivor knows; ``stale_after_s`` (``--stale-after``)
   plus a second is the goal.

In each window: store operations a second (all, and per node), and the server's
share of one core (its CPU time from /proc; one event-loop thread).

Before a run: the store's server looks up each client's address
(``::ffff:127.0.0.1`` here) by reverse DNS in its one event-loop thread. Where
the resolver lets such lookups time out (this machine's: 5 to 10 s each when
many come at once), every burst of connections stalls the server that long,
and starting 1,024 ranks takes many minutes; the benchmark says so before it
starts. ``echo "::ffff:127.0.0.1 localhost" >> /etc/hosts`` answers them from
the file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from array import array
from multiprocessing.connection import Connection
from typing import Any, cast

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402
from bench_store_scale import HOST, CountingStore, Recorder, client, cpu_seconds, serve_store  # noqa: E402

from tandem.control.generation import PREFIX, ElasticConfig, Generation  # noqa: E402
from tandem.control.membership import Membership  # noqa: E402
from tandem.comm.process_id import node_beat_key  # noqa: E402
from tandem.comm.peers import PeerWatch, heartbeat_key  # noqa: E402
from tandem.store.store_address import StoreAddress, connect  # noqa: E402
from tandem.launch.etcd_plane import EtcdControlPlane  # noqa: E402
from tandem.launch.node_reports import NodeReports  # noqa: E402

FAKE_PID = 1_000_000  # a rank's pid in its node's beat: FAKE_PID + rank


class CountedReports(NodeReports):
    """A node's launcher, whose store operations are counted."""

    def __init__(self, node: str, recorder: Recorder) -> None:
        super().__init__(node)
        self._recorder = recorder

    def _store(self, address: StoreAddress) -> dist.Store:
        if self._client is None:
            self._client = (address, cast(dist.Store, CountingStore(_client(address), self._recorder)))
        return self._client[1]


class CountedMember(Membership):
    """A rank: Membership unchanged, over counted clients (its judge's connection of its own too)."""

    def __init__(self, store: dist.Store, member: str, generation: Generation, config: ElasticConfig,
                 **kwargs: Any) -> None:
        super().__init__(store, member, generation, config, **kwargs)
        counting = cast(CountingStore, store)
        self._beat_store = cast(dist.Store, CountingStore(counting.store.clone(), counting.recorder))

    def _news_store(self) -> dist.Store | None:
        counting = cast(CountingStore, self.store)  # its news thread's connection, counted too
        if not isinstance(counting.store, dist.TCPStore):
            return None
        return cast(dist.Store, CountingStore(counting.store.clone(), counting.recorder))


# ---------------------------------------------------------------------- a host process
class Host:
    """Nodes ``nodes`` (their launchers and ranks) as threads of this process, driven over ``conn``."""

    def __init__(self, conn: Connection, address: StoreAddress, nodes: list[int], per_node: int, world_size: int,
                 config: ElasticConfig) -> None:
        self.conn = conn
        self.address = address
        self.per_node = per_node
        self.recorder = Recorder()
        self._send_lock = threading.Lock()
        self.reports = {k: CountedReports(f"node{k}", self.recorder) for k in nodes}
        for r in self.reports.values():
            r.beat_in(address)
        beats = _client(address)
        beats.wait([node_beat_key(r.node) for r in self.reports.values()], datetime.timedelta(seconds=60))
        self.liveness = config.liveness()
        self.members: dict[str, CountedMember] = {}
        for k in nodes:
            for rank in range(k * per_node, (k + 1) * per_node):
                store = cast(dist.Store, CountingStore(_client(address), self.recorder))
                m = cast(CountedMember, CountedMember.founding(store, rank, world_size, config, node=f"node{k}"))
                assert m.node == f"node{k}", "a rank beats for itself: its node's beat was not in the store"
                m.store.set(f"{PREFIX}/node_of/{rank}", f"node{k} {FAKE_PID + rank}")
                self.members[str(rank)] = m
        # Each rank's monitor beats (Note [dead peers]; ElasticConfig.liveness: five times a window)
        # and checks that its beat landed (Note [cut off]): one thread beats for this process's ranks.
        self._monitors = threading.Thread(target=self._beat_for_monitors, daemon=True)
        self._stopped = threading.Event()
        self._monitors.start()

    def _beat_for_monitors(self) -> None:
        store = cast(dist.Store, CountingStore(_client(self.address), self.recorder))
        beats = 0
        while not self._stopped.is_set():
            ranks = list(self.members)
            started = time.monotonic()
            beats += 1
            for i, rank in enumerate(ranks):  # spread over the interval, as the monitors' own threads are
                if self._stopped.wait(max(0.0, started + i * self.liveness.beat_s / len(ranks) - time.monotonic())):
                    return
                store.set(heartbeat_key(int(rank)), str(beats))
                store.check([heartbeat_key(int(rank))])
            self._stopped.wait(max(0.0, started + self.liveness.beat_s - time.monotonic()))

    def send(self, *message: Any) -> None:
        with self._send_lock:
            self.conn.send(message)

    def serve(self) -> None:
        while True:
            command, arg = self.conn.recv()
            if command == "step":
                threading.Thread(target=self._step, args=arg, daemon=True).start()
            elif command == "next":
                threading.Thread(target=self._next, args=(arg,), daemon=True).start()
            elif command == "kill":
                member = self.members.pop(arg)
                member.stop()
                node = self.reports[int(arg) // self.per_node]
                at = time.time()
                node.post(self.address, FAKE_PID + int(arg), f"its process (pid {FAKE_PID + int(arg)}) was "
                          "killed by SIGKILL, seen by its launcher")
                self.send("killed", at)
            elif command == "silence":
                node = self.reports.pop(arg)
                node.stop()
                for rank in [r for r in self.members if int(r) // self.per_node == arg]:
                    self.members.pop(rank).stop()
                last = _client(self.address).get(node_beat_key(node.node))
                self.send("silenced", json.loads(last)["at"])
            elif command == "seat":  # every member takes its seat in judging, as its first step's decision does
                for m in self.members.values():
                    m._judge_of(m.generation)
                verdict = f"{PREFIX}/gen/{self.members[next(iter(self.members))].generation.number}/verdict"
                _client(self.address).wait([verdict], datetime.timedelta(seconds=60))
                self.send("seated", None)
            elif command == "collective":
                threading.Thread(target=self._collective, args=arg, daemon=True).start()
            elif command == "records":
                self.send("records", self.recorder.export())
            elif command == "stop":
                self._stopped.set()
                for m in self.members.values():
                    m.stop()
                for r in self.reports.values():
                    r.stop()
                self.send("stopped", None)
                return

    def _step(self, number: int, members: list[str], step: int, slow: str) -> None:
        generation = Generation(number, tuple(members))
        out: list[tuple[str, float, str]] = []
        lock = threading.Lock()

        def one(m: CountedMember) -> None:
            if m.generation != generation:  # the same one kept: its judge aborts for it (Note [judge once])
                m.generation = generation
            decision = m.decide_step(step)
            with lock:
                out.append((m.member, time.time(), decision.value))

        wanted = set(members)
        threads = [threading.Thread(target=one, args=(m,), daemon=True)
                   for m in list(self.members.values()) if m.member != slow and m.member in wanted]
        for t in threads:
            t.start()
        self.send("started", len(threads))
        for t in threads:
            t.join()
        self.send("decided", out)

    def _collective(self, world: int, seconds: float, verdict: bool) -> None:
        """Every rank waits in a collective of the whole world for ``seconds``: a slice,
        then its watch's look (Note [dead peers]): the generation's verdict (``verdict``:
        Note [a watch reads the verdict]), or every peer's beat and process."""
        ranks = list(range(world))
        ends = time.monotonic() + seconds

        def one(m: CountedMember) -> None:
            watch = PeerWatch(m.store, int(m.member), self.liveness)
            watch.departed = m.departed
            watch.judged = m.judged_ranks if verdict else None
            while time.monotonic() < ends:
                time.sleep(self.liveness.slice_s)
                watch.observe(ranks)

        threads = [threading.Thread(target=one, args=(m,), daemon=True) for m in self.members.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.send("waited", len(threads))

    def _next(self, gone: list[str]) -> None:
        known_dead = {m: "has died (the benchmark killed it)" for m in gone}
        out: list[tuple[str, float, int]] = []
        lock = threading.Lock()

        def one(m: CountedMember) -> None:
            generation = m.next_generation(known_dead=known_dead)
            with lock:
                out.append((m.member, time.time(), generation.number))

        threads = [threading.Thread(target=one, args=(m,), daemon=True) for m in list(self.members.values())]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.send("next", out)


def _client(address: StoreAddress) -> dist.Store:
    """A store client of the benchmark's store: a TCP store's, or an etcd cluster's."""
    return client(address[1]) if isinstance(address, tuple) else connect(address, 60.0)


def host(conn: Connection, address: StoreAddress, nodes: list[int], per_node: int, world_size: int, beat_s: float,
         stale_after_s: float) -> None:
    config = ElasticConfig(beat_s=beat_s, stale_after_s=stale_after_s, regroup_timeout_s=600.0)
    h = Host(conn, address, nodes, per_node, world_size, config)
    h.send("ready", len(h.members))
    h.serve()


# ---------------------------------------------------------------------- the benchmark's side
class Job:
    def __init__(self, ctx: Any, n: int, args: argparse.Namespace) -> None:
        self.n, self.args = n, args
        self.per_node = args.per_node
        self.planes: list[EtcdControlPlane] = []
        self.address: StoreAddress
        if args.store == "etcd":  # three members on this machine, as --rdzv-backend etcd starts them on three nodes
            ports = _port_pairs(3)
            endpoints = ",".join(f"{HOST}:{p}" for p in ports)
            self.planes = [EtcdControlPlane(endpoints, "bench", b"the benchmark's job secret", member=str(i))
                           for i in range(3)]
            for plane in self.planes:
                plane.start()
            self.address = self.planes[0].address("workers/bench")
            self.server_pids = [cast(int, plane.member.pid) for plane in self.planes if plane.member is not None]
        else:
            parent, child = ctx.Pipe()
            self.server = ctx.Process(target=serve_store, args=(child,), daemon=True)
            self.server.start()
            self._server_conn = parent
            self.address = (HOST, parent.recv())
            self.server_pids = [cast(int, self.server.pid)]
        nodes = n // args.per_node
        hosts = min(args.hosts, nodes)
        self.hosts: list[Connection] = []
        self.procs = []
        self.node_host: dict[int, Connection] = {}
        for h in range(hosts):
            mine = list(range(h * nodes // hosts, (h + 1) * nodes // hosts))
            parent, child = ctx.Pipe()
            p = ctx.Process(target=host, daemon=True, args=(child, self.address, mine, args.per_node, n, args.beat,
                                                             args.stale_after))
            p.start()
            self.procs.append(p)
            self.hosts.append(parent)
            self.node_host.update({k: parent for k in mine})
        for conn in self.hosts:
            self.expect(conn, "ready", 600)

    def server_cpu(self) -> float:
        """CPU seconds of the store's server: the TCP store's process, or every etcd member's."""
        return sum(cpu_seconds(pid) for pid in self.server_pids)

    def expect(self, conn: Connection, what: str, timeout_s: float) -> Any:
        if not conn.poll(timeout_s):
            raise RuntimeError(f"N={self.n}: a host sent no '{what}' within {timeout_s:.0f} s")
        word, value = conn.recv()
        if word != what:
            raise RuntimeError(f"N={self.n}: expected '{what}' from a host, got '{word}': {value}")
        return value

    def window(self, name: str, seconds: float, t0: float, cpu0: float) -> dict[str, Any]:
        """Store operations and server CPU between monotonic ``t0`` and now."""
        t1, cpu1 = time.monotonic(), self.server_cpu()
        ops = 0
        for conn in self.hosts:
            conn.send(("records", None))
        for conn in self.hosts:
            for ends, _, _ in self.expect(conn, "records", 120):
                e = array("d")
                e.frombytes(ends)
                ops += sum(1 for x in e if t0 <= x <= t1)
        wall = t1 - t0
        return {"window": name, "seconds": round(wall, 2), "ops_per_s": round(ops / wall, 1),
                "ops_per_s_per_node": round(ops / wall / (self.n // self.per_node), 2),
                "server_core_share": round((cpu1 - cpu0) / wall, 3)}

    def collective(self, seconds: float, verdict: bool) -> dict[str, Any]:
        """Every rank in a watched wait for ``seconds``, each in its judging seat and the
        generation's first verdict posted: the store's load."""
        for conn in self.hosts:
            conn.send(("seat", None))
        for conn in self.hosts:
            self.expect(conn, "seated", 120)
        t0, cpu0 = time.monotonic(), self.server_cpu()
        for conn in self.hosts:
            conn.send(("collective", (self.n, seconds, verdict)))
        for conn in self.hosts:
            self.expect(conn, "waited", 120 + seconds * 10)
        what = "the verdict" if verdict else "every peer"
        return self.window(f"waiting in a collective, a slice reading {what}", seconds, t0, cpu0)

    def round(self, number: int, members: list[str], step: int, slow: str, kill: str | None,
              silence: int | None) -> dict[str, Any]:
        for conn in self.hosts:
            conn.send(("step", (number, members, step, slow)))
        waiting = sum(self.expect(conn, "started", 120 + self.n / 10) for conn in self.hosts)
        t0, cpu0 = time.monotonic(), self.server_cpu()
        time.sleep(self.args.pre_kill)
        load = self.window("waiting on a late decision", self.args.pre_kill, t0, cpu0)
        if kill is not None:
            conn = self.node_host[int(kill) // self.per_node]
            conn.send(("kill", kill))
            at = self.expect(conn, "killed", 60)
            gone = [kill]
        else:
            assert silence is not None
            conn = self.node_host[silence]
            conn.send(("silence", silence))
            at = self.expect(conn, "silenced", 60)
            gone = [str(r) for r in range(silence * self.per_node, (silence + 1) * self.per_node)]
        results = [r for c in self.hosts for r in self.expect(c, "decided", 600)]
        survivors = [(m, t, d) for m, t, d in results if m not in gone]
        seen = sorted(t - at for _, t, _ in survivors)
        decisions = sorted({d for _, _, d in survivors})
        # the next generation, agreed by every survivor (the slow one too)
        start = time.time()
        for c in self.hosts:
            c.send(("next", gone))
        agreed = [r for c in self.hosts for r in self.expect(c, "next", 600)]
        return {"gone": gone if kill is not None else f"node{silence} ({len(gone)} ranks)",
                "waiting": waiting, "load": load, "survivors": len(survivors), "decisions": decisions,
                "know_median_s": round(statistics.median(seen), 3), "know_last_s": round(seen[-1], 3),
                "next_generation_s": round(max(t for _, t, _ in agreed) - start, 3),
                "next_generation": sorted({g for _, _, g in agreed})}

    def close(self) -> None:
        for conn in self.hosts:
            conn.send(("stop", None))
        for conn in self.hosts:
            self.expect(conn, "stopped", 60)
        if self.planes:
            for plane in self.planes:
                plane.close()
        else:
            self._server_conn.send("stop")
        for p in [*self.procs, *([] if self.planes else [self.server])]:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def run_size(ctx: Any, n: int, args: argparse.Namespace) -> dict[str, Any]:
    print(f"N={n}: the store, {n // args.per_node} nodes and {n} ranks ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    job = Job(ctx, n, args)
    out: dict[str, Any] = {"ranks": n, "nodes": n // args.per_node, "start_s": round(time.monotonic() - started, 1)}
    try:
        t0, cpu0 = time.monotonic(), job.server_cpu()
        time.sleep(args.seconds)
        out["idle"] = job.window("idle: the nodes and the ranks' monitors beat", args.seconds, t0, cpu0)
        out["collective"] = [job.collective(args.seconds, verdict=True)]
        if n <= args.sweep_up_to:  # as before: each slice of each rank reads every peer
            out["collective"].append(job.collective(args.seconds, verdict=False))
        members = [str(r) for r in range(n)]
        slow = members[-1]
        victim = members[n // 3 if n // 3 != n // 2 else 1]  # a rank that does not judge
        rounds = [job.round(0, members, 0, slow, victim, None)]
        members = [m for m in members if m != victim]
        rounds.append(job.round(1, members, 0, slow, members[0], None))  # the judge
        judge_node = int(members[0]) // args.per_node
        members = members[1:]
        rounds.append(job.round(2, members, 0, slow, None, int(members[0]) // args.per_node))
        assert int(members[0]) // args.per_node == judge_node
        out["rounds"] = rounds
    finally:
        job.close()
    for label, r in zip(("a worker dies", "the judge dies", "the judge's node goes silent"), out["rounds"]):
        print(f"N={n}: {label}: every survivor knew in {r['know_last_s']:.2f} s (median {r['know_median_s']:.2f}), "
              f"{r['decisions']}; next generation agreed in {r['next_generation_s']:.2f} s; while waiting "
              f"{r['load']['ops_per_s']:.0f} ops/s, server {100 * r['load']['server_core_share']:.0f}% of a core",
              file=sys.stderr, flush=True)
    print(f"N={n}: idle {out['idle']['ops_per_s']:.0f} ops/s ({out['idle']['ops_per_s_per_node']:.1f} a node), "
          f"server {100 * out['idle']['server_core_share']:.0f}% of a core; started in {out['start_s']:.0f} s",
          file=sys.stderr, flush=True)
    for w in out["collective"]:
        print(f"N={n}: {w['window']}: {w['ops_per_s']:.0f} ops/s ({w['ops_per_s_per_node']:.1f} a node), "
              f"server {100 * w['server_core_share']:.0f}% of a core", file=sys.stderr, flush=True)
    return out


def _port_pairs(n: int) -> list[int]:
    """``n`` free client ports on loopback, each with the next port free too (an etcd member's peer port)."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind((HOST, port + 1))
        except OSError:
            continue
        if not {port, port + 1} & {q for p in ports for q in (p, p + 1)}:
            ports.append(port)
    return ports


def slow_reverse_lookups() -> float:
    """The longest of 50 reverse lookups of ``::ffff:127.0.0.1`` made at once, in seconds."""
    took: list[float] = []

    def one() -> None:
        start = time.monotonic()
        try:
            socket.getnameinfo(("::ffff:127.0.0.1", 1, 0, 0), 0)
        except OSError:
            pass
        took.append(time.monotonic() - start)

    threads = [threading.Thread(target=one) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(took)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256, 1024, 8192])
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--hosts", type=int, default=16, help="processes the nodes are spread over")
    parser.add_argument("--seconds", type=float, default=5.0, help="the idle window")
    parser.add_argument("--pre-kill", type=float, default=4.0, help="seconds of waiting before each death")
    parser.add_argument("--beat", type=float, default=0.25, help="the members' beat_s (the judge's period)")
    parser.add_argument("--stale-after", type=float, default=10.0, help="the members' stale_after_s")
    parser.add_argument("--store", choices=("tcp", "etcd"), default="tcp",
                        help="the control plane: one TCPStore (the default), or a 3-member etcd cluster over TLS "
                             "(--rdzv-backend etcd's), all on this machine")
    parser.add_argument("--sweep-up-to", type=int, default=256,
                        help="up to this many ranks, also time a collective's wait whose slices read every peer")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    lookup = slow_reverse_lookups()
    if lookup > 1.0:
        print(f"warning: reverse lookups of ::ffff:127.0.0.1 take {lookup:.1f} s here; each burst of connections "
              "will stall the store's server that long (see the run book)", file=sys.stderr, flush=True)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # Note [a timed-out wait's warnings] in bench_store_scale
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch.distributed", "tandem.control.membership", "tandem.launch.node_reports",
                                "tandem.store.etcd_store"])
    results = [run_size(ctx, n, args) for n in args.ranks]
    summary = {"argv": sys.argv[1:], "store": args.store, "per_node": args.per_node, "beat_s": args.beat,
               "stale_after_s": args.stale_after, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
