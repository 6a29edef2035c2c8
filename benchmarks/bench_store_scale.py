"""How tandem's elastic membership scales past this machine: N light members
beating against one c10d TCPStore, by simulation (issue 32, item 5).

Run book::

    python benchmarks/bench_store_scale.py                   # 16, 64, 256 members: about 3.5 minutes on 2 cores
    python benchmarks/bench_store_scale.py --members 64 --seconds 5 --kills 1
    python benchmarks/bench_store_scale.py --interval 0.1 --json /tmp/store.json

What runs: one TCPStore server (libuv, torch's default; one event-loop thread)
in a child process of its own, and N members, each the real
:class:`tandem.control.membership.Membership` (built by ``Membership.founding``)
with a TCPStore client connection of its own. Nothing of Membership is
reproduced: the store sees its own keys and operations (Note [elastic
membership]): the ``beat/<id>`` ``set`` every ``beat_s`` from Membership's own
thread, ``dead()``'s ``check`` and ``get`` for every other member,
``decide_step``'s ``add``, ``wait`` and ``compare_set``. A thin wrapper around
each client (:class:`CountingStore`) times every operation, and a subclass
(:class:`WatchedMembership`) times each ``dead()`` call and notes whom it named.
A member imports ``tandem.control.membership`` (and so ``tandem.comm``), not DDP,
FSDP or the Trainer.

Members are threads, not processes: 256 interpreters with torch (about 220 MB
and seconds of import each) do not fit 2 cores. They run ``--threads`` (32) to
a process, forked from one forkserver that imported torch.distributed and the
membership module once; a store call releases the GIL, so the threads of a
process overlap their waits as processes would. ``--kills`` members (the
victims, spread over the ids, since ``dead()`` reads the members in id order)
are processes of their own, so that a SIGKILL takes exactly one member, as a
dead worker would. The members run with ``TORCH_CPP_LOG_LEVEL=ERROR`` (Note [a
timed-out wait's warnings]; ``--c10d-warnings`` leaves torch's default).

Phases, for each N:

1. beat (``--seconds``): the members only beat. Then, from the benchmark's own
   client, one ``dead()`` over all the members (2N operations) against the same
   read as one ``check`` and one ``multi_get`` of every beat key (2 operations).
2. detect (``--kills`` rounds): every live member calls ``decide_step`` on a
   step that cannot commit (a victim never counts itself done), so each waits
   for the decision in ``beat_s`` slices and, between slices, runs ``dead()``
   over all the others: what every survivor does while a member dies in a
   step. ``--pre-kill`` seconds in, a victim is SIGKILLed. Per kill: the time
   until the first member returns from ``decide_step`` with ``abort`` (it saw
   the victim stale) and until the last does (every survivor knows); and the
   verdicts that named a live member dead (each ``dead()`` call that did counts).
3. saturate (largest N only, ``--saturate-intervals``): the members only beat,
   with a shorter ``beat_s`` each window, until the beats per second stop
   following the offered rate or the store falls behind.

In each window: store operations per second (all members, and per member);
the latency of one operation seen by a member (median, p99; ``wait`` excluded,
it blocks by design; a ``set`` is not answered by the server, so a beat's
latency is its send); the duration of one ``dead()``; and, from a probe that
reads every live member's beat about every 0.5 s (:class:`Probe`), the oldest
beat in the store, judged as ``dead()`` judges it, the reads that found one
older than ``stale_after_s`` (each a false death for whoever read it then), and
how long the read took (the server's backlog).

The server's CPU time (from /proc) gives its share of one core and its CPU per
operation; its one event-loop thread cannot use more than one core. The
members' CPU is this machine's too (2 cores for server and members together):
a member's latency here is an upper bound on what a member would see from
another host, and where the machine is busy near 100 %, the clients, not the
server, set the pace.

What a real elastic worker adds that these members do not: the monitor's own
beat (``tandem/alive/<rank>``, one more ``set`` per beat: Note [dead peers] in
tandem/comm/peers.py) and, in a collective's watched wait, ``PeerWatch``'s
``check`` and ``get`` of every peer every 0.5 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import sys
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from tandem.control.generation import PREFIX, ElasticConfig, Generation
from tandem.control.membership import Membership

HOST = "127.0.0.1"
CLIENT_TIMEOUT = datetime.timedelta(seconds=120)

# Operation codes in a Recorder (SWEEP is one dead() call, not a store operation).
SET, BEAT, GET, CHECK, ADD, COMPARE_SET, WAIT, MULTI_GET, SWEEP = range(9)


class Recorder:
    """This process's store operations: per thread, when each ended, how long it
    took and which it was (three arrays, appended by their own thread only)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._threads: list[tuple[array[float], array[float], array[int]]] = []

    def record(self, op: int, start: float, end: float) -> None:
        mine = getattr(self._local, "arrays", None)
        if mine is None:
            mine = (array("d"), array("d"), array("b"))
            self._local.arrays = mine
            with self._lock:
                self._threads.append(mine)
        mine[0].append(end)
        mine[1].append(end - start)
        mine[2].append(op)

    def export(self) -> list[tuple[bytes, bytes, bytes]]:
        with self._lock:
            return [(e.tobytes(), d.tobytes(), o.tobytes()) for e, d, o in self._threads]


