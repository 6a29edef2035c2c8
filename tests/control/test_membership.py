"""The elastic membership protocol (Note [elastic membership]) on an in-process
store with an injected clock: the step decision, deaths, generations, and a
replacement arriving after the job ended. No processes, no waiting on real time."""

from __future__ import annotations

import datetime
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import pytest
import torch.distributed as dist

from tandem.store.job_secret import ForgedValueError, SignedStore, job_secret, secret_for_workers
import tandem.control.membership as membership_module
from tandem.control.judge import Verdict, judging_ranks
from tandem.control.generation import PREFIX, Decision, ElasticConfig, Generation, MembershipError
from tandem.control.membership import NEVER_BEATEN, Membership, host_key
from tandem.control.roll_call import RollCall
from tandem.comm.process_id import NodeBeat, node_beat_key
from tandem.comm.peers import DEFAULT_LIVENESS, LEFT_GRACE_S, Liveness, PeerWatch, heartbeat_key

CONFIG = ElasticConfig(beat_s=0.01, stale_after_s=1.0, regroup_timeout_s=5.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


SECRET = b"a job secret for the tests"
T = TypeVar("T")


def _store(kind: str = "plain") -> dist.Store:
    """The job's store: as it is, or signed with a job secret (Note [signed store])."""
    return dist.HashStore() if kind == "plain" else SignedStore(dist.HashStore(), SECRET, "the test's store")


def _set_bytes(store: dist.Store, key: str, value: bytes) -> None:
    """Write ``value`` as it is: a store takes bytes, though torch's stubs type its values as str."""
    store.set(key, cast(str, value))


def _members(n: int, clock: Clock, store: dist.Store | None = None) -> tuple[dist.Store, list[Membership]]:
    store = store if store is not None else _store()
    members = [Membership.founding(store, r, n, CONFIG, clock=clock) for r in range(n)]
    return store, members


def _both(first: Membership, second: Membership, call: Callable[[Membership], T]) -> tuple[T, list[T]]:
    """``call`` on ``second`` in a thread and on ``first`` here, as two ranks make it
    at once: ``first``'s answer, and ``second``'s in a list (empty if it is still waiting)."""
    t, out = _in_thread(call, second)
    mine = call(first)
    t.join(5)
    return mine, out


def _in_thread(fn, *args):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    return t, out


@pytest.mark.parametrize("kind", ["plain", "signed"])
def test_every_member_reads_commit_once_all_are_done_and_a_steps_keys_go_a_step_later(kind: str) -> None:
    store, (m0, m1, m2) = _members(3, Clock(), _store(kind))

    def keys(step: int) -> list[bool]:
        return [store.check([f"{PREFIX}/gen/0/step/{step}/{what}"]) for what in ("done", "decision")]

    for step in range(3):
        threads = [_in_thread(m.decide_step, step) for m in (m1, m2)]
        assert m0.decide_step(step) is Decision.COMMIT
        for t, out in threads:
            t.join(5)
            assert out == [Decision.COMMIT]
        assert keys(step) == [True, True] and (step == 0 or keys(step - 1) == [False, False]), step
    for m in (m0, m1, m2):
        m.stop()


def test_an_abort_first_wins_for_everyone() -> None:
    _, (m0, m1) = _members(2, Clock())
    assert m0.abort_step(3) is Decision.ABORT
    assert m1.decide_step(3) is Decision.ABORT  # it would have been the last to count itself done
    for m in (m0, m1):
        m.stop()


@pytest.mark.parametrize("kind", ["plain", "signed"])
def test_a_member_seen_dead_aborts_the_step_and_is_left_out(kind: str) -> None:
    clock = Clock()
    _, (m0, m1, m2) = _members(3, clock, _store(kind))
    m2.stop()  # m2 dies: its beat stays at 1000
    clock.now += 2 * CONFIG.stale_after_s
    m0._beat()
    m1._beat()
    decision, decided = _both(m0, m1, lambda m: m.decide_step(0))
    assert decision is Decision.ABORT and decided == [Decision.ABORT]
    generation, proposed = _both(m0, m1, lambda m: m.next_generation())
    assert generation.members == ("0", "1") and proposed == [generation] and generation.number == 1
    for m in (m0, m1):
        m.stop()


def test_a_member_that_arrived_and_died_since_is_left_out() -> None:
    # It posted its candidacy for generation 1, then died before the others had all
    # arrived: the generation proposed leaves it out, rather than its arrival barrier
    # finding it dead and starting generation 2.
    clock = Clock()
    store, (m0, m1, m2) = _members(3, clock)
    store.set(f"{PREFIX}/gen/1/cand/2", "alive")
    m2.stop()
    clock.now += 2 * CONFIG.stale_after_s
    m0._beat()
    m1._beat()
    generation, out = _both(m0, m1, lambda m: m.next_generation())
    assert generation.members == ("0", "1") and out == [generation]
    for m in (m0, m1):
        m.stop()


def test_members_that_build_ahead_prepare_a_replacements_generation_and_grow_into_it_a_step_later() -> None:
    # Note [a group built ahead]: the decision that finds j1 waiting is `prepare`, with the
    # next generation proposed, which admits j1; the next step's is `grow`, into that one.
    clock = Clock()
    store, (m0, m1) = _members(2, clock)
    m0.builds_ahead = m1.builds_ahead = True
    t, joined = _in_thread(lambda: Membership.joining(store, CONFIG, clock=clock))
    deadline = time.monotonic() + 5
    while not m0.waiting_joiners():
        assert time.monotonic() < deadline, "the replacement never asked to join"
        time.sleep(0.01)
    decisions = []
    for step in (0, 1):
        t1, out = _in_thread(m1.decide_step, step)
        decisions.append(m0.decide_step(step))
        t1.join(5)
        assert out == [decisions[-1]]
        if step == 0:
            t.join(5)
            proposed = Generation(1, ("0", "1", "j1"))
            assert joined[0].generation == proposed and m0.generation_numbered(1) == proposed
            assert m0.generation.number == 0
    assert decisions == [Decision.PREPARE, Decision.GROW]
    t1, out = _in_thread(m1.next_generation)
    generation = m0.next_generation()
    t1.join(5)
    assert generation == proposed and out == [proposed]
    for m in (m0, m1, joined[0]):
        m.stop()


def test_the_last_member_to_arrive_proposes_the_next_generation_without_a_judges_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Note [a roll call]: no member reads the roll (no judge polls), so only the
    # last to arrive, which knows from its count that every member is there, can
    # propose; before it did, the change waited for a judge's next read.
    store, members = _members(3, Clock())
    monkeypatch.setattr(Membership, "roll_period", lambda self, generation, since: None)
    threads = []
    for m in members[1:]:
        threads.append(_in_thread(m.next_generation))
    deadline = time.monotonic() + 5
    while store.add(f"{PREFIX}/gen/1/regroup/count", 0) < 2:
        assert time.monotonic() < deadline, "the first two never arrived"
        time.sleep(0.01)
    threads.append(_in_thread(members[0].next_generation))
    for t, _ in threads:
        t.join(5)
    if any(t.is_alive() for t, _ in threads):
        store.set(f"{PREFIX}/gen/1/members", '["0", "1", "2"]')  # let them go before failing
    assert [out for _, out in threads] == [[members[0].generation]] * 3
    assert members[0].generation.members == ("0", "1", "2")
    for m in members:
        m.stop()


def test_too_few_members_stop_the_job() -> None:
    clock = Clock()
    store = dist.HashStore()
    config = ElasticConfig(beat_s=0.01, stale_after_s=1.0, min_world_size=2)
    m0, m1 = (Membership.founding(store, r, 2, config, clock=clock) for r in range(2))
    m1.stop()
    clock.now += 5
    with pytest.raises(MembershipError, match="fewer than min_world_size=2"):
        m0.next_generation()
    m0.stop()


@pytest.mark.parametrize("kind", ["plain", "signed"])
def test_a_replacement_is_admitted_at_a_grow_decision(kind: str) -> None:
    clock = Clock()
    store, (m0, m1) = _members(2, clock, _store(kind))
    t, joined = _in_thread(lambda: Membership.joining(store, CONFIG, clock=clock))
    deadline = time.monotonic() + 5
    while not m0.waiting_joiners():
        assert time.monotonic() < deadline, "the replacement never asked to join"
        time.sleep(0.01)
    t1, out = _in_thread(m1.decide_step, 0)
    assert m0.decide_step(0) is Decision.GROW
    t1.join(5)
    assert out == [Decision.GROW]
    t1, out = _in_thread(m1.next_generation)
    generation = m0.next_generation()
    t1.join(5), t.join(5)
    assert generation.members == ("0", "1", "j1") and joined[0].generation == generation
    for m in (m0, m1, joined[0]):
        m.stop()


@pytest.mark.parametrize("kind", ["plain", "signed"])
def test_a_members_host_is_read_once_and_a_missing_or_junk_one_is_a_host_of_its_own(
        kind: str, caplog: pytest.LogCaptureFixture) -> None:
    store, (m0, m1) = _members(2, Clock(), _store(kind))
    here, elsewhere = host_key(socket.gethostname()), host_key("another host")
    assert here != elsewhere
    assert m0.hosts_of(["0", "1"]) == [here, here]  # each posted its own as it started
    store.set(f"{PREFIX}/host/1", str(elsewhere))
    assert m0.hosts_of(["1", "0"]) == [here, here]  # read once: kept, not read again
    assert m1.hosts_of(["1"]) == [elsewhere]  # a process that had not read it reads it now
    m1.know_hosts({"0": elsewhere})  # gathered: taken as it is, not read
    assert m1.hosts_of(["0", "1"]) == [elsewhere, elsewhere]
    assert not caplog.records
    raw = store.inner if isinstance(store, SignedStore) else store
    raw.set(f"{PREFIX}/host/j9", "not a number")
    with caplog.at_level(logging.WARNING):
        hosts = m0.hosts_of(["0", "j8", "j9"])  # j8 posted none
    assert hosts == [here, host_key("member j8"), host_key("member j9")]
    assert sum("counted as alone on its host" in r.getMessage() for r in caplog.records) == 2
    for m in (m0, m1):
        m.stop()


@pytest.mark.parametrize("kind", ["plain", "signed"])
def test_model_digests_are_read_at_once_and_a_missing_or_junk_one_reads_as_none(kind: str) -> None:
    # Note [a grow checked in the store] in tandem/train/trainer.py: None tells every member
    # to gather the digests instead; the members read the same keys, so all decide alike.
    store, (m0, m1) = _members(2, Clock(), _store(kind))
    m0.post_model_digest([1, -2, 3, 4])
    assert m1.model_digests(["0"]) == [[1, -2, 3, 4]]
    assert m1.model_digests(["0", "1"]) is None  # 1 posted none
    m1.post_model_digest([5, 6, 7, 8])
    assert m0.model_digests(["1", "0"]) == [[5, 6, 7, 8], [1, -2, 3, 4]]
    key = f"{PREFIX}/digest/1"
    for junk in ("not json", "[1, 2.5]", '{"a": 1}'):
        if isinstance(store, SignedStore):
            store.inner.set(store.name(key), junk)  # a stranger's, not signed
        else:
            store.set(key, junk)
        assert m0.model_digests(["0", "1"]) is None, junk
    for m in (m0, m1):
        m.stop()


class _Built:
    """A gloo backend's build that is done (``_GlooBuild``'s face to ``await_members``)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.done.set()

    def result(self) -> object:
        return object()


def test_a_replacement_whose_backend_is_built_goes_on_without_waiting_for_the_members() -> None:
    # Note [a replacement goes on ahead] in tandem/control/elastic_group.py: j1 arrives on
    # the roll of the connected and returns; a member waits there until every one arrived.
    from tandem.control.elastic_group import await_members
    from tandem.control.membership import arrival_roll

    store, (m0, m1) = _members(2, Clock())
    generation = Generation(1, ("0", "1"))
    roll = arrival_roll(store, 1, "group connected")
    await_members(m1, generation, "group connected", building=_Built(), wait_for_all=False)  # type: ignore[arg-type]
    assert roll.arrived() == ["1"] and roll.outcome_now() is None  # m0 has not arrived: no wait
    t, out = _in_thread(lambda: await_members(m0, generation, "group connected",
                                              building=_Built()))  # type: ignore[arg-type]
    t.join(5)
    assert not t.is_alive() and out == [None] and roll.outcome_now() is not None  # the last: all came
    for m in (m0, m1):
        m.stop()


def _ask_as_a_stranger(raw: dist.Store, clock: Clock) -> None:
    """What a replacement writes to ask to join, written by a process without the
    job's secret, under the keys' names as they are without one."""
    number = raw.add(f"{PREFIX}/joiners", 1)
    raw.set(f"{PREFIX}/beat/j{number}", repr(clock.now))
    raw.set(f"{PREFIX}/join/j{number}", "waiting")


@pytest.mark.parametrize("kind", ["plain", "signed"])
def test_a_stranger_asking_to_join_is_admitted_only_without_a_secret(kind: str) -> None:
    clock = Clock()
    store, (m0, m1) = _members(2, clock, _store(kind))
    raw = store.inner if isinstance(store, SignedStore) else store
    _ask_as_a_stranger(raw, clock)
    t1, out = _in_thread(m1.decide_step, 0)
    decision = m0.decide_step(0)
    t1.join(5)
    if kind == "plain":  # what a secret prevents: the stranger would be the next generation's member
        assert m0.waiting_joiners() == ["j1"] and decision is Decision.GROW
    else:
        assert m0.waiting_joiners() == [] and decision is Decision.COMMIT and out == [Decision.COMMIT]
    for m in (m0, m1):
        m.stop()


def _asks_while_they_step(store: dist.Store, m0: Membership, m1: Membership,
                          clock: Clock) -> tuple[list[Exception], float]:
    """A replacement on ``store`` asks to join while the two members step (every
    step committed), for 4 s at most: the errors it raised, and when it started."""
    errors: list[Exception] = []

    def ask() -> None:
        try:
            Membership.joining(store, CONFIG, clock=clock)
        except MembershipError as e:
            errors.append(e)

    t = threading.Thread(target=ask)
    t.start()
    step, started = 0, time.monotonic()
    while t.is_alive() and time.monotonic() - started < 4.0:
        t1, out = _in_thread(m1.decide_step, step)
        assert m0.decide_step(step) is Decision.COMMIT
        t1.join(5)
        assert out == [Decision.COMMIT]
        step += 1
    t.join(5)
    return errors, started


def test_a_stranger_asking_to_join_a_job_with_a_secret_is_told_it_was_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    store, (m0, m1) = _members(2, clock, _store("signed"))
    assert isinstance(store, SignedStore)
    with caplog.at_level("WARNING"):  # tandem's own replacement, run without the secret
        errors, started = _asks_while_they_step(store.inner, m0, m1, clock)
    assert len(errors) == 1 and "replacement j1 was refused: the job has a job secret" in str(errors[0])
    assert "TANDEM_JOB_SECRET" in str(errors[0])
    assert time.monotonic() - started < CONFIG.regroup_timeout_s  # told, not timed out
    assert caplog.text.count("refused a process that asked to join as j1 without this job's secret") == 1
    assert m0.generation.members == m1.generation.members == ("0", "1")
    for m in (m0, m1):
        m.stop()




def test_a_replacement_with_another_secret_is_told_the_secrets_differ(capfd: pytest.CaptureFixture) -> None:
    clock = Clock()
    store, (m0, m1) = _members(2, clock, _store("signed"))
    assert isinstance(store, SignedStore)
    # tandem's own replacement, started with another secret
    errors, started = _asks_while_they_step(SignedStore(store.inner, b"another secret", "its store"), m0, m1, clock)
    assert len(errors) == 1 and "this job's secret differs from yours" in str(errors[0]), errors
    assert "TANDEM_JOB_SECRET" in str(errors[0])
    assert time.monotonic() - started < CONFIG.regroup_timeout_s  # told, not timed out
    said = capfd.readouterr().err
    assert said.count("refused a process that asked to join as j1 with another secret than this job's") == 1, said
    assert m0.generation.members == m1.generation.members == ("0", "1")
    # A replacement with the job's own secret asks under the plain names too, and is not refused there.
    t, joined = _in_thread(lambda: Membership.joining(store, CONFIG, clock=clock))
    deadline = time.monotonic() + 5
    while not m0.waiting_joiners():
        assert time.monotonic() < deadline, "the replacement never asked to join"
        time.sleep(0.01)
    # Its id is the job's j1 (the other drew its own j1 under its secret's names); plainly, j2.
    assert store.inner.check([f"{PREFIX}/join/j2"]) and not store.inner.check([f"{PREFIX}/refused/j2"])
    t1, out = _in_thread(m1.decide_step, 99)
    assert m0.decide_step(99) is Decision.GROW
    t1.join(5)
    t1, out = _in_thread(m1.next_generation)
    generation = m0.next_generation()
    t1.join(5), t.join(5)
    assert generation.members == ("0", "1", "j1") and joined[0].generation == generation
    assert "refused" not in capfd.readouterr().err
    for m in (m0, m1, joined[0]):
        m.stop()


@pytest.mark.parametrize("junk", ["not a number", "huge", "over the secret name"])
def test_junk_in_the_counter_of_asks_costs_the_members_one_line(junk: str, capfd: pytest.CaptureFixture) -> None:
    # A stranger writes the plain counter every step: a word (an add to it would close the
    # adder's connection), or a number 20,000 higher (each ask would be a store call); or,
    # having listed the store's keys, a word over the counter under its secret name.
    clock = Clock()
    store, (m0, m1) = _members(2, clock, _store("signed"))
    assert isinstance(store, SignedStore)
    raw = store.inner
    for step in range(5):
        if junk == "huge":
            raw.add(f"{PREFIX}/joiners", 20_000)
        elif junk == "over the secret name":
            raw.set(store.name(f"{PREFIX}/joiners"), "not a number")
        else:
            raw.set(f"{PREFIX}/joiners", "not a number")
        t1, out = _in_thread(m1.decide_step, step)
        assert m0.decide_step(step) is Decision.COMMIT
        t1.join(5)
        assert out == [Decision.COMMIT]
    said = capfd.readouterr().err
    lines = [line for line in said.splitlines() if "counter of asks to join" in line]
    # At most one line a member (both members live in this process), never one per ask or step.
    assert 1 <= len(lines) <= 2, said
    assert not [line for line in said.splitlines() if "refused a process" in line], said
    assert m0.generation.members == m1.generation.members == ("0", "1")
    for m in (m0, m1):
        m.stop()


@pytest.mark.parametrize("kind", ["plain", "signed"])
def test_a_beat_overwritten_with_junk_neither_kills_a_member_nor_keeps_a_dead_one(
        kind: str, caplog: pytest.LogCaptureFixture) -> None:
    # A stranger who listed the store's keys writes junk over m1's beat before every look.
    clock = Clock()
    store, (m0, m1) = _members(2, clock, _store(kind))
    raw = store.inner if isinstance(store, SignedStore) else store
    name = store.name(f"{PREFIX}/beat/1") if isinstance(store, SignedStore) else f"{PREFIX}/beat/1"
    with caplog.at_level("WARNING"):
        for _ in range(20):
            raw.set(name, "junk")
            assert m0.dead(["1"]) == {}  # alive: its last good beat is fresh
        m1.stop()  # it dies; its beat stays junk
        clock.now += 2 * CONFIG.stale_after_s
        raw.set(name, "junk")
        assert "1" in m0.dead(["1"]) and "stopped beating" in m0.dead(["1"])["1"]
    if kind == "signed":  # once for the key, not once a look
        assert caplog.text.count("refused a value under 'tandem/elastic/beat/1'") == 1, caplog.text
    m0.stop()


def test_a_value_not_signed_with_the_secret_is_refused_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    raw = dist.HashStore()
    store = SignedStore(raw, SECRET, "the test's store")
    store.set("tandem/elastic/latest", "3")
    assert store.get("tandem/elastic/latest") == b"3"
    name = store.name("tandem/elastic/latest")
    assert name.startswith("tandem/s/") and "latest" not in name and not raw.check(["tandem/elastic/latest"])
    assert store.compare_set("tandem/elastic/gen/1/members", "", '["0"]') == b'["0"]'
    assert store.compare_set("tandem/elastic/gen/1/members", "", '["0", "j1"]') == b'["0"]'  # the first wins
    assert store.add("tandem/elastic/joiners", 1) == 1 and store.check(["tandem/elastic/joiners"])
    # written by a process that learned the name but not the secret; a value moved from another key
    raw.set(name, "7")
    moved = raw.get(store.name("tandem/elastic/gen/1/members"))
    with caplog.at_level("WARNING"), pytest.raises(ForgedValueError, match="not signed with this job's secret"):
        store.get("tandem/elastic/latest")
    _set_bytes(raw, name, moved)
    with pytest.raises(ForgedValueError, match="'tandem/elastic/latest' in the test's store"):
        store.get("tandem/elastic/latest")
    assert "refused a value under 'tandem/elastic/latest' in the test's store" in caplog.text
    other = SignedStore(raw, b"another job's secret")
    assert other.name("tandem/elastic/latest") != name


def test_the_job_secret_comes_from_the_environment_or_a_file(tmp_path) -> None:
    assert job_secret({}) is None
    assert job_secret({"TANDEM_JOB_SECRET": " abc \n"}) == b"abc"
    path = tmp_path / "secret"
    path.write_text("from a file\n")
    assert job_secret({"TANDEM_JOB_SECRET_FILE": str(path)}) == b"from a file"
    with pytest.raises(ValueError, match="TANDEM_JOB_SECRET_FILE=.*cannot be read"):
        job_secret({"TANDEM_JOB_SECRET_FILE": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="is empty"):
        job_secret({"TANDEM_JOB_SECRET": " "})
    one, two = secret_for_workers(1, {}), secret_for_workers(1, {})
    assert len(one["TANDEM_JOB_SECRET"]) == 64 and one != two  # a new one per job of one node
    assert secret_for_workers(1, {"TANDEM_JOB_SECRET": "x"}) == {}  # inherited by the workers
    with pytest.raises(ValueError, match="a job of several nodes needs one job secret shared by every node"):
        secret_for_workers(2, {})  # each node would make its own: every node must be given the same
    assert secret_for_workers(2, {"TANDEM_JOB_SECRET": "x"}) == {}


def test_a_replacement_after_the_job_ended_gives_up_at_once() -> None:
    clock = Clock()
    store, members = _members(2, clock)
    for m in members:
        m.stop()
    clock.now += 10
    with pytest.raises(MembershipError, match="found no live member"):
        Membership.joining(store, CONFIG, clock=clock)


def test_a_collectives_watch_judges_by_the_elastic_configs_window() -> None:
    # Note [dead peers]: an elastic job's collectives judge silent peers by its own
    # window, shorter or longer than the default (a death is seen at once anyway:
    # Note [deaths seen at once]; the window is for silences).
    # Its waits are sliced by a beat at most (a death seen within a beat, Note [dead peers]); its
    # monitors beat five times a window (the deaths are seen from the members' beats).
    assert CONFIG.liveness() == Liveness(beat_s=0.2, stale_after_s=1.0, slice_s=0.01)
    assert ElasticConfig().liveness() == Liveness(beat_s=2.0, stale_after_s=10.0, slice_s=0.25)
    assert DEFAULT_LIVENESS == Liveness(beat_s=0.25, stale_after_s=2.5, slice_s=0.5)
    store, clock = dist.HashStore(), Clock()
    short = PeerWatch(store, 0, CONFIG.liveness(), clock=clock)
    default = PeerWatch(store, 0, clock=clock)
    patient = PeerWatch(store, 0, ElasticConfig().liveness(), clock=clock)
    store.set(heartbeat_key(1), "7")
    assert short.observe([0, 1]) == {} and default.observe([0, 1]) == {} and patient.observe([0, 1]) == {}
    clock.now += 1.0  # rank 1's beat has not moved for 1 s
    assert short.observe([0, 1]) == {1: "stopped beating 1.0 s ago"}
    assert default.observe([0, 1]) == {}
    clock.now += 1.5
    assert default.observe([0, 1]) == {1: "stopped beating 2.5 s ago"}
    clock.now += 5.0  # a pause of 7.5 s is not a death for an elastic job
    assert patient.observe([0, 1]) == {}
    clock.now += 2.5
    assert patient.observe([0, 1]) == {1: "stopped beating 10.0 s ago"}
    with pytest.raises(ValueError, match="at least four beats"):
        Liveness(beat_s=0.5, stale_after_s=1.0)


class Watched(Membership):
    """A member that counts its own sweeps of every other member (Note [judge once])."""

    sweeps = 0

    def dead(self, members):
        if len(members) > 1:
            self.sweeps += 1
        return super().dead(members)


JUDGED = ElasticConfig(beat_s=0.01, stale_after_s=30.0, regroup_timeout_s=5.0)  # no fallback within a test


@pytest.mark.parametrize(("kind", "lost"), [("plain", "7"), ("signed", "7"), ("plain", "0")])
def test_one_member_judges_for_all_and_a_deputy_when_it_is_gone(kind: str, lost: str) -> None:
    # Note [judge once] in judge.py: none but the judge (rank 0) or, with it gone, a deputy
    # (ranks 4 and 7 of 8) sweeps the others.
    clock = Clock()
    store = _store(kind)
    # founding is typed to return a Membership; called on Watched it builds a Watched.
    members = [cast(Watched, Watched.founding(store, r, 8, JUDGED, clock=clock)) for r in range(8)]
    members[int(lost)].stop()  # dies: its beat stays at 1000
    clock.now += 2 * JUDGED.stale_after_s
    live = [m for m in members if m.member != lost]
    for m in live:
        m._beat()
    threads = [_in_thread(m.decide_step, 0) for m in live]
    for t, out in threads:
        t.join(10)
        assert out == [Decision.ABORT]
    verdict = Verdict.decode(store.get(f"{PREFIX}/gen/0/verdict"))
    assert verdict is not None and verdict.dead == {lost: f"stopped beating {2 * JUDGED.stale_after_s:.1f} s ago"}
    assert verdict.by == ("0" if lost != "0" else "4")  # the judge, or its first deputy
    assert judging_ranks(8) == (0, 4, 7) and judging_ranks(2) == (0, 1) and judging_ranks(1) == (0,)
    readers = [m for m in live if int(m.member) not in judging_ranks(8)]
    assert len(readers) >= 4 and [m.sweeps for m in readers] == [0] * len(readers)
    for m in live:
        m.stop()


def test_junk_under_the_verdict_is_no_verdict() -> None:
    for junk in (b"\xff", b"[]", b'{"at": "x", "by": 1, "dead": {}}', b'{"at": 1}'):
        assert Verdict.decode(junk) is None
    verdict = Verdict(5.0, "0", {"3": "has died"})
    assert Verdict.decode(verdict.encode().encode()) == verdict


def _on_nodes(store: dist.Store, clock: Clock, n: int, per_node: int) -> list[Membership]:
    """``n`` members whose launchers beat for them, ``per_node`` to a node (``node<k>``), each
    with a pid of its own (they share this process's): Note [deaths seen at once]."""
    for k in range(n // per_node):
        store.set(node_beat_key(f"node{k}"), NodeBeat(clock(), {}).encode())
    members = [Membership.founding(store, r, n, JUDGED, clock=clock, node=f"node{r // per_node}") for r in range(n)]
    for r, m in enumerate(members):
        assert m.node == f"node{r // per_node}" and not store.check([f"{PREFIX}/beat/{r}"])  # no beat of its own
        store.set(f"{PREFIX}/node_of/{r}", f"node{r // per_node} {7000 + r}")
    return members


def _ended(store: dist.Store, clock: Clock, node: str, pid: int) -> None:
    """What the node's launcher writes when its worker ``pid`` is killed."""
    beat = NodeBeat(clock(), {pid: f"its process (pid {pid}) was killed by SIGKILL"})
    store.set(node_beat_key(node), beat.encode())


@pytest.mark.parametrize("kind", ["plain", "signed"])
def test_the_judge_aborts_the_step_the_others_wait_on_and_a_deputy_takes_over_when_it_ends(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Note [judge once]: with decision waits of 60 s, the members learn of a death only from
    # the decision the judge writes. The judge (rank 0) judges, then its process ends: its
    # launcher names it in its node's beat, and the first deputy (rank 4, on another node)
    # takes over at once, not after stale_after_s (30 s): it judges and aborts the step.
    monkeypatch.setattr(membership_module, "_DECISION_SLICE_S", 60.0)
    clock, store = Clock(), _store(kind)
    members = _on_nodes(store, clock, 8, 4)
    slow = members[3]  # never counts itself done: the step waits
    threads = [_in_thread(m.decide_step, 0) for m in members if m is not slow]
    deadline = time.monotonic() + 10
    while not store.check([f"{PREFIX}/gen/0/verdict"]) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert Verdict.decode(store.get(f"{PREFIX}/gen/0/verdict")) == Verdict(clock.now, "0", {})  # all alive
    members[0].stop()  # the judge's process ends ...
    clock.now += 5 * JUDGED.beat_s  # (its last verdict ages)
    _ended(store, clock, "node0", 7000)  # ... and its launcher says so
    for t, out in threads[1:]:
        t.join(10)
        assert out == [Decision.ABORT]
    verdict = Verdict.decode(store.get(f"{PREFIX}/gen/0/verdict"))
    assert verdict == Verdict(clock.now, "4", {"0": "has died: its process (pid 7000) was killed by SIGKILL"})
    # the deputy posted the news too, which wakes the waits of the members' news threads
    assert store.get(f"{PREFIX}/gen/0/news") == b"dead"
    threads[0][0].join(10)  # the dead judge's own wait, a thread of this test
    for m in members:
        m.stop()


class Sweeper(Membership):
    """A member that counts its sweeps of the whole generation and its looks at the judging seats."""

    sweeps = 0
    looks = 0

    def judged(self, members):
        self.sweeps += len(members) > len(judging_ranks(8))
        return super().judged(members)

    def _seats_gone(self, generation):
        self.looks += 1
        return super()._seats_gone(generation)


def _late_verdict(monkeypatch: pytest.MonkeyPatch, windows_waited: float) -> tuple[dist.Store, Clock, list[Sweeper]]:
    """8 members on 2 nodes whose judging seats (ranks 0, 4, 7) stopped judging
    while their nodes beat on; the others have waited ``windows_waited``
    liveness windows for a verdict, and wait on step 0, which cannot commit."""
    monkeypatch.setattr(membership_module, "_DECISION_SLICE_S", 0.02)
    clock, store = Clock(), _store()
    for k in range(2):
        store.set(node_beat_key(f"node{k}"), NodeBeat(clock(), {}).encode())
    members = [cast(Sweeper, Sweeper.founding(store, r, 8, JUDGED, clock=clock, node=f"node{r // 4}"))
               for r in range(8)]
    for r in range(8):
        store.set(f"{PREFIX}/node_of/{r}", f"node{r // 4} {7000 + r}")
    for r in judging_ranks(8):
        members[r].stop()
    readers = [m for m in members if int(m.member) not in judging_ranks(8)]
    for m in readers:
        m._judge_of(m.generation)._since -= windows_waited * JUDGED.stale_after_s
    return store, clock, readers


def test_a_late_verdict_from_living_judges_is_waited_for_and_dead_judges_are_judged_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [judge once]: past a window without a verdict, a member judges for
    itself only when every judging seat is dead: a thousand members sweeping
    at once are what keeps a slow store's judge late."""
    store, clock, readers = _late_verdict(monkeypatch, 1.1)
    threads = [_in_thread(m.decide_step, 0) for m in readers]
    deadline = time.monotonic() + 10
    while min(m.looks for m in readers) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert min(m.looks for m in readers) >= 3 and [m.sweeps for m in readers] == [0] * len(readers)
    _ended(store, clock, "node0", 7000)  # the seats' processes end, and their launchers say so
    store.set(node_beat_key("node1"), NodeBeat(clock(), {7004: "killed", 7007: "killed"}).encode())
    for t, out in threads:
        t.join(10)
        assert out == [Decision.ABORT]
    assert max(m.sweeps for m in readers) >= 1  # no judge lives: the abort is a reader's


def test_past_three_windows_without_a_verdict_a_member_judges_for_itself_whatever_the_seats(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A seat whose node beats may still be a process that no longer judges: the wait on it is bounded."""
    store, _, readers = _late_verdict(monkeypatch, 3.1)
    threads = [_in_thread(m.decide_step, 0) for m in readers]
    deadline = time.monotonic() + 10
    while min(m.sweeps for m in readers) < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert min(m.sweeps for m in readers) >= 1 and max(m.looks for m in readers) == 0
    store.set(f"{PREFIX}/gen/0/step/0/decision", Decision.ABORT.value)  # no one is dead: end the wait
    for t, out in threads:
        t.join(10)
        assert out == [Decision.ABORT]


def test_a_member_reads_a_late_roll_call_itself_only_when_its_judges_are_dead_or_three_windows_late(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [a roll call]: the same bound on a world change's roll as on a step's verdict."""
    store, clock, readers = _late_verdict(monkeypatch, 0)
    member, generation = readers[0], readers[0].generation
    window = JUDGED.stale_after_s + len(judging_ranks(8)) * JUDGED.beat_s
    now = time.monotonic()
    periods = [member.roll_period(generation, now - late * window) for late in (0.5, 1.1, 3.1)]
    assert periods == [None, None, member.slice_s()]  # within the window; the judges live; three windows
    _ended(store, clock, "node0", 7000)
    store.set(node_beat_key("node1"), NodeBeat(clock(), {7004: "killed", 7007: "killed"}).encode())
    assert member.roll_period(generation, now - 1.1 * window) == member.slice_s()  # the judges are dead
    assert member.roll_period(generation, now - 0.5 * window) is None
    for m in readers:
        m.stop()


def test_a_member_whose_node_stopped_beating_is_dead_and_junk_under_a_node_beat_is_skipped() -> None:
    clock, store = Clock(), _store("signed")
    assert isinstance(store, SignedStore)
    members = _on_nodes(store, clock, 4, 2)
    judge = members[0]
    assert judge.judged(["1", "2", "3"]) == {}
    _set_bytes(store.inner, store.name(node_beat_key("node1")), b"junk")  # a stranger's write: not signed
    store.set(node_beat_key("node0"), b"{not json")  # signed junk: no beat either
    assert judge.judged(["1", "2", "3"]) == {} and judge.dead(["1", "2", "3"]) == {}
    clock.now += JUDGED.stale_after_s + 1  # no beat of node1 since: its members are dead, node0's is junk
    why = f"stopped beating {JUDGED.stale_after_s + 1:.1f} s ago (its node's launcher did)"
    assert judge.judged(["1", "2", "3"]) == {"1": why, "2": why, "3": why}
    store.set(node_beat_key("node0"), NodeBeat(clock.now, {}).encode())
    _ended(store, clock, "node1", 7003)
    # node1 beats again, naming its worker 7003 ended: member 3 is dead, member 2 alive
    assert judge.dead(["1", "2", "3"]) == {"3": "has died: its process (pid 7003) was killed by SIGKILL"}
    assert judge.judged(["1", "2", "3"]) == judge.dead(["1", "2", "3"])
    for m in members:
        m.stop()


def test_a_member_whose_node_does_not_beat_beats_for_itself() -> None:
    # A launcher that set TANDEM_NODE and never beat (no workers' store to beat in) leaves its
    # workers beating as before, not dead.
    clock, store = Clock(), _store()
    m = Membership.founding(store, 0, 1, JUDGED, clock=clock, node="nowhere")
    assert m.node is None and store.get(f"{PREFIX}/beat/0") == repr(clock.now).encode()
    assert not store.check([f"{PREFIX}/node_of/0"])
    m.stop()


def test_a_member_that_starts_after_the_judge_first_read_it_is_judged_by_its_nodes_beat() -> None:
    # The judge read member 1 before it posted whose node beats for it: then it had never beaten
    # (it may be starting), but that read is not kept, or member 1 would be read by a beat of
    # its own that it never writes, "never beaten" at every verdict: the steps aborted one after
    # another at a job's start, and member 1 left the job (a soak's first seconds on 2 cores).
    clock, store = Clock(), _store()
    store.set(node_beat_key("node0"), NodeBeat(clock(), {}).encode())
    judge = Membership.founding(store, 0, 2, JUDGED, clock=clock, node="node0")
    assert judge.judged(["1"]) == {"1": membership_module.NEVER_BEATEN}  # not started yet
    late = Membership.founding(store, 1, 2, JUDGED, clock=clock, node="node0")
    assert late.node == "node0" and not store.check([f"{PREFIX}/beat/1"])
    assert judge.judged(["1"]) == {} and judge.dead(["1"]) == {}
    for m in (judge, late):
        m.stop()


class _Counted:
    """A store that counts the operations made on it (duck-typed: what a watch and a member call)."""

    def __init__(self, store: dist.Store) -> None:
        self.store, self.ops = store, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.ops += 1
            return attr(*args, **kwargs)
        return counted


def test_a_collectives_watch_reads_the_verdict_not_every_peer() -> None:
    # Note [a watch reads the verdict] in tandem/comm/peers.py: a slice of a watched wait in an
    # elastic job reads the generation's verdict and whether anyone left to regroup, not two
    # keys a peer; with no verdict (no seat yet, or a stale one) it looks at every peer itself.
    clock = Clock()
    counted = _Counted(dist.HashStore())
    store = cast(dist.Store, counted)
    members = _on_nodes(store, clock, 16, 4)
    reader = members[3]  # no judging seat (0, 8 and 15 are)
    watch = PeerWatch(store, 3, JUDGED.liveness(), clock=clock)
    watch.departed, watch.judged = reader.departed, reader.judged_ranks
    ranks = list(range(16))
    assert reader.judged_ranks(ranks) is None  # before its first step's decision: no seat
    counted.ops = 0
    assert watch.observe(ranks) == {}
    swept = counted.ops
    assert swept >= 2 * 15, swept  # the beat and the process of each peer
    reader._judge_of(reader.generation)  # as the first step's decision does
    killed = "has died: its process (pid 7005) was killed by SIGKILL"
    store.set(f"{PREFIX}/gen/0/verdict", Verdict(clock(), "0", {"5": killed, "3": killed, "9": NEVER_BEATEN}).encode())
    counted.ops = 0
    # rank 5 is dead; this rank itself is never lost, and no beat yet is no death in a running collective
    assert watch.observe(ranks) == {5: killed}
    assert counted.ops <= 3, counted.ops  # the verdict (check, get) and the regroup's count
    counted.ops = 0
    assert watch.observe(ranks, failed=True) == {}  # after gloo failed: every peer, as before (none stale yet)
    assert counted.ops >= swept
    members[7].store.set(f"{PREFIX}/gen/1/cand/7", "alive")  # member 7 goes to regroup ...
    RollCall(store, f"{PREFIX}/gen/1/regroup").arrive("7")
    assert watch.observe(ranks) == {5: killed}  # ... seen for a whole slice before it counts
    clock.now += LEFT_GRACE_S
    assert watch.observe(ranks) == {5: killed, 7: "has left generation 0 to regroup (member 7)"}
    clock.now += JUDGED.stale_after_s + 1  # the verdict is stale: the judges are gone
    assert reader.judged_ranks(ranks) is None
    counted.ops = 0
    watch.observe(ranks)
    assert counted.ops >= swept
    for m in members:
        m.stop()


def test_a_member_that_leaves_names_the_death_it_saw_and_a_waiting_watch_loses_it_at_once() -> None:
    # Note [a departure names the dead] in tandem/comm/peers.py: member 0's process ended; its
    # ring neighbour (member 1) saw it at once and leaves to regroup, while the verdict, made a
    # moment before, names nobody. Member 2's watch, which the death failed no connection of,
    # loses rank 0 at its next look, from what member 1 posted as it left (member 1 itself only
    # after a slice's grace); what member 2 then posts names the death as seen, not who left.
    clock = Clock()
    store = _store()
    members = _on_nodes(store, clock, 4, 2)
    reader = members[2]  # no judging seat (0, 2 and 3 are; its judge thread is not started)
    watch = PeerWatch(store, 2, JUDGED.liveness(), clock=clock)
    watch.departed, watch.judged = reader.departed, reader.judged_ranks
    reader._judge_of(reader.generation)
    store.set(f"{PREFIX}/gen/0/verdict", Verdict(clock(), "0", {}).encode())
    ranks = [0, 1, 2, 3]
    assert watch.observe(ranks) == {}
    killed = "has died: its process (pid 7000) was killed by SIGKILL, seen by its launcher"
    _ended(store, clock, "node0", 7000)
    t1, out1 = _in_thread(lambda: members[1].next_generation(known_dead={"0": killed}))
    # Its news is the last it writes as it leaves (after its candidacy and its arrival)
    _until(lambda: store.check([f"{PREFIX}/gen/0/news"]), "member 1 leaving")
    named = f"{killed} (named by member 1 as it left)"
    assert watch.observe(ranks) == {0: named}  # at once; member 1 is not lost before its grace
    clock.now += LEFT_GRACE_S
    assert watch.observe(ranks) == {0: named, 1: "has left generation 0 to regroup (member 1)"}
    # Members 2 and 3 leave too, with what their watches found: the generation agreed is 1, 2, 3.
    t2, out2 = _in_thread(lambda: members[2].next_generation(
        known_dead={"0": named, "1": "has left generation 0 to regroup (member 1)"}))
    generation = members[3].next_generation()
    for t in (t1, t2):
        t.join(10)
    assert generation.members == ("1", "2", "3") and out1 == [generation] and out2 == [generation]
    posted = json.loads(store.get(f"{PREFIX}/gen/1/cand/2").decode())
    assert posted == {"dead": {"0": killed}}
    for m in members:
        m.stop()


class _OverTcp(Membership):
    """A member whose news thread has a TCP connection of its own while its other calls
    are counted (as the control-plane benchmark's members)."""

    tcp: dist.TCPStore

    def _news_store(self) -> dist.Store | None:
        return cast(dist.Store, self.tcp.clone())  # type: ignore[attr-defined]  # torch 2.7+


def _until(condition: Callable[[], bool], what: str) -> None:
    """Wait for another thread to make ``condition`` true (5 s at most)."""
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within 5 s"
        time.sleep(0.005)


def test_over_a_tcp_store_a_collectives_watch_reads_nothing_until_the_news() -> None:
    # Note [news of a generation] in tandem/control/news.py: each member's thread waits on the
    # generation's news key, which the judge writes when it names a death; until then a
    # slice of a collective's watch reads nothing, and after it the verdict, which names it.
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tcp = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    clock = Clock()
    counted = _Counted(tcp)
    store = cast(dist.Store, counted)
    for k in range(2):
        store.set(node_beat_key(f"node{k}"), NodeBeat(clock(), {}).encode())
    members = [cast(_OverTcp, _OverTcp.founding(store, r, 4, JUDGED, clock=clock, node=f"node{r // 2}"))
               for r in range(4)]
    for m in members:
        m.tcp = tcp
    reader = members[1]  # no judging seat (0, 2 and 3 are)
    watch = PeerWatch(store, 1, JUDGED.liveness(), clock=clock)
    watch.departed, watch.judged = reader.departed, reader.judged_ranks
    reader._judge_of(reader.generation)  # as the first step's decision does
    store.set(f"{PREFIX}/gen/0/verdict", Verdict(clock(), "0", {}).encode())
    assert watch.observe([0, 1, 2, 3]) == {}  # its news thread starts
    news = reader._news
    assert news is not None and not news.heard
    counted.ops = 0
    assert watch.observe([0, 1, 2, 3]) == {} and counted.ops == 0  # nothing read (the verdict: once a half window)
    killed = "has died: its process (pid 7003) was killed by SIGKILL"
    store.set(f"{PREFIX}/gen/0/verdict", Verdict(clock(), "0", {"3": killed}).encode())
    store.set(f"{PREFIX}/gen/0/news", "dead")  # as the judge does with it
    _until(lambda: news.heard, "the news")
    assert watch.observe([0, 1, 2, 3]) == {3: killed}
    for m in members:
        m.stop()
    assert not news._thread.is_alive() and reader._news is None
