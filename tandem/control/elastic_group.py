"""Elastic jobs' default group: the job's store, this process's membership, a
new generation's group once its members have arrived (Note [arrivals]), and a
replacement worker joining (Note [elastic default group]); the rules of
membership itself are in membership.py."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch.distributed as dist

from tandem._compat import (bind_group_defaults_before_init, default_store, forget_default_group, given_gloo_backend,
                            reset_group_names, set_group_timeout)
from tandem.control import group_record
from tandem.comm.connections import Connection, opened_connections, sever
from tandem.comm.device import bind_device, default_backend
from tandem.control.generation import PREFIX, ElasticConfig, Generation, MembershipError, NothingToJoin
from tandem.control.membership import Membership, arrival_roll, has_own_connection, host_key, own_connection
from tandem.control.roll_call import RollCall
from tandem.comm.monitor import current_monitor, stop_monitor
from tandem.comm.peers import PeerLostError, drain_at_exit
from tandem.comm.process_id import below_prefixes
from tandem.store.store_address import EtcdAddress, etcd_client, store_ports
from tandem.comm.timeouts import DEFAULT_TIMEOUT
from tandem.comm.world import WorldInfo
from tandem.comm.plain_data import all_gather_ints
from tandem.comm.thread_exit import join_before_exit
from tandem.store.job_secret import signed

__all__ = ["JOIN_ENV", "NOTHING_TO_JOIN_EXITCODE", "GroupAhead", "ask_to_join", "await_members",
           "below_prefixes", "default_group_connections", "elastic_membership", "enter_generation", "join_elastic",
           "job_store", "new_world_group", "nothing_to_join"]

JOIN_ENV = "TANDEM_ELASTIC_JOIN"
"""Set to ``1`` for a replacement worker: :func:`tandem.init` then joins the running
elastic job at its next step boundary instead of starting a new one."""

NOTHING_TO_JOIN_EXITCODE = 76
"""A replacement's exit status when the job had ended before it could join: no
failure, and nothing for a launcher to replace."""

logger = logging.getLogger(__name__)

_ALL_ARRIVED = "all"  # a roll call's outcome when every member came (Note [a roll call] in roll_call.py)

# Note [elastic default group]
# An elastic job (Note [elastic membership] in membership.py) changes its world
# in place: the members of a new generation destroy the default group and build
# another over the job's store, under a prefix of the generation's own, so no
# key of the old group is read again. The job's store is the one below the
# default group's "default_pg" prefix: the launcher's, which outlives any
# worker. Everything tandem added to the old group (monitor, exit hook, the
# record in group_record.py) moves to the new one, and tandem owns the new group.
# Once every member stands in the new group, each cuts the old group's
# connections, so that nothing stays blocked in it until the job ends (Note
# [severing a forgotten group] in tandem/comm/connections.py).


def job_store() -> dist.Store:
    """The store the job's processes met in, below every prefix (the default
    group's, torch's per-group ones), as a replacement's rendezvous reaches it."""
    return below_prefixes(default_store())


@contextlib.contextmanager
def default_group_connections(backend: str, built: _GlooBuild | None = None) -> Iterator[list[Connection]]:
    """Around the creation of the default group: its gloo connections, in the
    list this yields, once the block ends (Note [severing a forgotten group] in
    tandem/comm/connections.py), with those ``built`` opened before the block
    began (a group built ahead); the job's store's are left out. Empty for another backend."""
    connections: list[Connection] = []
    with opened_connections() as opened:
        yield connections
    if backend == "gloo" and dist.is_initialized():
        earlier = [c for c in built.connections if c not in opened] if built is not None else []
        connections.extend(c for c in opened + earlier if not set(c.ports) & store_ports(job_store()))


