"""EtcdStore (tandem/store/etcd_store.py, Note [a store on etcd]) on real etcd
members started by tests/store/_etcd.py: the same answers as a ``TCPStore`` for
a grid of calls, a gloo group and tandem's membership built on it, a member
killed and then a majority lost (Note [failing over between etcd members]), and
mutual TLS. One single-member cluster serves the module; the kills and TLS get
clusters of their own."""

from __future__ import annotations

import datetime
import functools
import json
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from _etcd import EtcdCluster, cryptography_missing, etcd_missing  # noqa: E402

from tandem.store.etcd_gateway import EtcdCertificateError, EtcdGateway, EtcdUnavailableError  # noqa: E402
from tandem.store import etcd_store  # noqa: E402
from tandem.store.etcd_store import EtcdStore  # noqa: E402
from tandem.control.generation import Decision, ElasticConfig  # noqa: E402
from tandem.control.membership import Membership  # noqa: E402
from tandem.testing import run_distributed  # noqa: E402

pytestmark = pytest.mark.skipif(etcd_missing() is not None, reason=etcd_missing() or "")

TIMEOUT = datetime.timedelta(seconds=1)  # how long a get of a missing key waits, on both stores
EVERY_BYTE = bytes(range(256))


def _bytes(value: bytes) -> str:
    """``value`` as torch's stubs type a store's values (str): a store takes bytes too."""
    return cast(str, value)
ODD_KEYS = ["a/b", "a?b", "???", "/leading/slash", "ünïcødé/✓", "sp ace", "k" * 300]


@pytest.fixture(scope="module")
def cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(1) as c:
        yield c


def _etcd_store(cluster: EtcdCluster, timeout: datetime.timedelta = TIMEOUT) -> EtcdStore:
    return EtcdStore(cluster.endpoints, f"tests/{uuid.uuid4().hex}", timeout, cluster.tls)


def _tcp_store(timeout: datetime.timedelta = TIMEOUT) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)


def raised(call: Callable[[], Any]) -> Any:
    """``call()``'s value, or the type of what it raised."""
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - the type is the answer compared
        return type(e)


# ---------------------------------------------------------------------- (a) the same answers as TCPStore
def test_tcpstore_compare_set_semantics() -> None:
    """What EtcdStore copies, established on torch's own store."""
    s = _tcp_store()
    assert s.compare_set("missing", "", "v") == b"v" and s.get("missing") == b"v"      # missing, expecting "": set
    assert s.compare_set("missing2", "x", "v") == b"x" and not s.check(["missing2"])    # missing, expecting x: x
    s.set("k", "a")
    assert s.compare_set("k", "a", "b") == b"b" and s.get("k") == b"b"                  # matching: set
    assert s.compare_set("k", "z", "c") == b"b" and s.get("k") == b"b"                  # not matching: current
    assert s.compare_set("k", "", "c") == b"b"                                          # present, expecting ""
    s.set("empty", "")
    assert s.compare_set("empty", "", "d") == b"d"                                      # b"" matches ""


def _compare_set_missing_expecting_empty(s: dist.Store) -> list[Any]:
    return [s.compare_set("k", "", "v"), s.get("k")]


def _compare_set_missing_expecting_a_value(s: dist.Store) -> list[Any]:
    return [s.compare_set("k", "x", "v"), s.check(["k"])]


def _compare_set_matching(s: dist.Store) -> list[Any]:
    s.set("k", "a")
    return [s.compare_set("k", "a", "b"), s.get("k"), s.compare_set("k", "b", _bytes(EVERY_BYTE)), s.get("k")]


def _compare_set_not_matching(s: dist.Store) -> list[Any]:
    s.set("k", "a")
    return [s.compare_set("k", "z", "b"), s.compare_set("k", "", "b"), s.get("k")]


def _compare_set_on_an_empty_value(s: dist.Store) -> list[Any]:
    s.set("k", "")
    return [s.compare_set("k", "", "b"), s.get("k"), s.compare_set("k", "b", ""), s.get("k")]