class CountingStore:
    """A TCPStore client that records each of its operations in ``recorder``;
    the operations Membership calls, forwarded unchanged."""

    def __init__(self, store: dist.Store, recorder: Recorder) -> None:
        self.store = store
        self.recorder = recorder
        self.beats: array[float] = array("d")  # when each of this member's beats ended

    def _timed(self, op: int, call: Callable[..., Any], *args: Any) -> Any:
        start = time.monotonic()
        try:
            return call(*args)
        finally:
            self.recorder.record(op, start, time.monotonic())

    def set(self, key: str, value: str | bytes) -> None:
        if "/beat/" in key:
            self._timed(BEAT, self.store.set, key, value)
            self.beats.append(time.monotonic())
        else:
            self._timed(SET, self.store.set, key, value)

    def get(self, key: str) -> bytes:
        return cast(bytes, self._timed(GET, self.store.get, key))

    def check(self, keys: list[str]) -> bool:
        return cast(bool, self._timed(CHECK, self.store.check, keys))

    def add(self, key: str, amount: int) -> int:
        return cast(int, self._timed(ADD, self.store.add, key, amount))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return cast(bytes, self._timed(COMPARE_SET, self.store.compare_set, key, expected, desired))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._timed(WAIT, self.store.wait, keys)
        else:
            self._timed(WAIT, self.store.wait, keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return cast(list[bytes], self._timed(MULTI_GET, self.store.multi_get, keys))


class WatchedMembership(Membership):
    """Membership, unchanged, whose ``dead()`` is timed and whose verdicts are
    kept (when, and whom it named) for the benchmark to judge."""

    def __init__(self, store: dist.Store, member: str, generation: Generation, config: ElasticConfig,
                 *, clock: Callable[[], float] = time.time) -> None:
        super().__init__(store, member, generation, config, clock=clock)
        self.named_dead: list[tuple[float, str]] = []
        # Over a TCPStore, Membership beats and judges through a connection of its own
        # (own_tcp_client: Store.clone); the counting wrapper hides it, so it is made here.
        counting = cast(CountingStore, store)
        beats = CountingStore(counting.store.clone(), counting.recorder)
        beats.beats = counting.beats  # the member's beats, as the benchmark reads them
        self._beat_store = cast(dist.Store, beats)

    def dead(self, members: Sequence[str]) -> dict[str, str]:
        start = time.monotonic()
        out = super().dead(members)
        end = time.monotonic()
        cast(CountingStore, self.store).recorder.record(SWEEP, start, end)
        self.named_dead.extend((end, m) for m in out)
        return out

    def beat_thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def client(port: int) -> dist.Store:
    return dist.TCPStore(HOST, port, is_master=False, wait_for_workers=False, timeout=CLIENT_TIMEOUT)


def found(port: int, rank: int, world_size: int, config: ElasticConfig, recorder: Recorder) -> WatchedMembership:
    store = cast(dist.Store, CountingStore(client(port), recorder))
    return cast(WatchedMembership, WatchedMembership.founding(store, rank, world_size, config))


# Note [a timed-out wait's warnings]
# Membership waits for a step's decision in slices of beat_s (a store.wait with
# a timeout). Each slice that ends without the decision makes torch's TCPStore
# client log two C++ warnings ("waitForInput: poll for socket ... returned 0,
# likely a timeout", "... timed out after 250ms"), and formatting the socket
# for them calls getnameinfo without NI_NUMERICHOST: a reverse DNS lookup, made
# with the client's lock held. Where the resolver drops a query (this machine's
# dropped 8 of 80, 5.0 s each), that slice lasts 5.25 s, and the member's own
# beat, which goes through the same client, waits as long: live members were
# named dead. That measures the resolver, not the store, so the members run
# with TORCH_CPP_LOG_LEVEL=ERROR unless --c10d-warnings.


# ---------------------------------------------------------------------- child processes
def serve_store(conn: Connection) -> None:
    """The store's host: the server runs on its own event-loop thread; this one
    waits for the word to end."""
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=CLIENT_TIMEOUT)
    conn.send(store.port)
    conn.recv()