def elastic_membership(config: ElasticConfig) -> Membership:
    """This process's :class:`Membership`: the one it joined with, or, for a rank
    of the job's first world, a founding one (a collective in effect: every rank
    calls it). Its config becomes ``config``."""
    if not dist.is_initialized():
        raise RuntimeError("an elastic job needs a process group: call tandem.init() first")
    config = _window_on(config, job_store())
    monitor = current_monitor()
    member = group_record.current()
    if member is not None and member.elastic is not None:
        elastic = member.elastic
        elastic.config = config
    else:
        # Note [signed store] in tandem/store/job_secret.py: under a job secret only members make its keys
        elastic = Membership.founding(signed(job_store()), dist.get_rank(), dist.get_world_size(), config)
        if member is not None:
            group_record.with_elastic(member, elastic)
    monitor.set_liveness(elastic.liveness())  # every rank: Note [dead peers] in tandem/comm/peers.py
    if monitor.peers is not None:
        monitor.peers.departed = elastic.departed  # Note [a peer gone to regroup] in tandem/comm/peers.py
        monitor.peers.judged = elastic.judged_ranks  # Note [a watch reads the verdict] there
    elastic.builds_ahead = _builds_on_a_thread(elastic, str(dist.get_backend()))  # Note [a group built ahead]
    return elastic


# Note [a window longer than a failover]
# On an etcd cluster (Note [the workers' store on etcd] in tandem/store/store_address.py) a
# member's loss costs the store a pause: when the leader goes, the others elect
# another (one to two seconds), and a request held by the lost member waits out
# its attempt (two seconds) before it goes to the next (Note [failing over
# between etcd members] in tandem/store/etcd_gateway.py). No beat lands meanwhile, anyone's,
# so a liveness window shorter than that pause would count every member dead at
# once. The window is at least MIN_STALE_ON_ETCD_S there; a shorter one asked
# for is raised to it, and the log says so once.

MIN_STALE_ON_ETCD_S = 6.0
"""The shortest liveness window of an elastic job on etcd (Note [a window longer than a failover])."""


def _window_on(config: ElasticConfig, store: dist.Store) -> ElasticConfig:
    if etcd_client(store) is None or config.stale_after_s >= MIN_STALE_ON_ETCD_S:
        return config
    if dist.get_rank() == 0:
        logger.warning("tandem: elastic: stale_after_s=%g is shorter than an etcd failover may take; the job's "
                       "store is on etcd, so members count as gone after %g s of silence (Note [a window longer "
                       "than a failover])", config.stale_after_s, MIN_STALE_ON_ETCD_S)
    return dataclasses.replace(config, stale_after_s=MIN_STALE_ON_ETCD_S)


def _hosts_read(membership: Membership, generation: Generation) -> list[int] | None:
    """Each member's :func:`host_key`, in rank order, read from the store where
    they can be: after the first change, only the keys of members new to this
    process (a replacement's, on the members; every key, on the replacement)
    and none after a loss (:meth:`Membership.hosts_of`). None in the first
    change after the founding world: no member knows the others' yet, and
    reading every key on every member would be N² reads, so they are gathered
    (:func:`_hosts_gathered`) once the group is built. Read before the group
    is waited for (by a member building ahead, as it begins), not after."""
    return membership.hosts_of(generation.members) if generation.number > 1 else None


def _hosts_gathered(membership: Membership, generation: Generation) -> list[int]:
    """Each rank's :func:`host_key`, gathered over the new default group (the first change)."""
    hosts = [h for (h,) in all_gather_ints([host_key(socket.gethostname())])]
    membership.know_hosts(dict(zip(generation.members, hosts)))
    return hosts