def _add_from_missing(s: dist.Store) -> list[Any]:
    return [s.add("n", 3), s.add("n", -5), s.get("n"), s.add("zero", 0), s.check(["zero"]), s.get("zero")]


def _add_to_a_set_count(s: dist.Store) -> list[Any]:
    s.set("n", "41")
    return [s.add("n", 1), s.get("n")]


def _set_after_adds_restarts_the_count(s: dist.Store) -> list[Any]:
    out = [s.add("n", 1), s.add("n", 1), s.add("n", 4), s.get("n")]
    s.set("n", "10")
    out += [s.get("n"), s.add("n", 1), s.add("n", -3)]
    s.multi_set(["n", "m"], ["0", "1"])  # type: ignore[attr-defined]
    return out + [s.add("n", 1), s.add("m", 1), s.multi_get(["n", "m"])]


def _compare_set_on_a_count(s: dist.Store) -> list[Any]:
    s.add("n", 1)
    s.add("n", 1)
    out = [s.compare_set("n", "3", "x"), s.compare_set("n", "2", "x"), s.get("n"), s.compare_set("n", "x", "7")]
    return out + [s.add("n", 1), s.compare_set("n", "8", ""), s.get("n")]


def _counts_of_keys_that_contain_each_other(s: dist.Store) -> list[Any]:
    keys = ["a", "a/1/x", "a/v/x", "a/", "61"]  # "61" is "a" in hexadecimal
    counts = [s.add(k, i + 1) for i, k in enumerate(keys)] + [s.add(k, 1) for k in keys]
    return counts + [s.multi_get(keys), s.check(keys), s.delete_key("a"), s.check(keys), s.get("a/1/x")]


def _a_deleted_count_starts_again(s: dist.Store) -> list[Any]:
    out = [s.add("n", 1), s.add("n", 2), s.delete_key("n"), s.check(["n"]), s.add("n", 1), s.get("n")]
    return out + [s.delete_key("n"), s.add("n", 0), s.get("n")]


def _every_byte(s: dist.Store) -> list[Any]:
    s.set("b", _bytes(EVERY_BYTE))
    s.set("u", "ünï ✓")
    s.set("e", _bytes(b""))
    return [s.get("b"), s.get("u"), s.get("e"), s.multi_get(["e", "b"])]


def _odd_keys(s: dist.Store) -> list[Any]:
    for i, key in enumerate(ODD_KEYS):
        s.set(key, f"value {i}")
    return [[s.get(k) for k in ODD_KEYS], s.check(ODD_KEYS), s.multi_get(ODD_KEYS), s.check(["a", "a/", "???/"])]


def _check_several(s: dist.Store) -> list[Any]:
    out = [s.check(["a", "b"]), s.check([])]
    s.set("a", "1")
    out += [s.check(["a", "b"]), s.check(["a"])]
    s.set("b", "2")
    return out + [s.check(["a", "b"]), s.check(["b", "a", "a"])]


def _wait_times_out(s: dist.Store) -> list[Any]:
    s.set("there", "1")
    return [raised(lambda: s.wait(["there", "missing"], datetime.timedelta(milliseconds=200))),
            s.wait(["there"]), raised(lambda: s.wait(["missing"], datetime.timedelta(0))), s.wait([])]


def _get_of_a_missing_key_times_out(s: dist.Store) -> list[Any]:
    s.set("a", "1")
    return [raised(lambda: s.get("missing")), raised(lambda: s.multi_get(["a", "missing"]))]


def _multi_set_then_multi_get(s: dist.Store) -> list[Any]:
    s.multi_set(["x", "y/z", "x"], [b"1", EVERY_BYTE, "3"])  # type: ignore[attr-defined]
    return [s.multi_get(["x", "y/z"]), s.multi_get([])]


def _delete_and_count(s: dist.Store) -> list[Any]:
    s.set("a", "1")
    s.set("b/c", "2")
    s.add("n", 1)
    return [s.num_keys(), s.delete_key("a"), s.delete_key("a"), s.check(["a"]), s.num_keys()]


def _timeout_property(s: dist.Store) -> list[Any]:
    before = s.timeout  # type: ignore[attr-defined]
    s.set_timeout(datetime.timedelta(seconds=7))
    return [before, s.timeout]  # type: ignore[attr-defined]