def victim(port: int, rank: int, world_size: int, beat_s: float, stale_after_s: float) -> None:
    """One member in a process of its own, which only beats until it is killed."""
    config = ElasticConfig(beat_s=beat_s, stale_after_s=stale_after_s)
    Membership.founding(client(port), rank, world_size, config)
    while True:
        time.sleep(60)


def host_members(conn: Connection, port: int, ranks: list[int], world_size: int, beat_s: float,
                 stale_after_s: float) -> None:
    """Members ``ranks`` as threads of this process, driven by commands on ``conn``."""
    recorder = Recorder()
    config = ElasticConfig(beat_s=beat_s, stale_after_s=stale_after_s)
    members = [found(port, r, world_size, config, recorder) for r in ranks]
    conn.send(("ready", len(members)))
    while True:
        command, arg = conn.recv()
        if command == "step":
            number, alive, step = arg
            conn.send(("step", step_that_cannot_commit(conn, members, Generation(number, tuple(alive)), step)))
        elif command == "interval":
            for m in members:
                m.config = dataclasses.replace(m.config, beat_s=arg)
            conn.send(("interval", arg))
        elif command == "stop":
            alive_threads = sum(m.beat_thread_alive() for m in members)
            for m in members:
                m.stop()
            named = [(t, m.member, who) for m in members for t, who in m.named_dead]
            beats = [cast(CountingStore, m.store).beats.tobytes() for m in members]
            conn.send(("data", {"records": recorder.export(), "beats": beats, "named_dead": named,
                                "beat_threads_alive": alive_threads, "members": len(members)}))
            return


def step_that_cannot_commit(conn: Connection, members: list[WatchedMembership], generation: Generation,
                            step: int) -> list[tuple[str, float, str]]:
    """Every member of this process calls ``decide_step(step)`` in ``generation``;
    returns (member, when it returned, the decision) for each."""
    out: list[tuple[str, float, str]] = []

    def one(m: WatchedMembership) -> None:
        m.generation = generation
        decision = m.decide_step(step)
        out.append((m.member, time.monotonic(), decision.value))

    threads = [threading.Thread(target=one, args=(m,), daemon=True) for m in members]
    for t in threads:
        t.start()
    conn.send(("started", len(threads)))
    for t in threads:
        t.join()
    return out


# ---------------------------------------------------------------------- measurement helpers
def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid``, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine, all cores."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