def enter_generation(membership: Membership, generation: Generation, *,
                     timeout: datetime.timedelta | None = None, backend: str | None = None,
                     ahead: GroupAhead | None = None, joining: bool = False) -> WorldInfo:
    """Replace the default group by one of ``generation``'s members (Note [elastic
    default group]); a collective of the generation's members. Returns this
    process's new :class:`WorldInfo`. ``ahead``: this member's build of a
    generation's group begun while it trained (Note [a group built ahead]),
    taken if it is ``generation``'s, else abandoned. ``joining``: a replacement
    entering the generation that admits it, which goes on once its own backend
    is built (Note [a replacement goes on ahead])."""
    if ahead is not None and ahead.generation != generation:
        ahead = None  # the world changed to another generation: its build is dropped (joined at exit)
    record = group_record.last()
    previous = record.info if record is not None else None
    if backend is None:
        backend = str(dist.get_backend()) if dist.is_initialized() else (
            previous.backend if previous is not None else default_backend())
    timeout_td = timeout or (record.timeout if record is not None else None) or DEFAULT_TIMEOUT
    stop_monitor(left=False)
    if dist.is_initialized():
        forget_default_group()  # not destroyed: its workers may wait on a live peer (see there)
    rank = generation.rank_of(membership.member)
    hosts = _hosts_read(membership, generation)
    if ahead is None:
        await_members(membership, generation)  # Note [arrivals]; built ahead, it arrived as the build began
    bind_group_defaults_before_init()
    reset_group_names()  # a failed attempt may have counted a group on some members only
    store = dist.PrefixStore(f"{PREFIX}/gen/{generation.number}/pg", membership.store)
    try:
        with default_group_connections(backend, ahead.build if ahead is not None else None) as connections:
            # Built under connect_timeout_s (Note [arrivals]); its collectives get timeout_td.
            with _built_while_watched(membership, generation, "group", backend,
                                      ahead.build if ahead is not None else None, joining=joining):
                dist.init_process_group(backend, store=store, rank=rank, world_size=generation.world_size,
                                        timeout=_connect_timeout(membership))
    except PeerLostError:
        raise
    except Exception as e:
        raise _not_built(membership, generation, "group", e) from e
    set_group_timeout(timeout_td, None)
    # The device stays the one the launcher gave this process; the local rank and
    # size are this process's place among the generation's members on its host.
    device = previous.device if previous is not None else bind_device(
        backend, int(os.environ.get("LOCAL_RANK", "0")), rank)
    if hosts is None:
        hosts = _hosts_gathered(membership, generation)
    here = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    local_rank, local_size = here.index(rank), len(here)
    info = WorldInfo(rank=rank, local_rank=local_rank, world_size=generation.world_size,
                     local_world_size=local_size, device=device, backend=backend)
    group_record.start_watch(info, timeout_td, owned=True, timeout=timeout_td, elastic=membership,
                             connections=tuple(connections))
    if record is not None:
        # Every member of the new world is here, so done with the old group:
        # Note [severing a forgotten group] in tandem/comm/connections.py.
        severed = sever(record.connections)
        drain_at_exit()
        logger.debug("tandem: elastic generation %d: cut %d connection(s) of the old group",
                     generation.number, severed)
    logger.info("tandem: elastic generation %d: member %s is rank %d of %d", generation.number,
                membership.member, rank, generation.world_size)
    return info


def await_members(membership: Membership, generation: Generation, what: str = "group",
                  building: _GlooBuild | None = None, *, wait_for_all: bool = True) -> None:
    """Mark ``membership``'s member arrived to build ``generation``'s group (or another group
    over its members, named by ``what``), and wait until every member has
    (Note [arrivals]). With ``building``, the member arrives once its backend
    is built, and the roll call is of the built ones (Note [a death while the
    group is built]); without ``wait_for_all``, it returns once it has
    arrived (Note [a replacement goes on ahead]).

    # Note [arrivals]
    Building a generation's gloo group waits, in torch, until every member has
    connected, for the group's whole timeout: a replacement admitted and then
    killed before it connected, or a member killed between the agreement and
    the group, left the others there for as long. So each member first puts
    itself on a roll call in the store (Note [a roll call] in roll_call.py)
    and waits for its outcome: the last to arrive says all came; the judges
    watch the missing ones for death, and a dead one fails the change with a
    PeerLostError on every member, and the next change leaves it out.
    The same goes for a second group over the members (fully_shard's
    reduce-scatter group, built at the first forward in a new world:
    :func:`new_world_group`).
    A death after a member's mark and before it connects is seen the same
    way, by a second roll call, of the members whose gloo backend is built
    (Note [a death while the group is built]); where the backend cannot be
    built so, when building the group times out: it is built with
    ``connect_timeout_s`` as its timeout and then given the group's own, and
    a member then found dead fails the change the same way
    (:func:`enter_generation`).

    Raises:
        PeerLostError: a member that had not arrived is dead (ranks of ``generation``).
        MembershipError: not every member arrived within ``regroup_timeout_s``.
        Exception: ``building`` failed.
    """
    roll = arrival_roll(membership.store, generation.number, what)
    here = building is None
    if here:
        _arrive(roll, membership.member, generation)
    during = f"the arrival of generation {generation.number}'s members ({what})"
    started = time.monotonic()
    while True:
        period = membership.roll_period(generation, started)
        wait_s = period if period is not None else membership.slice_s()
        if building is not None and not here:  # wait on the build; look at the outcome each beat meanwhile
            if building.done.wait(min(wait_s, membership.config.beat_s)):
                building.result()  # raises its failure
                _arrive(roll, membership.member, generation)
                if not wait_for_all:
                    return
                here = True
                continue
            outcome = roll.outcome_now()
        else:
            outcome = roll.outcome(wait_s)
        if outcome == _ALL_ARRIVED:
            return
        if outcome is not None:
            lost = json.loads(outcome)
            raise PeerLostError(generation.rank_of(membership.member), {int(r): why for r, why in lost.items()},
                                during)
        if period is not None:
            arrived = set(roll.arrived())
            missing = [m for m in generation.members if m not in arrived]
            found = membership.lost_among(generation, missing, during) if missing else None
            if found is not None:
                roll.decide(json.dumps({str(r): why for r, why in found.lost.items()}))
        if time.monotonic() - started > membership.config.regroup_timeout_s:
            arrived = set(roll.arrived())
            raise MembershipError(
                f"elastic: member {membership.member} waited {membership.config.regroup_timeout_s:.0f} s for "
                f"members "
                f"{[m for m in generation.members if m not in arrived]} to build generation "
                f"{generation.number}'s {what}; raise ElasticConfig.regroup_timeout_s if they are slow")