GRID = [_compare_set_missing_expecting_empty, _compare_set_missing_expecting_a_value, _compare_set_matching,
        _compare_set_not_matching, _compare_set_on_an_empty_value, _add_from_missing, _add_to_a_set_count,
        _set_after_adds_restarts_the_count, _compare_set_on_a_count, _counts_of_keys_that_contain_each_other,
        _a_deleted_count_starts_again,
        _every_byte, _odd_keys, _check_several, _wait_times_out, _get_of_a_missing_key_times_out,
        _multi_set_then_multi_get, _delete_and_count, _timeout_property]


@pytest.mark.parametrize("case", GRID, ids=[c.__name__.strip("_") for c in GRID])
def test_the_same_answers_as_tcpstore(cluster: EtcdCluster, case: Callable[[dist.Store], list[Any]]) -> None:
    expected = case(_tcp_store())
    assert case(_etcd_store(cluster)) == expected


def test_a_wait_times_out_as_tcpstores_does(cluster: EtcdCluster) -> None:
    """The type, and the word the membership looks for in a wait slice's end."""
    for store in (_tcp_store(), _etcd_store(cluster)):
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError, match="wait timeout after 300ms"):
            store.wait(["missing"], datetime.timedelta(milliseconds=300))
        assert 0.3 <= time.monotonic() - started < 5.0