@dataclasses.dataclass
class Window:
    """A phase's interval of monotonic time, and what the server and the machine spent in it."""

    name: str
    start: float
    server_cpu0: float
    ticks0: tuple[int, int]
    end: float = 0.0
    server_cpu_s: float = 0.0
    machine_busy: float = 0.0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def open(cls, name: str, server_pid: int, **extra: Any) -> Window:
        return cls(name, time.monotonic(), cpu_seconds(server_pid), machine_ticks(), extra=dict(extra))

    def close(self, server_pid: int) -> None:
        self.end = time.monotonic()
        self.server_cpu_s = cpu_seconds(server_pid) - self.server_cpu0
        busy, total = machine_ticks()
        self.machine_busy = (busy - self.ticks0[0]) / max(1, total - self.ticks0[1])


@dataclasses.dataclass
class Threads:
    """Every member thread's records, from all the member processes."""

    ends: list[np.ndarray]
    durs: list[np.ndarray]
    ops: list[np.ndarray]
    beats: list[np.ndarray]  # per member: when each beat ended

    @classmethod
    def from_exports(cls, data: list[dict[str, Any]]) -> Threads:
        ends, durs, ops = [], [], []
        for d in data:
            for e, t, o in d["records"]:
                n = min(len(e) // 8, len(t) // 8, len(o))
                ends.append(np.frombuffer(e, dtype=np.float64)[:n])
                durs.append(np.frombuffer(t, dtype=np.float64)[:n])
                ops.append(np.frombuffer(o, dtype=np.int8)[:n])
        beats = [np.frombuffer(b, dtype=np.float64) for d in data for b in d["beats"]]
        return cls(ends, durs, ops, beats)

    def summary(self, w: Window, n_members: int, stale_after_s: float) -> dict[str, Any]:
        seconds = w.end - w.start
        count = 0
        beats = 0
        latencies: list[np.ndarray] = []
        sweeps: list[np.ndarray] = []
        gaps: list[float] = []
        late = 0
        for e, d, o in zip(self.ends, self.durs, self.ops):
            inside = (e >= w.start) & (e < w.end)
            store_op = inside & (o != SWEEP)
            count += int(store_op.sum())
            latencies.append(d[store_op & (o != WAIT)])
            sweeps.append(d[inside & (o == SWEEP)])
        for beat_ends in self.beats:
            beats += int(((beat_ends >= w.start) & (beat_ends < w.end)).sum())
            # Gaps that end inside the window, and the one still open at its end.
            before = beat_ends[beat_ends < w.end]
            thread_gaps = np.diff(before)[before[1:] >= w.start] if len(before) > 1 else np.empty(0)
            if len(before):
                thread_gaps = np.append(thread_gaps, w.end - before[-1])
            gaps.extend(thread_gaps.tolist())
            late += int((thread_gaps > stale_after_s).sum())
        lat = np.concatenate(latencies) if latencies else np.empty(0)
        sweep = np.concatenate(sweeps) if sweeps else np.empty(0)
        return {
            "phase": w.name, "measured_members": n_members, "seconds": round(seconds, 2), **w.extra,
            "ops": count, "ops_per_s": count / seconds, "ops_per_member_s": count / seconds / n_members,
            "beats_per_s": beats / seconds,
            "op_p50_ms": float(np.percentile(lat, 50)) * 1e3 if len(lat) else None,
            "op_p99_ms": float(np.percentile(lat, 99)) * 1e3 if len(lat) else None,
            "beat_gap_max_s": max(gaps) if gaps else None,
            "beat_gap_p99_s": float(np.percentile(gaps, 99)) if gaps else None,
            "late_beats": late,
            "sweep_p50_s": float(np.percentile(sweep, 50)) if len(sweep) else None,
            "sweep_p99_s": float(np.percentile(sweep, 99)) if len(sweep) else None,
            "server_cpu_pct": 100 * w.server_cpu_s / seconds,
            "server_us_per_op": 1e6 * w.server_cpu_s / count if count else None,
            "machine_busy_pct": 100 * w.machine_busy,
        }


def sweep_costs(port: int, n: int, config: ElasticConfig, repeats: int = 5) -> dict[str, Any]:
    """One ``dead()`` over all N members (check and get each) against one
    ``check`` and one ``multi_get`` of every beat key, from a client that is not
    a member; medians of ``repeats``."""
    store = client(port)
    ids = [str(r) for r in range(n)]
    observer = Membership(store, "observer", Generation(0, tuple(ids)), config)
    keys = [f"{PREFIX}/beat/{m}" for m in ids]
    one_by_one, batched = [], []
    for _ in range(repeats):
        start = time.monotonic()
        observer.dead(ids)
        one_by_one.append(time.monotonic() - start)
        start = time.monotonic()
        if store.check(keys):
            store.multi_get(keys)
        batched.append(time.monotonic() - start)
    return {"dead_sweep_ms": 1e3 * statistics.median(one_by_one), "dead_sweep_ops": 2 * n,
            "multi_get_sweep_ms": 1e3 * statistics.median(batched), "multi_get_sweep_ops": 2}


class Probe:
    """The store's view of the beats: about every ``period_s``, one ``check`` and one
    ``multi_get`` of the live members' beat keys from a client of the benchmark's
    own; the oldest beat's age, judged as ``dead()`` judges (the time taken before
    the read, minus the beat's), and how long the read took. A ``set`` is not
    answered, so only a read shows a beat the server has not applied yet."""

    def __init__(self, port: int, ranks: Sequence[int], period_s: float = 0.5) -> None:
        self.store = client(port)
        self.keys = [f"{PREFIX}/beat/{r}" for r in ranks]
        self.period_s = period_s
        self.samples: list[tuple[float, float, float]] = []  # (when the read ended, oldest age, read s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s * random.uniform(0.5, 1.5)):  # not in step with the beats
            now, start = time.time(), time.monotonic()
            values = self.store.multi_get(self.keys) if self.store.check(self.keys) else []
            end = time.monotonic()
            if values:
                self.samples.append((end, max(now - float(v.decode()) for v in values), end - start))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, w: Window, stale_after_s: float) -> dict[str, Any]:
        inside = [(age, read) for end, age, read in self.samples if w.start <= end < w.end]
        if not inside:
            return {"oldest_beat_s": None, "stale_reads": 0, "read_p50_ms": None, "read_max_ms": None}
        ages, reads = zip(*inside)
        return {"oldest_beat_s": max(ages), "stale_reads": sum(a > stale_after_s for a in ages),
                "read_p50_ms": 1e3 * statistics.median(reads), "read_max_ms": 1e3 * max(reads)}