def _arrive(roll: RollCall, member: str, generation: Generation) -> None:
    if roll.arrive(member) == generation.world_size:
        roll.decide(_ALL_ARRIVED)  # the last to arrive (Note [a roll call] in roll_call.py)


# Note [a replacement builds first]
# A replacement does not ask to join in tandem.init(): the members would wait in
# their regroup while it imports, builds its model, its optimizer and its Trainer
# (seconds), and a member lost meanwhile would fail the collectives that its
# DistributedDataParallel or ZeroOptimizer issue as they are built, in the user's
# code, where nothing can take part in the next change. It meets the job's store,
# draws its id and starts its heartbeat, and then stands in a world of its own (a
# default group of one, over an in-memory store): what it builds there is laid
# out for one rank. It asks to join when it is ready to train (the Trainer's
# fit(), an elastic prepare()); the members admit it at their next step
# boundary, and it then rebuilds for the new world exactly as they do in that
# change (ElasticRun.join in tandem/elastic/run.py): the DDP reducer, the ZeRO or
# fully_shard layouts, the loaders, the shards and the state from live peers.
# Until then, tandem.get_rank() is 0 and the world size 1 on a replacement.


def new_world_group(what: str) -> dist.ProcessGroup:
    """A new group over every rank of the default group (``what`` names it). In
    an elastic job the members first wait for each other's arrival, watching for
    deaths (Note [arrivals]): torch waits for a rank that never
    comes for the group's whole timeout."""
    record = group_record.current()
    membership = record.elastic if record is not None else None
    if membership is None or membership.generation.number < 0:
        group = dist.new_group(list(range(dist.get_world_size())), use_local_synchronization=True)
    else:
        await_members(membership, membership.generation, what)
        try:
            # Its sockets are cut with the default group's when a generation leaves it behind:
            # a wait left in it would otherwise end only as the process finalizes (Note
            # [severing a forgotten group] in tandem/comm/connections.py).
            with default_group_connections(str(dist.get_backend())) as connections:
                with _built_while_watched(membership, membership.generation, what, str(dist.get_backend())):
                    group = dist.new_group(list(range(dist.get_world_size())), use_local_synchronization=True,
                                           timeout=_connect_timeout(membership))
        except PeerLostError:
            raise
        except Exception as e:
            raise _not_built(membership, membership.generation, what, e) from e
        group_record.add_connections(tuple(connections))
        set_group_timeout((record.timeout if record is not None else None) or DEFAULT_TIMEOUT, group)
    assert group is not None, "every rank is a member"
    return group