def test_adds_of_several_threads_count_each_once(cluster: EtcdCluster) -> None:
    store = _etcd_store(cluster)
    seen: list[int] = []

    def count() -> None:
        seen.extend(store.add("n", 1) for _ in range(10))

    threads = [threading.Thread(target=count) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(seen) == list(range(1, 41)) and store.get("n") == b"40"


def test_adds_at_once_each_take_one_request_and_a_number_of_their_own(
        cluster: EtcdCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [a counter without contention]: 16 threads adding to one key at
    once never retry because of each other (a compare-and-swap would: all but
    one find the key changed), and their numbers are 1..N."""
    store = _etcd_store(cluster)
    real = EtcdGateway.call
    requests: list[str] = []

    def recorded(self: EtcdGateway, path: str, body: dict[str, Any], *args: Any) -> dict[str, Any]:
        requests.append(path)
        return real(self, path, body, *args)

    monkeypatch.setattr(EtcdGateway, "call", recorded)
    start = threading.Barrier(16)
    numbers = _in_threads([lambda: (start.wait(), [store.add("n", 1) for _ in range(5)])[1]] * 16)
    assert sorted(n for ns in numbers for n in ns) == list(range(1, 81))
    assert requests == ["/v3/kv/txn"] * 80


@pytest.mark.parametrize("compacted", [False, True], ids=["history kept", "history compacted"])
def test_an_add_whose_answer_was_lost_is_applied_once(cluster: EtcdCluster, monkeypatch: pytest.MonkeyPatch,
                                                      compacted: bool) -> None:
    """Note [a counter without contention]: etcd applies the first attempt, its
    answer is lost, the gateway sends the same request again, after other adds
    (and, in one case, after the members compacted the revision it was applied
    at): the call returns the count its first attempt made."""
    import tandem.store.etcd_gateway as gateway_module

    store, other = _etcd_store(cluster), None
    store.add("n", 5)
    other = store.clone()
    real = EtcdGateway._post
    lost: list[bytes] = []

    def post_and_lose_the_answer(self: EtcdGateway, i: int, path: str, data: bytes, timeout_s: float) -> Any:
        answer = real(self, i, path, data, timeout_s)
        if path == "/v3/kv/txn" and b"request_put" in data and not lost:
            lost.append(data)
            assert other is not None and other.add("n", 1) == 8 and other.add("n", 1) == 9  # applied after
            if compacted:
                revision = int(real(self, i, "/v3/kv/range", b'{"key": "AA=="}', timeout_s)["header"]["revision"])
                real(self, i, "/v3/kv/compaction", json.dumps({"revision": revision}).encode(), timeout_s)
            raise gateway_module._NoAnswer("the answer was lost")
        return answer

    monkeypatch.setattr(EtcdGateway, "_post", post_and_lose_the_answer)
    assert store.add("n", 2) == 7 and lost
    assert store.get("n") == b"9"


def test_an_add_to_a_key_that_holds_no_count_is_refused_and_changes_nothing(cluster: EtcdCluster) -> None:
    """``TCPStore`` drops the connection (its server fails to parse the value);
    this store says which key holds what, and leaves it as it was."""
    store = _etcd_store(cluster)
    store.set("w", "abc")
    for amount in (1, 3, 0):
        with pytest.raises(ValueError, match=r"add to 'w': it holds b'abc', not a decimal count"):
            store.add("w", amount)
    assert store.get("w") == b"abc" and store.compare_set("w", "abc", "2") == b"2" and store.add("w", 1) == 3


def test_an_add_of_zero_to_a_count_only_reads_it(cluster: EtcdCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [a counter without contention]: reading a count writes nothing (a
    transaction that could write goes through Raft); a missing key is still
    created at 0."""
    store = _etcd_store(cluster)
    store.add("n", 3)
    real = EtcdGateway.call
    bodies: list[str] = []

    def recorded(self: EtcdGateway, path: str, body: dict[str, Any], *args: Any) -> dict[str, Any]:
        bodies.append(json.dumps(body))
        return real(self, path, body, *args)

    monkeypatch.setattr(EtcdGateway, "call", recorded)
    assert store.add("n", 0) == 3
    assert bodies and not any("request_put" in b for b in bodies), bodies
    assert store.add("fresh", 0) == 0 and store.check(["fresh"])


def test_a_wait_reads_a_few_times_then_watches(cluster: EtcdCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [waiting by watching]: five reads, then a watch, which the write
    wakes (its slice is longer than the wait, so nothing else could); a wait
    that nothing ends reads once a slice."""
    store = _etcd_store(cluster)
    real_post, real_watch = EtcdGateway._post, EtcdGateway.watch
    posts: list[float] = []
    watching = threading.Event()

    def counted(self: EtcdGateway, *args: Any) -> Any:
        posts.append(time.monotonic())
        return real_post(self, *args)

    def watch(self: EtcdGateway, *args: Any) -> bool:
        watching.set()
        return real_watch(self, *args)

    monkeypatch.setattr(EtcdGateway, "_post", counted)
    monkeypatch.setattr(EtcdGateway, "watch", watch)
    monkeypatch.setattr(etcd_store, "_WATCH_SLICE_S", 600.0)
    writer = EtcdStore(cluster.endpoints, store.prefix, datetime.timedelta(seconds=10), cluster.tls)

    def write_once_watched() -> None:
        assert watching.wait(timeout=20)
        writer.set("late", "here")

    thread = threading.Thread(target=write_once_watched)
    thread.start()
    try:
        store.wait(["late"], datetime.timedelta(seconds=20))
    finally:
        thread.join()
    assert len(posts) <= 8, len(posts)   # 5 reads, the watch, the read after it (and the writer's set)
    posts.clear()
    monkeypatch.setattr(etcd_store, "_WATCH_SLICE_S", 0.5)
    with pytest.raises(dist.DistStoreError):
        store.wait(["missing"], datetime.timedelta(seconds=1))
    assert 2 <= len(posts) <= 9, len(posts)


# ---------------------------------------------------------------------- (b) a gloo group
def _all_reduce_over_etcd(rank: int, world_size: int, endpoints: list[str], prefix: str) -> list[float]:
    store = EtcdStore(endpoints, prefix, datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    return t.tolist()


def test_a_gloo_group_bootstraps_on_etcd(cluster: EtcdCluster) -> None:
    results = run_distributed(_all_reduce_over_etcd, 2, init_process_group=False, timeout=90,
                              args=(cluster.endpoints, f"tests/{uuid.uuid4().hex}"))
    assert results == [[3.0] * 4, [3.0] * 4]


# ---------------------------------------------------------------------- (c) tandem's membership
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _in_threads(calls: list[Callable[[], Any]], timeout_s: float = 30.0) -> list[Any]:
    out: dict[int, Any] = {}

    def run(i: int) -> None:
        out[i] = raised(calls[i])

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert len(out) == len(calls), f"{len(calls) - len(out)} of {len(calls)} calls did not return in {timeout_s} s"
    return [out[i] for i in range(len(calls))]


def test_membership_on_etcd_commits_then_aborts_when_a_member_stops(cluster: EtcdCluster) -> None:
    config = ElasticConfig(beat_s=0.05, stale_after_s=1.0, regroup_timeout_s=20.0)
    clock = Clock()
    store = _etcd_store(cluster, datetime.timedelta(seconds=20))
    members = _in_threads([functools.partial(Membership.founding, store, r, 3, config, clock=clock) for r in range(3)])
    assert all(isinstance(m, Membership) for m in members), members
    try:
        assert _in_threads([functools.partial(m.decide_step, 0) for m in members]) == [Decision.COMMIT] * 3
        members[2].stop()  # its beat stays at 1000
        clock.now += 2 * config.stale_after_s
        members[0]._beat()
        members[1]._beat()
        assert _in_threads([functools.partial(m.decide_step, 1) for m in members[:2]]) == [Decision.ABORT] * 2
    finally:
        for m in members:
            m.stop()


# ---------------------------------------------------------------------- (d) a member killed, then a majority lost
def _leader(cluster: EtcdCluster) -> int:
    for i, endpoint in enumerate(cluster.endpoints):
        request = urllib.request.Request(f"http://{endpoint}/v3/maintenance/status", data=b"{}")
        try:
            with urllib.request.urlopen(request, timeout=2) as answer:
                status = json.loads(answer.read())
        except OSError:
            continue
        if status["header"]["member_id"] == status["leader"]:
            return i
    raise AssertionError("no member says it leads")


def test_a_killed_member_is_failed_over_and_a_lost_majority_is_said() -> None:
    with EtcdCluster(3) as cluster:
        first = _leader(cluster)  # the store talks to the leader: its loss is the slow one (an election)
        order = [first] + [i for i in range(3) if i != first]
        store = EtcdStore([cluster.endpoints[i] for i in order], "tests/kill", datetime.timedelta(seconds=15))
        store._gateway._preferred = 0   # it would start at a member drawn at random: here, at the leader
        store.set("k", "before")
        assert store.add("n", 1) == 1
        cluster.kill(order[0])
        started = time.monotonic()
        store.set("k", "after")
        assert store.get("k") == b"after" and store.add("n", 1) == 2
        assert time.monotonic() - started < 8.0

        store.set_timeout(datetime.timedelta(seconds=3))
        cluster.kill(order[1])
        started = time.monotonic()
        with pytest.raises(EtcdUnavailableError, match="lost its majority or is unreachable") as lost:
            store.set("k", "no majority")
        assert time.monotonic() - started < 3.0 + 4.0  # the timeout, one member's last try, a loaded host
        assert all(endpoint in str(lost.value) for endpoint in cluster.endpoints)


# ---------------------------------------------------------------------- (e) mutual TLS
@pytest.mark.skipif(cryptography_missing() is not None, reason=cryptography_missing() or "")
def test_tls_with_the_cluster_s_certificate_works_and_another_ca_s_is_refused_at_once() -> None:
    with EtcdCluster(1, tls=True) as cluster:
        store = _etcd_store(cluster, datetime.timedelta(seconds=10))
        store.set("k", EVERY_BYTE)
        assert store.get("k") == EVERY_BYTE and store.compare_set("c", "", "x") == b"x"

        stranger = EtcdStore(cluster.endpoints, "tests/tls", datetime.timedelta(seconds=30), cluster.foreign_tls())
        started = time.monotonic()
        with pytest.raises(EtcdCertificateError, match="the etcd cluster refused this node's certificate") as refused:
            stranger.get("k")
        assert time.monotonic() - started < 5.0  # at once, not after the store's 30 s
        assert cluster.endpoints[0] in str(refused.value) and "cluster's CA" in str(refused.value)