# ---------------------------------------------------------------------- one N
def victim_ranks(n: int, kills: int) -> list[int]:
    """The members to kill, spread over the ids: the middle of each of ``kills`` equal parts."""
    return [int((i + 0.5) * n / kills) for i in range(kills)]


class Job:
    """The store, the member processes and the victims of one run at N members."""

    def __init__(self, ctx: Any, n: int, args: argparse.Namespace) -> None:
        self.n = n
        self.args = args
        self.procs: list[Any] = []
        parent, child = ctx.Pipe()
        self.server = ctx.Process(target=serve_store, args=(child,), daemon=True)
        self.server.start()
        self.procs.append(self.server)
        self._server_conn = parent
        self.port: int = parent.recv()
        victims = victim_ranks(n, args.kills)
        hosted = [r for r in range(n) if r not in victims]
        self.hosts: list[Connection] = []
        for first in range(0, len(hosted), args.threads):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=host_members, daemon=True,
                            args=(child, self.port, hosted[first:first + args.threads], n, args.interval,
                                  args.stale_after))
            p.start()
            self.procs.append(p)
            self.hosts.append(parent)
        self.victims: dict[str, Any] = {}
        for rank in victims:
            p = ctx.Process(target=victim, daemon=True,
                            args=(self.port, rank, n, args.interval, args.stale_after))
            p.start()
            self.procs.append(p)
            self.victims[str(rank)] = p
        for conn in self.hosts:
            self.expect(conn, "ready", 120)

    @property
    def server_pid(self) -> int:
        return cast(int, self.server.pid)

    def expect(self, conn: Connection, what: str, timeout_s: float) -> Any:
        if not conn.poll(timeout_s):
            raise RuntimeError(f"N={self.n}: a member process sent no '{what}' within {timeout_s:.0f} s; "
                               "the machine may be too loaded: retry with fewer --members or more --threads")
        word, value = conn.recv()
        if word != what:
            raise RuntimeError(f"N={self.n}: expected '{what}' from a member process, got '{word}'")
        return value

    def broadcast(self, command: str, arg: Any, reply: str, timeout_s: float) -> list[Any]:
        for conn in self.hosts:
            conn.send((command, arg))
        return [self.expect(conn, reply, timeout_s) for conn in self.hosts]

    def detect(self, killed_at: dict[str, float]) -> list[dict[str, Any]]:
        """``--kills`` rounds: a step that cannot commit, and a victim killed in it."""
        rounds = []
        for k, (vid, proc) in enumerate(self.victims.items()):
            alive = [str(r) for r in range(self.n) if str(r) not in killed_at]
            self.broadcast("step", (k + 1, alive, k + 1), "started", 60)
            time.sleep(self.args.pre_kill)
            t_kill = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            killed_at[vid] = t_kill
            timeout = self.args.stale_after + 120
            results = [r for conn in self.hosts for r in self.expect(conn, "step", timeout)]
            proc.join()
            seen = sorted(t - t_kill for _, t, _ in results)
            rounds.append({"victim": vid, "survivors": len(results),
                           "first_s": seen[0], "median_s": statistics.median(seen), "last_s": seen[-1],
                           "before_kill": sum(s < 0 for s in seen),
                           "decisions": sorted({d for _, _, d in results}),
                           "seen_s": [round(s, 3) for s in seen]})
        return rounds

    def close(self) -> list[dict[str, Any]]:
        data = self.broadcast("stop", None, "data", 60)
        self._server_conn.send("stop")
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        return cast(list[dict[str, Any]], data)