# Note [a death while the group is built]
# Building a gloo group waits in torch, with no way to stop it, until every
# member has connected or connect_timeout_s has passed: a member killed after
# its arrival (Note [arrivals]) and before it connected held every other member
# there for that long. So each member builds the group's gloo backend on a
# thread of its own (:class:`_GlooBuild`), over a connection of its own to the
# store, and meanwhile takes part in a roll call of the members whose backend is
# built, judged as the arrivals are: a member found dead before its backend was
# built fails the change at once, on every member, with a PeerLostError naming
# it, and the next change leaves it out. The thread is left to end at its own
# timeout (joined at exit if it has not: Note [a store call in flight at exit]
# in tandem/comm/thread_exit.py); what it builds then is dropped. Once every
# member's backend is built, torch builds the group around it
# (tandem._compat.given_gloo_backend), so the group is torch's own in every
# other respect, and the build's store connection is released
# (:class:`_BuildStore`). A death after every member has connected fails the
# group's first collective instead, as any death in a step does. nccl groups,
# and a TCP store on a torch without ``Store.clone`` (before 2.7), are built as
# torch builds them, and wait out connect_timeout_s for such a death.


class _BuildStore(dist.Store):
    """The store a group's gloo backend is built over (Note [a death while the
    group is built]): the calls of ``connection`` (a member's own), below the
    build's prefix for ``what`` in ``generation``, until :meth:`release` lets
    the connection go. The backend keeps its store for as long as it lives, and
    a generation's group lives as long as the process (forgotten, never
    destroyed: tandem._compat.forget_default_group); without the release,
    each world change would leave one more connection per member open on the
    store's host."""

    def __init__(self, connection: dist.Store, generation: Generation, what: str) -> None:
        super().__init__()
        # Held here as well: a store of Python's (a signed one) below torch's
        # PrefixStore answers only while its Python object lives.
        self._connection: Any = connection
        self._store: Any = dist.PrefixStore(f"{PREFIX}/gen/{generation.number}/gloo/{what}", connection)

    def release(self) -> None:
        self._store = self._connection = None

    def _inner(self) -> Any:
        if self._store is None:
            raise RuntimeError("tandem: this group's store connection was released once the group was built "
                               "(Note [a death while the group is built])")
        return self._store

    def set(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        self._inner().set(key, value)

    def get(self, key: str) -> bytes:  # type: ignore[override]
        return bytes(self._inner().get(key))

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        return int(self._inner().add(key, amount))

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        return bool(self._inner().check(keys))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:  # type: ignore[override]
        return bytes(self._inner().compare_set(key, expected, desired))

    def multi_get(self, keys: list[str]) -> list[bytes]:  # type: ignore[override]
        return [bytes(v) for v in self._inner().multi_get(keys)]

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:  # type: ignore[override]
        if timeout is None:
            self._inner().wait(keys)
        else:
            self._inner().wait(keys, timeout)

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        return bool(self._inner().delete_key(key))

    def num_keys(self) -> int:  # type: ignore[override]
        return int(self._inner().num_keys())


class _GlooBuild:
    """A gloo backend over ``store`` built on a thread of its own (Note [a death
    while the group is built]): :attr:`done` is set when it is built or has
    failed; :meth:`result` returns it or raises the failure."""

    def __init__(self, store: _BuildStore, rank: int, size: int, timeout: datetime.timedelta, name: str) -> None:
        self.done = threading.Event()
        self.store = store
        self.connections: list[Connection] = []
        """The TCP connections opened while the backend was built: its own, and
        any another thread opened meanwhile (Note [severing a forgotten group])."""
        self._backend: dist.ProcessGroupGloo | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._build, args=(store, rank, size, timeout),
                                        name=f"tandem-build-{name}", daemon=True)
        self._thread.start()

    def _build(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> None:
        try:
            with opened_connections() as opened:
                self._backend = dist.ProcessGroupGloo(store, rank, size, timeout)
            self.connections = opened
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by result()
            self._error = e
        finally:
            self.done.set()

    def result(self) -> dist.ProcessGroupGloo:
        if self._error is not None:
            raise self._error
        assert self._backend is not None, "result() before done"
        return self._backend

    def join_at_exit(self) -> None:
        """Leave the thread to end at its timeout, joined at exit if it has not
        (Note [a store call in flight at exit])."""
        join_before_exit(self._thread, 0.0)


@contextlib.contextmanager
def _built_while_watched(membership: Membership, generation: Generation, what: str, backend: str,
                         ahead: _GlooBuild | None = None, *, joining: bool = False) -> Iterator[None]:
    """Around torch's creation of ``what``, a group over ``generation``'s members:
    its gloo backend built first while the members watch each other (or the
    build begun ``ahead``: Note [a group built ahead]), then given to torch,
    then its store connection released (Note [a death while the group is
    built]); torch builds it all where that cannot be (another backend, a TCP
    store torch cannot open a second connection to).

    Raises:
        PeerLostError: a member died before its backend was built.
        MembershipError: not every member's was built within ``regroup_timeout_s``.
    """
    if ahead is not None:
        build = ahead
    else:
        store = own_connection(membership.store) if backend == "gloo" else None
        if store is None:
            yield
            return
        build = _GlooBuild(_BuildStore(store, generation, what), generation.rank_of(membership.member),
                           generation.world_size, _connect_timeout(membership), what)
    try:
        await_members(membership, generation, f"{what} connected", building=build, wait_for_all=not joining)
    except BaseException:
        build.join_at_exit()
        raise
    with given_gloo_backend(build.result()):
        yield
    build.store.release()


# Note [a group built ahead]
# Admitting a replacement stops the members while they build the next
# generation's group with it. Where its gloo backend is built on a thread (Note
# [a death while the group is built]), the members build it during a step
# instead:
#
# 1. The member whose count completes a step's decision, finding replacements
#    waiting, proposes the next generation (the members, then the replacements)
#    and decides ``prepare`` (Membership._growth): every member steps, arrives
#    at the new generation (Note [arrivals]) and starts building its backend
#    on a thread (:class:`GroupAhead`). The proposal admits the replacements,
#    which enter the generation as they always do. The members train the next
#    step in the old group meanwhile.
# 2. That step's decision is ``grow``: every member switches at its boundary.
#    Its enter_generation takes the backend built ahead, waiting for what is
#    left of the build on the roll call of the connected members, which finds
#    a death as it always does (Note [a death while the group is built]). So
#    the switch comes one step after the replacement was seen, always, and a
#    build no longer than a step costs the members nothing.
# 3. A loss in the old group meanwhile changes the world to the proposed
#    generation, with the backend built ahead; the change then finds the dead
#    member and fails, and the next leaves it out (Note [a join cut short] in
#    tandem/elastic/run.py). A job that ends at the step it prepared leaves its
#    replacement with nothing to join (exit 76), as one that ends before a
#    replacement is seen does.
#
# Where torch builds the group (nccl; a TCP store torch cannot open a second
# connection to), the decision is ``grow`` at once, as it always was.

# Note [a replacement goes on ahead]
# A member waits on the roll call of the connected members (Note [a death while
# the group is built]) before it leaves the old group behind: its connections
# to the old group are cut then, and every member must be done with them. A
# replacement has no old group, and once its own backend is built it is
# connected to every member: so it arrives on that roll and goes on, to
# its rebuild for the new world, without waiting for the members to switch (a
# step later: Note [a group built ahead]). Its first call that needs the
# members, the receive of the state from rank 0 (or, sharded, the shards'
# exchange), is posted and waits for them, watched as any: a member lost
# meanwhile fails it (a dead one by its beat, one gone to the next change as
# departed: Note [a peer gone to regroup] in tandem/comm/peers.py), and the
# replacement takes part in that change (Note [a join cut short] in
# tandem/elastic/run.py); members that all ended (a job that finished at the
# step it prepared) leave it nothing to join (exit 76). Its own set-up for the
# new world (its heartbeat's watch over the group, DDP's buckets laid out for
# it) is done as the members train that step, so the members, once switched,
# wait only for the state to go across.


class GroupAhead:
    """This member's build of the proposed next generation's default group's
    backend, begun as it trains (Note [a group built ahead]): it arrives at the
    generation (Note [arrivals]) and starts the build."""

    def __init__(self, membership: Membership, step: int) -> None:
        self.step = step
        """The steps committed when it began."""
        self.generation = generation = membership.generation_numbered(membership.generation.number + 1)
        _arrive(arrival_roll(membership.store, generation.number, "group"), membership.member, generation)
        store = own_connection(membership.store)
        assert store is not None, "a member builds ahead only where it has a connection of its own"
        self.build = _GlooBuild(_BuildStore(store, generation, "group"), generation.rank_of(membership.member),
                                generation.world_size, _connect_timeout(membership), "group-ahead")
        self.build.join_at_exit()  # a job that ends before the switch, or a world changed elsewhere, leaves it
        _hosts_read(membership, generation)  # the replacements', now rather than as the members switch


def _builds_on_a_thread(membership: Membership, backend: str) -> bool:
    """Whether the members' groups are built on a thread, watched (Note [a death
    while the group is built]), and so can be built ahead (Note [a group built ahead])."""
    return backend == "gloo" and has_own_connection(membership.store)


def _admitters_ended(membership: Membership, generation: Generation) -> NothingToJoin | None:
    """Why there is nothing to join when every member of the generation that
    admitted this replacement into ``generation`` has ended; else None."""
    admitting = membership.generation_numbered(generation.number - 1).members
    if len(membership.judged(admitting)) < len(admitting):
        return None
    return NothingToJoin(
        f"elastic: replacement {membership.member} was admitted to generation {generation.number}, and every "
        f"member of generation {generation.number - 1} ({list(admitting)}) ended before entering it: the job "
        "has ended (or died); nothing to join")


def _connect_timeout(membership: Membership) -> datetime.timedelta:
    """How long building a group over the members may take (Note [arrivals]):
    torch's gloo waits for the others' addresses for the group's own timeout."""
    return datetime.timedelta(seconds=membership.config.connect_timeout_s)


def _not_built(membership: Membership, generation: Generation, what: str, error: Exception) -> Exception:
    """Why building ``what`` over ``generation``'s members failed: a PeerLostError
    naming the members found dead within ``stale_after_s`` (one died after its
    arrival, Note [arrivals]), else ``error``."""
    others = [m for m in generation.members if m != membership.member]
    deadline = time.monotonic() + membership.config.stale_after_s
    while True:
        lost = membership.lost_among(generation, others, f"building generation {generation.number}'s {what}")
        if lost is not None:
            return lost
        if time.monotonic() > deadline:
            return error
        time.sleep(membership.config.beat_s)


def join_elastic(backend: str | None, init_method: str | None, timeout_td: datetime.timedelta) -> WorldInfo:
    """:func:`tandem.init` for a replacement worker (``TANDEM_ELASTIC_JOIN=1``): meet the
    running job in its store, and stand in a world of one until it asks to join
    (Note [a replacement builds first])."""
    etcd = EtcdAddress.from_env()  # Note [the workers' store on etcd] in tandem/store/store_address.py
    if etcd is not None and init_method in (None, "env://"):
        store: dist.Store = etcd.store(timeout_td)
    else:
        url = init_method or "env://"
        world_size = int(os.environ.get("WORLD_SIZE", "2"))
        # Rendezvous as a client: the store exists; rank 0 would try to host it.
        store, _, _ = next(dist.rendezvous(url, rank=1, world_size=max(world_size, 2), timeout=timeout_td))
    try:
        membership = Membership.replacement(signed(below_prefixes(store)), ElasticConfig())
    except NothingToJoin as e:
        nothing_to_join(e)
    backend = backend or default_backend()
    bind_group_defaults_before_init()
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout_td)
    device = bind_device(backend, int(os.environ.get("LOCAL_RANK", "0")), 0)
    info = WorldInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=device, backend=backend)
    group_record.start_watch(info, timeout_td, owned=True, timeout=timeout_td, elastic=membership)
    logger.info("tandem: elastic replacement %s stands in a world of one until it asks to join",
                membership.member)
    return info


def ask_to_join(membership: Membership, then: Callable[[Generation], object]) -> Generation:
    """A replacement's request to join, its entry in the generation that admits
    it (Note [a replacement builds first]), whose default group is then its
    own, and ``then(generation)``, its rebuild for that world. A peer lost in
    either when every member that admitted it has ended is nothing to join
    (Note [a replacement goes on ahead])."""
    try:
        generation = membership.ask_to_join()
        try:
            enter_generation(membership, generation, joining=True)
            then(generation)
        except PeerLostError as e:
            admitting = _admitters_ended(membership, generation)
            if admitting is not None:  # they finished as it joined (Note [a group built ahead], 3)
                raise admitting from e
            raise
    except NothingToJoin as e:
        nothing_to_join(e)
    return generation


def nothing_to_join(error: NothingToJoin) -> NoReturn:
    """A replacement started as the job finished: it did nothing wrong, and the
    script it runs must not go on as if it had joined."""
    print(f"tandem: {error}", file=sys.stderr, flush=True)
    raise SystemExit(NOTHING_TO_JOIN_EXITCODE) from None
