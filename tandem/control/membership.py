"""Who is in an elastic job, agreed through the job's store: :class:`Membership`.

# Note [elastic membership]
An elastic job outlives its ranks: when one dies the others agree on who is
left, build a new process group and go on; a replacement joins at a step
boundary. The agreement goes through the job's c10d store, never through a
collective (a collective with a dead peer cannot complete). The store is the
launcher's (``tandem run``, torchrun) or the harness's file, so it outlives any
worker, rank 0 included.

Members have ids that survive a change of rank: the founding ranks are ``"0"``,
``"1"``, ...; a replacement draws ``"j1"``, ``"j2"``, ... from a counter. Each
membership is a *generation* ``g`` with its members in rank order; generation 0
is the founding world. Keys, under ``tandem/elastic/``:

========================  ==========================================================
``beat/<id>``             the member's heartbeat: the wall-clock time of its last
                          beat, written every ``beat_s`` by a daemon thread; a
                          member whose launcher beats for its node has none
``node_of/<id>``          ``<node> <pid>``: the member's launcher beats for it under
                          ``tandem/node/<node>`` (Note [deaths seen at once] in
                          tandem/comm/process_id.py), naming its pid there when it ends
``gen/<g>/members``       the generation's members (JSON), written once, by
                          ``compare_set``: the first proposal wins, every rank reads it
``latest``                the newest generation number
``gen/<g>/cand/<id>``     a member of ``g - 1`` that is alive and wants in ``g``, with the
                          deaths it saw (JSON; Note [a departure names the dead] in
                          tandem/comm/peers.py)
``gen/<g>/step/<s>``      ``.../done`` counts the members that finished step ``s``'s
                          reduction; ``.../decision`` is ``commit``, ``prepare``, ``grow``
                          or ``abort``;
                          both deleted once every member counted itself done with ``s + 1``
``joiners``               how many replacements ever asked to join (ids ``j1..jN``)
``join/<id>``             a replacement's request
``admitted/<id>``         set when a generation admits the replacement, which waits on it
``gen/<g>/arrived/...``   ``.../<what>/<id>``: the member is about to build a group
                          over ``g``'s members (Note [arrivals] in elastic_group.py)
``process/<id>``          the member's :class:`~tandem.comm.process_id.ProcessId`
``host/<id>``             the member's host, as an int64 key (:func:`host_key`); a world
                          change reads only those of members new to this process
``digest/<id>``           what the member's model check compares (DDP's digest), posted
                          as it starts training: a grow checks a replacement's model
                          with it (Note [a grow checked in the store] in trainer.py)
``gen/<g>/verdict``       who is dead, as the generation's judge saw it at a time
                          (Note [judge once] in judge.py)
========================  ==========================================================

Why a step needs a decision: a dead peer can fail a ring all-reduce on one rank
after another rank already has its result. If the one stepped its optimizer and
the other did not, the replicas would differ from then on. So a rank steps only
once every member has finished the step's reduction: each adds to ``done``, the
one that brings it to the world size writes ``commit`` (or, when a
replacement waits, ``prepare`` and a step later ``grow``: Note [a group built
ahead] in elastic_group.py); a rank that sees a member dead (or fails a
collective) writes ``abort``. ``compare_set`` keeps the first, so every member reads the
same decision: all step, or none does (a member that died after counting itself
has delivered its gradients; the survivors step and notice the loss in the next
step's collectives).

A member is dead when its process has ended, as its kernel or its launcher
tells (Note [deaths seen at once] in tandem/comm/process_id.py), or when its beat is older
than ``stale_after_s``: the window for the deaths nobody saw (a host lost with
its launcher, a cut link), long enough that a rank paused for seconds is not
counted dead. Beats carry wall-clock times so that any rank can judge any beat
at once, without watching it for a while first; the hosts of a job must
therefore keep their clocks within a fraction of ``stale_after_s`` of each
other (NTP does).

Who beats: under ``tandem run --elastic`` the launcher beats for its node's
members and names one that ended in its beat at once (Note [deaths seen at
once] in tandem/comm/process_id.py); a member started otherwise beats for itself.

Who judges: one member judges for all, and writes ``abort`` into the decision
the others wait on when it finds a death (Note [judge once] in judge.py); a
regroup and an arrival judge the few members they wait for themselves.

A world change's barriers are roll calls (Note [a roll call] in
roll_call.py). Who may ask to join, and how a stranger's ask is
refused: Note [a stranger asks to join] in join_requests.py.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from tandem._compat import own_tcp_client
from tandem.store.job_secret import ForgedValueError, SignedStore
from tandem.control.generation import PREFIX, Decision, ElasticConfig, Generation, MembershipError, \
    NothingToJoin
from tandem.control.join_requests import JoinRequests
from tandem.control.judge import Judge, judging_ranks
from tandem.control.news import News
from tandem.control.roll_call import RollCall, waited
from tandem.comm.peers import LEFT_TO_REGROUP, Departures, Liveness, PeerLostError
from tandem.comm.process_id import NodeBeat, PostedProcesses, ProcessId, launcher_node, node_beat_key
from tandem.comm.thread_exit import join_before_exit

__all__ = ["NEVER_BEATEN", "Membership", "arrival_roll", "has_own_connection", "host_key", "own_connection"]

logger = logging.getLogger(__name__)

_DECISION_SLICE_S = 5.0  # the longest wait on a key the judge writes before a look of its own (Note [judge once])
_SEATS_WAITED_WINDOWS = 3  # liveness windows without a verdict after which a member judges, judges alive or not

NEVER_BEATEN = "has never beaten"
"""What :meth:`Membership.dead` says of a member with no beat yet: dead to a
regroup, which waits for members that beat before, but not to an arrival
(Note [arrivals] in elastic_group.py), where a member may not have started beating yet."""


def own_connection(store: dist.Store) -> dist.Store | None:
    """A client of the job's ``store`` whose waits hold no other thread's calls:
    a connection of its own to a TCP store (whose client holds its one socket
    through a wait), None where torch cannot open one; any other store itself
    (a file store's wait polls, taking its lock for each look; etcd's calls go
    through connections of each thread's own). Signed as ``store`` is."""
    raw, base = _unwrapped(store)
    if isinstance(base, dist.TCPStore):
        own = own_tcp_client(raw)
        if own is None:
            return None
        raw = own[0]
    return store.over(raw) if isinstance(store, SignedStore) else raw


class Membership:
    """This process's place in an elastic job (see Note [elastic membership]).

    Build it with :meth:`founding` (a rank of the job's first world) or
    :meth:`joining` (a replacement); both start the heartbeat.

    Args:
        store: the job's store, one that outlives every worker.
        member: this process's id.
        generation: the generation it is a member of.
        config: timings and limits.
        clock: wall-clock time in seconds (a test passes its own).
        node: the node whose launcher beats for this member (``TANDEM_NODE``,
            set by ``tandem run --elastic``); None: it beats for itself.
    """

    def __init__(self, store: dist.Store, member: str, generation: Generation, config: ElasticConfig,
                 *, clock: Callable[[], float] = time.time, node: str | None = None) -> None:
        self.store = store
        self.member = member
        self.node = node
        self.generation = generation
        self.config = config
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._processes = PostedProcesses(store, lambda member: f"{PREFIX}/process/{member}")
        self._good_beats: dict[str, float] = {}  # each member's last beat read well
        self._good_nodes: dict[str, NodeBeat] = {}  # each node's last beat read well
        self._nodes: dict[str, tuple[str, int] | None] = {}  # member -> (its node, its pid), None: beats itself
        self._hosts: dict[str, int] = {}  # member -> its host_key, as read or gathered
        self._step: int | None = None  # the step this member works on, once it knows (Note [judge once])
        self._requests = JoinRequests(store, member)  # Note [a stranger asks to join] in join_requests.py
        # The beats go through a connection of their own where the store is a TCP one:
        # a call of another thread that waits on the shared client (a decision's
        # wait slice, which on a timeout logs with a reverse DNS lookup held under
        # the client's lock) must not delay them (Note [cut off] in tandem/comm/cut_off.py).
        # Under a job secret the keys are signed (Note [signed store] in tandem/store/job_secret.py).
        own = own_connection(store)
        self._beat_store = own if own is not None else store
        self._judge: Judge | None = None  # this member's seat in judging its generation (Note [judge once])
        self._news: News | None = None  # Note [news of a generation] in news.py
        self._verdict_read_at = -float("inf")  # when a quiet watch last read the verdict fresh (monotonic)
        # Whether the members build the next generation's group while they train
        # (Note [a group built ahead] in elastic_group.py); every member's is the same.
        self.builds_ahead = False

    # ------------------------------------------------------------------ construction
    @classmethod
    def founding(cls, store: dist.Store, rank: int, world_size: int, config: ElasticConfig,
                 **kwargs: Any) -> Membership:
        """Rank ``rank`` of the job's first world: generation 0 is ``"0".."W-1"``."""
        generation = Generation(0, tuple(str(r) for r in range(world_size)))
        self = cls(store, str(rank), generation, config, **{"node": launcher_node(), **kwargs})
        self.start()
        self._propose(generation)
        return self

    @classmethod
    def replacement(cls, store: dist.Store, config: ElasticConfig, **kwargs: Any) -> Membership:
        """A replacement that has not asked to join yet: its id (``j<n>``) drawn,
        its heartbeat started. It asks with :meth:`ask_to_join` once it has built
        what it trains (Note [a replacement builds first] in elastic_group.py).

        Raises:
            NothingToJoin: every member of the job's latest generation is gone.
        """
        number = store.add(f"{PREFIX}/joiners", 1)
        self = cls(store, f"j{number}", Generation(-1, ()), config, **{"node": launcher_node(), **kwargs})
        self._requests.ask_plainly()
        self.start()
        self._check_something_to_join()
        return self

    @classmethod
    def joining(cls, store: dist.Store, config: ElasticConfig, *,
                timeout: datetime.timedelta | None = None, **kwargs: Any) -> Membership:
        """A replacement that asks to join at once and waits until a generation
        admits it: :meth:`replacement`, then :meth:`ask_to_join`."""
        self = cls.replacement(store, config, **kwargs)
        self.ask_to_join(timeout)
        return self

    def ask_to_join(self, timeout: datetime.timedelta | None = None) -> Generation:
        """Ask to join and wait until a generation admits this replacement (the
        members admit it at their next step boundary); it becomes this member's.

        Raises:
            NothingToJoin: every member of the job's latest generation is gone.
            MembershipError: no generation admitted it within ``timeout``
                (default: ``config.regroup_timeout_s``).
        """
        member, store, config = self.member, self.store, self.config
        store.set(f"{PREFIX}/join/{member}", "waiting")
        limit = timeout.total_seconds() if timeout is not None else config.regroup_timeout_s
        deadline = time.monotonic() + limit
        logger.info("elastic: %s asks to join", member)
        admitted = f"{PREFIX}/admitted/{member}"
        while time.monotonic() < deadline:
            generation = self._check_something_to_join()
            if generation is not None and member in generation.members:
                self.generation = generation
                return generation
            # The members wait for it to connect once they admit it: it looks often
            # (a check, not a wait that times out: c10d logs every timed-out wait).
            looked = time.monotonic()
            while not store.check([admitted]) and time.monotonic() - looked < config.beat_s:
                time.sleep(0.01)
            why = self._requests.refusal()
            if why is not None:
                self.stop()
                raise MembershipError(f"elastic: replacement {member} was refused: {why}")
        self.stop()
        raise MembershipError(
            f"elastic: replacement {member} was not admitted within {limit:.0f} s; the job's members "
            "admit replacements at a step boundary, so check that they are still training")

    def _check_something_to_join(self) -> Generation | None:
        """The latest generation; raises NothingToJoin when all its members are gone."""
        generation = self.latest()
        if generation is not None and self.member not in generation.members and \
                len(self.dead(generation.members)) == generation.world_size:
            self.stop()
            raise NothingToJoin(
                f"elastic: replacement {self.member} found no live member of generation "
                f"{generation.number} ({list(generation.members)}): the job has ended (or died) "
                "before admitting it; nothing to join")
        return generation

    # ------------------------------------------------------------------ heartbeat
    def start(self) -> None:
        """Post this member's process and start its heartbeat: its own, unless its
        node's launcher beats for it (its beat is in the store already)."""
        self._post_process()
        if self.node is not None and self._beat_store.check([node_beat_key(self.node)]):
            self.store.set(f"{PREFIX}/node_of/{self.member}", f"{self.node} {os.getpid()}")
            return
        self.node = None
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"tandem-elastic-beat-{self.member}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            join_before_exit(self._thread, 5.0)  # Note [a store call in flight at exit]
        self._stop_judging()
        self._stop_news("stopped")

    def _run(self) -> None:
        while not self._stop.wait(self.config.beat_s):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return

    def _beat(self) -> None:
        self._beat_store.set(f"{PREFIX}/beat/{self.member}", repr(self._clock()))

    def _post_process(self) -> None:
        process = ProcessId.this_process()
        if process is not None:
            self.store.set(f"{PREFIX}/process/{self.member}", process.encode())
        self.store.set(f"{PREFIX}/host/{self.member}", str(host_key(socket.gethostname())))

    def know_hosts(self, hosts: Mapping[str, int]) -> None:
        """Keep the hosts of members learnt otherwise (the founding world's gather)."""
        self._hosts.update(hosts)

    def hosts_of(self, members: Sequence[str]) -> list[int]:
        """Each member's :func:`host_key`, in order: read from the store (one read of
        all) for members this process has not met, else kept. Every member posts
        its own as it starts, before it can be in a generation. A member whose key
        is missing or junk counts as alone on a host of its own (a key made of its
        id), with a warning: the local ranks it changes decide no collective."""
        new = [m for m in members if m not in self._hosts]
        if new:
            keys = [f"{PREFIX}/host/{m}" for m in new]
            values: list[bytes | None]
            try:
                values = list(self.store.multi_get(keys)) if self.store.check(keys) else \
                    [self.store.get(k) if self.store.check([k]) else None for k in keys]
            except ForgedValueError:
                values = [None] * len(keys)
            for m, value in zip(new, values):
                key = _host_of(value)
                if key is None:
                    logger.warning("tandem: elastic member %s: the host of member %s is not in the store "
                                   "(or is not a number): counted as alone on its host", self.member, m)
                    key = host_key(f"member {m}")
                self._hosts[m] = key
        return [self._hosts[m] for m in members]

    def post_model_digest(self, digest: Sequence[int]) -> None:
        """Post what this member's model check compares (``DistributedDataParallel.model_digest``),
        for a grow that checks a replacement's model without a collective (Note [a grow
        checked in the store] in tandem/train/trainer.py)."""
        self.store.set(f"{PREFIX}/digest/{self.member}", json.dumps([int(d) for d in digest]))

    def model_digests(self, members: Sequence[str]) -> list[list[int]] | None:
        """The digests ``members`` posted (:meth:`post_model_digest`), in order, read at
        once; None when one is missing or junk (the caller checks another way: every
        member reads the same keys, and so decides the same)."""
        keys = [f"{PREFIX}/digest/{m}" for m in members]
        try:
            if not self.store.check(keys):
                return None
            values = [json.loads(bytes(v).decode()) for v in self.store.multi_get(keys)]
        except (ForgedValueError, ValueError, UnicodeDecodeError):
            return None
        if not all(isinstance(v, list) and all(type(d) is int for d in v) for v in values):
            return None
        return values

    def dead(self, members: Sequence[str]) -> dict[str, str]:
        """The members among ``members`` whose process has ended, or whose beat
        is stale (or missing), with why."""
        now = self._clock()
        out: dict[str, str] = {}
        for m in members:
            if m == self.member:
                continue
            ended = self._ended_on_node(m) or self._processes.ended(m)
            if ended is not None:
                out[m] = f"has died: {ended}"
                continue
            beat = self._beat_of(m)
            if beat is None:
                out[m] = NEVER_BEATEN
                continue
            age = now - beat
            if age > self.config.stale_after_s:
                out[m] = _stopped(age, self._nodes_of([m])[m])
        return out

    def judged(self, members: Sequence[str]) -> dict[str, str]:
        """:meth:`dead` over ``members`` in a few store operations, however many
        they are (Note [judge once] in judge.py): every beat (a node's, for the
        members its launcher beats for) in one read; the process of a member
        that beats for itself asked whether it has ended when its beat is two
        beats old."""
        others = [m for m in members if m != self.member]
        nodes = self._nodes_of(others)
        keys = list(dict.fromkeys(_beat_key(m, nodes[m]) for m in others))
        store = self._beat_store  # its own connection, beside the waits (Note [cut off] in tandem/comm/cut_off.py)
        if not others or not store.check(keys):
            return self.dead(others)  # one has never beaten (rare: a generation's first beats)
        try:
            values = dict(zip(keys, store.multi_get(keys)))
        except ForgedValueError:
            return self.dead(others)  # junk under one: read each (Note [a stranger asks to join] in join_requests.py)
        now = self._clock()
        out: dict[str, str] = {}
        for m in others:
            where = nodes[m]
            if where is not None:
                beat = self._good_node(where[0], values[_beat_key(m, where)])
                if where[1] in beat.ended:
                    out[m] = f"has died: {beat.ended[where[1]]}"
                elif now - beat.at > self.config.stale_after_s:
                    out[m] = _stopped(now - beat.at, where)
                continue
            age = now - self._good_beat(m, values[_beat_key(m, None)])
            if age > self.config.stale_after_s:
                out[m] = _stopped(age, None)
            elif age > 2 * self.config.beat_s:
                ended = self._processes.ended(m)
                if ended is not None:
                    out[m] = f"has died: {ended}"
        return out

    def _judge_of(self, generation: Generation) -> Judge:
        """This member's seat in judging ``generation`` (Note [judge once] in judge.py)."""
        key = _verdict_key(generation)
        if self._judge is None or self._judge.key != key:
            self._stop_judging()
            seats = [generation.members[r] for r in judging_ranks(generation.world_size)]
            before = tuple(seats[:seats.index(self.member)]) if self.member in seats else None
            self._judge = Judge(self._beat_store, key, self.member, before, news=_news_key(generation),
                                beat_s=self.config.beat_s,
                                stale_after_s=self.config.stale_after_s, clock=self._clock,
                                sweep=lambda members: self.judged(generation.members if members is None else members),
                                abort=lambda: self._abort_working_step(generation))
        return self._judge

    def _stop_judging(self) -> None:
        if self._judge is not None:
            self._judge.stop()
            self._judge = None

    def _abort_working_step(self, generation: Generation) -> None:
        """The judge's side: propose ``abort`` for the step this member works on in
        ``generation``, when it knows it (Note [judge once] in judge.py)."""
        if self._step is not None and self.generation is generation:
            key = f"{PREFIX}/gen/{generation.number}/step/{self._step}/decision"
            self._beat_store.compare_set(key, "", Decision.ABORT.value)

    def _nodes_of(self, members: Sequence[str]) -> dict[str, tuple[str, int] | None]:
        """Each member's node and pid where its launcher beats for it, else None;
        read once a member has posted either (one read for all that are new, where
        all posted). A member that has posted neither is starting: read again
        next time, or one that starts after the judge's first read would be
        judged by a beat of its own that it never writes."""
        new = [m for m in members if m not in self._nodes]
        if new:
            keys = [f"{PREFIX}/node_of/{m}" for m in new]
            store = self._beat_store
            values: list[bytes | None]
            try:
                values = list(store.multi_get(keys)) if store.check(keys) else \
                    [store.get(k) if store.check([k]) else None for k in keys]
            except ForgedValueError:
                values = [None] * len(keys)  # junk under one: its member beats for itself, as read
            for m, value in zip(new, values):
                where = _node_and_pid(value)
                if where is not None or store.check([f"{PREFIX}/beat/{m}"]):
                    self._nodes[m] = where  # its node's launcher beats for it, or it beats itself
        return {m: self._nodes.get(m) for m in members}

    def _good_node(self, node: str, value: bytes) -> NodeBeat:
        """The node beat ``value`` read under ``node``'s key, or, when it is junk,
        the node's last good one (never read well: now, from the first junk on)."""
        beat = NodeBeat.decode(value)
        if beat is None:
            return self._good_nodes.setdefault(node, NodeBeat(self._clock(), {}))
        self._good_nodes[node] = beat
        return beat

    def _ended_on_node(self, member: str) -> str | None:
        """How ``member`` ended, where its node's launcher beats for it and named it ended."""
        where = self._nodes_of([member])[member]
        if where is None:
            return None
        beat = self._node_beat(where[0])
        return beat.ended.get(where[1]) if beat is not None else None

    def _node_beat(self, node: str) -> NodeBeat | None:
        value = self._value_of(node_beat_key(node))
        return self._good_nodes.get(node) if value is None else self._good_node(node, value)

    def _value_of(self, key: str) -> bytes | None:
        """``key``'s value; None when it has none, and nothing (junk) when it is not
        signed with the job's secret (Note [a stranger asks to join] in join_requests.py)."""
        if not self.store.check([key]):
            return None
        try:
            return self.store.get(key)
        except ForgedValueError:
            return b""

    def _beat_of(self, member: str) -> float | None:
        """``member``'s last beat (None: it never beat). A beat that is no number or
        not signed with the job's secret (a stranger overwrote it) is skipped: the
        last good one stands, so that junk neither kills this member nor keeps a
        dead one alive (Note [a stranger asks to join] in join_requests.py)."""
        where = self._nodes_of([member])[member]
        if where is not None:
            beat = self._node_beat(where[0])
            return beat.at if beat is not None else None
        value = self._value_of(f"{PREFIX}/beat/{member}")
        return self._good_beats.get(member) if value is None else self._good_beat(member, value)

    def _good_beat(self, member: str, value: bytes) -> float:
        """The beat ``value`` read under ``member``'s key, or, when it is junk, the
        member's last good one (never read well: from the first junk on)."""
        try:
            beat = self._good_beats[member] = float(bytes(value).decode())
        except (ValueError, UnicodeDecodeError):
            return self._good_beats.setdefault(member, self._clock())
        return beat

    # ------------------------------------------------------------------ generations
    def latest(self) -> Generation | None:
        key = f"{PREFIX}/latest"
        if not self.store.check([key]):
            return None
        return self._read(int(self.store.get(key).decode()))

    def generation_numbered(self, number: int) -> Generation:
        """Generation ``number``, proposed already: one agreed, or the next at a
        ``prepare`` decision (Note [a group built ahead] in elastic_group.py)."""
        return self._read(number)

    def _read(self, number: int) -> Generation:
        members = json.loads(self.store.get(f"{PREFIX}/gen/{number}/members").decode())
        return Generation(number, tuple(members))

    def _propose(self, generation: Generation) -> Generation:
        """Write ``generation`` unless one with its number exists; returns the one that won."""
        won = self.store.compare_set(f"{PREFIX}/gen/{generation.number}/members", "",
                                     json.dumps(list(generation.members)))
        winner = Generation(generation.number, tuple(json.loads(won.decode())))
        self.store.set(f"{PREFIX}/latest", str(generation.number))
        for member in winner.members:
            if member.startswith("j"):  # wake the replacements it admits
                self.store.set(f"{PREFIX}/admitted/{member}", str(generation.number))
        return winner

    def roll_period(self, generation: Generation, since: float) -> float | None:
        """How often this member reads a roll call of ``generation`` (Note [a roll call]):
        often when it judges; once a slice when the judges have not answered for
        longer than their window and are dead, or for three windows whatever they are
        (every member may then read it: not often); None: it waits."""
        seats = judging_ranks(generation.world_size)
        if generation.rank_of(self.member) in seats:
            return min(self.config.beat_s, 0.05)
        window = self.config.stale_after_s + len(seats) * self.config.beat_s
        return self.slice_s() if self._judges_gone(generation, time.monotonic() - since, window) else None

    def slice_s(self) -> float:
        """How long a member waits on a key the judge writes before it looks for itself."""
        return max(self.config.beat_s, min(_DECISION_SLICE_S, self.config.stale_after_s / 2))

    def lost_among(self, generation: Generation, members: Sequence[str], during: str) -> PeerLostError | None:
        """A PeerLostError naming those of ``members`` that are dead (their ranks in
        ``generation``), as if ``during`` had failed on them; None when none is
        (one that has not beaten yet is not: it may be starting)."""
        dead = {m: why for m, why in self.judged(members).items() if why != NEVER_BEATEN}
        if not dead:
            return None
        return PeerLostError(generation.rank_of(self.member), {generation.rank_of(m): why for m, why in dead.items()},
                             during)

    def waiting_joiners(self) -> list[str]:
        """Replacements that asked to join, are alive, and no generation admitted yet."""
        count = self._requests.count()
        if count == 0:  # the common case, checked at every step: one store read
            return []
        asked = [f"j{n}" for n in range(1, count + 1) if self.store.check([f"{PREFIX}/join/j{n}"])]
        admitted = self._admitted()
        candidates = [j for j in asked if j not in admitted]
        stale = self.dead(candidates)
        return [j for j in candidates if j not in stale]

    def _admitted(self) -> set[str]:
        out: set[str] = set()
        for number in range(self.generation.number + 1):
            key = f"{PREFIX}/gen/{number}/members"
            if self.store.check([key]):
                out.update(json.loads(self.store.get(key).decode()))
        return out

    # ------------------------------------------------------------------ a step
    def decide_step(self, step: int) -> Decision:
        """Count this member done with ``step``'s reduction and wait for the
        decision every member reads (Note [elastic membership])."""
        self._step = step
        self._judge_of(self.generation)
        base = f"{PREFIX}/gen/{self.generation.number}/step/{step}"
        done = self.store.add(f"{base}/done", 1)
        if done == self.generation.world_size:
            wanted = self._growth()
            self.store.compare_set(f"{base}/decision", "", wanted.value)
            # Every member has counted itself done with this step, so each has read the step before's
            # decision and none reads its keys again: they go (on etcd, a count is a key per member).
            before = f"{PREFIX}/gen/{self.generation.number}/step/{step - 1}"
            self.store.delete_key(f"{before}/done")
            self.store.delete_key(f"{before}/decision")
        decision = self._await_decision(base)
        if decision is not Decision.ABORT:
            self._step = step + 1
        return decision

    def _growth(self) -> Decision:
        """A step's decision when every member is done with it and none is lost
        (Note [a group built ahead] in elastic_group.py): ``grow`` when the next
        generation was proposed at the step before (its group is being built),
        or when replacements wait and the members cannot build ahead; ``prepare``,
        with the next generation proposed, when replacements wait; else ``commit``."""
        number = self.generation.number + 1
        if self.store.check([f"{PREFIX}/gen/{number}/members"]):  # prepared at the step before
            return Decision.GROW
        joiners = self.waiting_joiners()
        if not joiners:
            return Decision.COMMIT
        if not self.builds_ahead:
            return Decision.GROW
        self._propose(Generation(number, self.generation.members + tuple(joiners)))
        return Decision.PREPARE

    def abort_step(self, step: int) -> Decision:
        """Propose that ``step`` be dropped (this member saw a collective fail);
        returns the decision that stands, which is ``commit`` when every member
        had finished the step already."""
        self._step = step
        base = f"{PREFIX}/gen/{self.generation.number}/step/{step}"
        won = self.store.compare_set(f"{base}/decision", "", Decision.ABORT.value)
        return Decision(won.decode())

    def _await_decision(self, base: str) -> Decision:
        key = f"{base}/decision"
        judge = self._judge_of(self.generation)
        # The judge writes the decision when it finds a death (Note [judge once] in judge.py): the
        # slices only bound how late a member looks at the verdict itself.
        slice_s = self.slice_s()
        while True:
            if waited(self.store, [key], slice_s):
                return Decision(self.store.get(key).decode())
            # Note [judge once] in judge.py: one read a slice, not a sweep of every member
            verdict = judge.read()
            if verdict is not None:
                lost = {m: why for m, why in verdict.dead.items()
                        if m != self.member and self.generation.has(m)}
            elif self._judges_gone(self.generation, judge.seated_s(), self.config.stale_after_s):
                lost = self.judged(self.generation.members)  # judge for itself, in one read
            else:
                continue
            if lost:
                logger.warning("elastic: %s", ", ".join(f"member {m} {why}" for m, why in lost.items()))
                won = self.store.compare_set(key, "", Decision.ABORT.value)
                return Decision(won.decode())

    def _judges_gone(self, generation: Generation, waited_s: float, window: float) -> bool:
        """Whether a member that has waited ``waited_s`` for the judges of ``generation``
        (a verdict, a roll call's outcome) looks for itself: past ``window`` when every
        judging seat is dead, past three windows whatever they are (Note [judge once] in judge.py)."""
        return waited_s > window and (waited_s > _SEATS_WAITED_WINDOWS * window or self._seats_gone(generation))

    def _seats_gone(self, generation: Generation) -> bool:
        """Whether every judging seat but this member's is dead: a verdict that is late while a
        seat lives is a slow judge, and members that all swept every member at once would slow it
        further (a store that answers slowly is what makes a judge late)."""
        seats = [generation.members[r] for r in judging_ranks(generation.world_size)]
        others = [m for m in seats if m != self.member]
        return len(self.judged(others)) == len(others)

    def departed(self, ranks: Sequence[int]) -> Departures:
        """The ranks of this generation, among ``ranks``, whose member has asked
        for the next one (Note [a peer gone to regroup] in tandem/comm/peers.py),
        and those the leavers named dead (Note [a departure names the dead]
        there), with why: one read while none has left (Note [a watch reads the
        verdict] there)."""
        current = self.generation
        if self._quiet(current):  # Note [news of a generation] in news.py: nobody has left
            return Departures()
        if not self.store.check([RollCall(self.store, self._regroup_key(current.number + 1)).count_key]):
            return Departures()
        cand = f"{PREFIX}/gen/{current.number + 1}/cand"
        left = {r: current.members[r] for r in ranks
                if 0 <= r < current.world_size and current.members[r] != self.member
                and self.store.check([f"{cand}/{current.members[r]}"])}
        if not left:
            return Departures()
        try:
            posted = self.store.multi_get([f"{cand}/{m}" for m in left.values()])
        except ForgedValueError:  # a stranger's junk under one: the verdict names the deaths
            posted = []
        named: dict[int, str] = {}
        for leaver, raw in zip(left.values(), posted):
            for m, why in _deaths_posted(raw).items():
                r = current.members.index(m) if m in current.members and m != self.member else -1
                if r in ranks and r not in left:
                    named.setdefault(r, f"{why}{_NAMED_BY}{leaver} as it left)")
        return Departures({r: f"{LEFT_TO_REGROUP} {current.number} to regroup (member {m})" for r, m in left.items()},
                          named)

    def judged_ranks(self, ranks: Sequence[int]) -> dict[int, str] | None:
        """The ranks of this generation, among ``ranks``, that its verdict names
        dead, with why (Note [a watch reads the verdict] in tandem/comm/peers.py);
        None when this member holds no seat in judging the generation yet (before
        its first step's decision, in a world change) or the verdict is not fresh:
        the watch then looks for itself."""
        judge, current = self._judge, self.generation
        if judge is None or judge.key != _verdict_key(current):
            return None
        if self._quiet(current, listen=True):  # Note [news of a generation] in news.py: no death named
            return {}
        verdict = judge.read()
        if verdict is None:
            return None
        out: dict[int, str] = {}
        for r in ranks:
            member = current.members[r] if 0 <= r < current.world_size else None
            why = verdict.dead.get(member) if member is not None and member != self.member else None
            if why is not None and why != NEVER_BEATEN:  # no beat yet is no death in a running collective
                out[r] = why
        return out

    def _quiet(self, generation: Generation, *, listen: bool = False) -> bool:
        """Whether nothing happened to ``generation`` (no news yet) and its verdict
        was fresh at a read less than half a window ago (Note [news of a
        generation] in news.py). ``listen``: start the news thread where there is
        none for it yet and the store gives it a connection of its own."""
        judge, news = self._judge, self._news
        if judge is None or judge.key != _verdict_key(generation):
            return False
        if news is None or news.key != _news_key(generation):
            if listen:
                self._stop_news("a later generation")
                store = self._news_store()
                if store is not None:
                    self._news = News(store, _news_key(generation), self._beat_store)
            return False
        if news.heard:
            return False
        now = time.monotonic()
        if now - self._verdict_read_at >= self.config.stale_after_s / 2:
            if judge.read() is None:
                return False
            self._verdict_read_at = now
        return True

    def liveness(self) -> Liveness:
        """How this member's collectives watch their peers: its config's window,
        in quick slices where a news thread waits for what happens to the
        generation (Note [a quick look] in tandem/comm/peers.py)."""
        _, base = _unwrapped(self.store)
        return self.config.liveness(quick=isinstance(base, dist.TCPStore))

    def _news_store(self) -> dist.Store | None:
        """A connection of its own for a news thread's waits: over a TCP store only (a
        file store's wait polls the file: the watch reads instead)."""
        _, base = _unwrapped(self.store)
        return own_connection(self.store) if isinstance(base, dist.TCPStore) else None

    def _stop_news(self, why: str) -> None:
        if self._news is not None:
            self._news.stop(why)
            self._news = None

    @staticmethod
    def _regroup_key(number: int) -> str:
        """The roll call of the members that regroup into generation ``number``."""
        return f"{PREFIX}/gen/{number}/regroup"

    # ------------------------------------------------------------------ regroup
    def next_generation(self, known_dead: Mapping[str, str] | None = None) -> Generation:
        """Agree with the live members (and the replacements that wait) on the
        next generation; returns it, and makes it this member's.

        Every live member of the current generation calls this. It returns once
        every member has arrived or is dead; the first to see that proposes the
        members, and all read the proposal that won. ``known_dead``: members this
        process already knows are gone, with why (its collective's heartbeat
        watch named them), which it need not see go stale again; it names the
        dead among them to the members still waiting (Note [a departure names
        the dead] in tandem/comm/peers.py).

        Raises:
            MembershipError: this member is not in the generation that won (the
                others judged it dead), it has fewer than ``min_world_size``
                members, or the members were not all accounted for in time.
        """
        current = self.generation
        number = current.number + 1
        base = f"{PREFIX}/gen/{number}"
        known_dead = dict(known_dead or {})
        self._stop_judging()
        # Note [a peer gone to regroup] and Note [a departure names the dead] in tandem/comm/peers.py
        deaths = {m: why.split(_NAMED_BY)[0] for m, why in known_dead.items() if not why.startswith(LEFT_TO_REGROUP)}
        self.store.set(f"{base}/cand/{self.member}", json.dumps({"dead": deaths}))
        roll = RollCall(self.store, self._regroup_key(number))  # Note [a roll call]
        # The last to arrive proposes at once; the judges would a read later (Note [a roll call]).
        last = roll.arrive(self.member) == current.world_size
        # Note [news of a generation] in news.py: the peers' news threads wake, and their watches
        # look: at the roll call and at what this member posted above
        self.store.set(_news_key(current), "regroup")
        self._stop_news("regroup")
        started = time.monotonic()
        while True:
            if self.store.check([f"{base}/members"]):
                chosen = self._read(number)
                break
            period = self.roll_period(current, started)
            if period is None and not last:
                waited(self.store, [f"{base}/members"], self.slice_s())
                continue
            arrived = set(roll.arrived())
            arrived_in_order = [m for m in current.members if m in arrived]
            missing = [m for m in current.members if m not in arrived]
            lost = {**(self.judged(missing) if missing else {}),
                    **{m: why for m, why in known_dead.items() if m in missing}}
            if len(lost) == len(missing):
                joiners = [j for j in self.waiting_joiners() if j not in arrived]
                # One that arrived (or asked to join) and died since is left out now, not
                # found dead again by the generation's arrival barrier.
                gone = {m for m, why in self.judged(arrived_in_order + joiners).items() if why != NEVER_BEATEN}
                chosen = self._propose(Generation(number, tuple(m for m in arrived_in_order + joiners
                                                                if m not in gone)))
                break
            if time.monotonic() - started > self.config.regroup_timeout_s:
                raise MembershipError(
                    f"elastic: member {self.member} waited {self.config.regroup_timeout_s:.0f} s for "
                    f"members {sorted(set(missing) - set(lost))} of generation {current.number} to "
                    "arrive or be seen dead; raise ElasticConfig.regroup_timeout_s if they are slow")
            waited(self.store, [f"{base}/members"], period if period is not None else self.config.beat_s)
        if self.member not in chosen.members:
            raise MembershipError(
                f"elastic: member {self.member} is not in generation {number} ({list(chosen.members)}): "
                "the others judged it dead (its heartbeat was late); it leaves the job")
        if chosen.world_size < self.config.min_world_size:
            raise MembershipError(
                f"elastic: generation {number} has {chosen.world_size} members {list(chosen.members)}, "
                f"fewer than min_world_size={self.config.min_world_size}; the job stops. Resume it "
                "from its last checkpoint with more ranks")
        self.generation = chosen
        return chosen


_NAMED_BY = " (named by member "  # how a death another member named reads (Membership.departed)


def _deaths_posted(raw: bytes) -> dict[str, str]:
    """The deaths a member named in ``raw``, its ``cand`` key (Note [a departure
    names the dead] in tandem/comm/peers.py); none in what is not that (junk)."""
    try:
        value = json.loads(raw.decode())
        return {str(m): str(why) for m, why in dict(value["dead"]).items()}
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
        return {}


def _news_key(generation: Generation) -> str:
    """What wakes ``generation``'s news threads (Note [news of a generation] in news.py)."""
    return f"{PREFIX}/gen/{generation.number}/news"


def _verdict_key(generation: Generation) -> str:
    """Where ``generation``'s judge posts its verdict (Note [judge once] in judge.py)."""
    return f"{PREFIX}/gen/{generation.number}/verdict"


def host_key(host: str) -> int:
    """``host`` as an int64 (the first 8 bytes of its SHA-256): equal on the
    members of one host, and gathered in one round where a name takes two."""
    return int.from_bytes(hashlib.sha256(host.encode()).digest()[:8], "little", signed=True)


def _host_of(value: bytes | None) -> int | None:
    """A ``host/<id>`` key's value read back, or None where it is missing or junk."""
    try:
        return int(value.decode()) if value is not None else None
    except ValueError:  # junk, UnicodeDecodeError included
        return None


def arrival_roll(store: dist.Store, number: int, what: str) -> RollCall:
    """The roll call of generation ``number``'s members that arrived to build
    ``what`` ("group"), or whose backend of it is built ("group connected")
    (Note [arrivals] in elastic_group.py)."""
    return RollCall(store, f"{PREFIX}/gen/{number}/arrived/{what}")


def has_own_connection(store: dist.Store) -> bool:
    """Whether :func:`own_connection` of ``store`` is not None (opening none)."""
    raw, base = _unwrapped(store)
    return not isinstance(base, dist.TCPStore) or hasattr(raw, "clone")  # as own_tcp_client asks


def _unwrapped(store: dist.Store) -> tuple[dist.Store, dist.Store]:
    """``store`` without its signature (Note [signed store]), and the store below its prefixes."""
    raw = store.inner if isinstance(store, SignedStore) else store
    base = raw
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    return raw, base


def _node_and_pid(value: bytes | None) -> tuple[str, int] | None:
    """``node_of/<id>``'s ``<node> <pid>``; None when missing or junk (the member beats for itself, as read)."""
    try:
        node, pid = bytes(value).decode().split() if value is not None else ("", "")
        return (node, int(pid)) if node else None
    except (ValueError, UnicodeDecodeError):
        return None


def _beat_key(member: str, node: tuple[str, int] | None) -> str:
    """Where ``member``'s beat is: its node's, or its own."""
    return node_beat_key(node[0]) if node is not None else f"{PREFIX}/beat/{member}"


def _stopped(age: float, node: tuple[str, int] | None) -> str:
    """Why a member whose beat is ``age`` seconds old is dead."""
    return f"stopped beating {age:.1f} s ago" + (" (its node's launcher did)" if node is not None else "")