def run_size(ctx: Any, n: int, args: argparse.Namespace, saturate: bool) -> dict[str, Any]:
    config = ElasticConfig(beat_s=args.interval, stale_after_s=args.stale_after)
    print(f"N={n}: starting the store and {n} members ...", file=sys.stderr, flush=True)
    job = Job(ctx, n, args)
    probe = Probe(job.port, [r for r in range(n) if r not in victim_ranks(n, args.kills)])
    windows: list[Window] = []
    killed_at: dict[str, float] = {}
    try:
        time.sleep(1.0 + 2 * args.interval)  # every member has beaten since its start
        w = Window.open("beat", job.server_pid, interval_s=args.interval)
        time.sleep(args.seconds)
        w.close(job.server_pid)
        windows.append(w)
        costs = sweep_costs(job.port, n, config)
        print(f"N={n}: detection, {args.kills} kills ...", file=sys.stderr, flush=True)
        w = Window.open("detect", job.server_pid, interval_s=args.interval)
        rounds = job.detect(killed_at)
        w.close(job.server_pid)
        windows.append(w)
        if saturate:
            for interval in args.saturate_intervals:
                job.broadcast("interval", interval, "interval", 60)
                time.sleep(0.5 + 2 * args.interval)
                w = Window.open("saturate", job.server_pid, interval_s=interval)
                time.sleep(args.saturate_seconds)
                w.close(job.server_pid)
                windows.append(w)
    finally:
        probe.stop()
        data = job.close()
    threads = Threads.from_exports(data)
    measured = n - args.kills  # the victims' own operations are not recorded
    phases = [{"members": n, **threads.summary(w, measured, args.stale_after), **probe.summary(w, args.stale_after)}
              for w in windows]
    named = [(t, by, who) for d in data for t, by, who in d["named_dead"]]
    false_deaths = [{"by": by, "named": who} for t, by, who in named
                    if who not in killed_at or t < killed_at[who]]
    return {"members": n, "phases": phases, "sweep_costs": costs, "kills": rounds,
            "false_deaths": len(false_deaths), "false_death_examples": false_deaths[:5],
            "beat_threads_ended_early": sum(d["members"] - d["beat_threads_alive"] for d in data)}


# ---------------------------------------------------------------------- report
def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})"


def print_tables(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\nbeat_s={args.interval}, stale_after_s={args.stale_after}; server and members share this machine's "
          f"{os.cpu_count()} cores, so latencies are upper bounds\n")
    print("| members | phase | beat s | beats/s (offered) | store ops/s | ops/s per member | op p50 ms | op p99 ms "
          "| oldest beat in the store s | stale reads | probe read ms p50/max | dead() sweep p50 s | server CPU % "
          "| server us/op | machine busy % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for p in r["phases"]:
            offered = p["measured_members"] / p["interval_s"]
            print(f"| {p['members']} | {p['phase']} | {p['interval_s']:g} | {p['beats_per_s']:.0f} ({offered:.0f}) "
                  f"| {p['ops_per_s']:.0f} "
                  f"| {p['ops_per_member_s']:.1f} | {fmt(p['op_p50_ms'], 2)} | {fmt(p['op_p99_ms'], 2)} "
                  f"| {fmt(p['oldest_beat_s'], 2)} | {p['stale_reads']} "
                  f"| {fmt(p['read_p50_ms'], 2)}/{fmt(p['read_max_ms'], 1)} | {fmt(p['sweep_p50_s'], 3)} "
                  f"| {p['server_cpu_pct']:.0f} | {fmt(p['server_us_per_op'])} | {p['machine_busy_pct']:.0f} |")
    print("\n| members | kills | first survivor sees it s | every survivor knows s | live members named dead "
          "| dead() over all, ms (2N ops) | check+multi_get, ms (2 ops) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        kills = r["kills"]
        first = spread([k["first_s"] for k in kills]) if kills else "-"
        last = spread([k["last_s"] for k in kills]) if kills else "-"
        c = r["sweep_costs"]
        print(f"| {r['members']} | {len(kills)} | {first} | {last} | {r['false_deaths']} "
              f"| {c['dead_sweep_ms']:.1f} | {c['multi_get_sweep_ms']:.1f} |")
    for r in results:
        if r["beat_threads_ended_early"]:
            print(f"\nN={r['members']}: {r['beat_threads_ended_early']} members' beat threads ended before "
                  "the run did (Membership._run returns on any store error)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--members", default="16,64,256", help="comma-separated member counts N")
    p.add_argument("--seconds", type=float, default=10.0, help="length of the beat-only window")
    p.add_argument("--interval", type=float, default=ElasticConfig().beat_s, help="beat_s")
    p.add_argument("--stale-after", type=float, default=ElasticConfig().stale_after_s, help="stale_after_s")
    p.add_argument("--kills", type=int, default=3, help="members SIGKILLed, one per detection round")
    p.add_argument("--pre-kill", type=float, default=1.0, help="seconds of watching before each kill")
    p.add_argument("--threads", type=int, default=32, help="members (threads) per member process")
    p.add_argument("--saturate-intervals", default="0.05,0.01,0.002",
                   help="beat_s values tried at the largest N ('' for none)")
    p.add_argument("--saturate-seconds", type=float, default=5.0, help="length of each saturation window")
    p.add_argument("--c10d-warnings", action="store_true",
                   help="leave torch's C++ warnings on in the members (Note [a timed-out wait's warnings])")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.members.split(",") if s]
    args.saturate_intervals = [float(s) for s in args.saturate_intervals.split(",") if s]
    if any(n <= args.kills for n in sizes):
        p.error(f"--members: every N must exceed --kills={args.kills} (the victims are members too)")
    for s in args.saturate_intervals:
        ElasticConfig(beat_s=s, stale_after_s=args.stale_after)  # raises, naming the field, if too short

    if not args.c10d_warnings:  # for the forkserver and every member it forks
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # Note [a timed-out wait's warnings]
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch.distributed", "tandem.control.membership"])
    started = time.time()
    load = os.getloadavg()
    results = [run_size(ctx, n, args, saturate=(n == max(sizes))) for n in sizes]
    print_tables(results, args)
    print(f"\n{time.time() - started:.0f} s; load average before the run {load[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "cores": os.cpu_count(),
                       "torch": torch.__version__, "load_before": load, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
