"""A c10d store kept by an etcd cluster, so that the job's control plane
survives the loss of any one machine: :class:`EtcdStore`.

# Note [a store on etcd]
A ``TCPStore`` lives in one process: when its host goes, every key of the job
goes with it, and an elastic job cannot regroup. An etcd cluster of three (or
five) members keeps every key on each and answers while a majority runs, so a
job whose store is etcd loses its control plane only with two machines of
three. :class:`EtcdStore` is a ``torch.distributed.Store`` (what
``init_process_group(store=...)`` and tandem's membership take) over etcd's v3
API, reached through the JSON gateway every member serves on its client port
(``POST /v3/kv/...``): the standard library is enough, and the v3 API is the
one etcd keeps (3.6 removed the v2 API that torch's own ``EtcdStore`` uses).

Each store key ``k`` is the etcd key ``<prefix>/kv/<k>`` as bytes, so any key
(``/``, ``?``, unicode) and any value round-trip exactly, and a range over
``<prefix>/kv/`` counts the keys. The operations keep ``TCPStore``'s meaning,
which tests/store/test_etcd_store.py checks against a real ``TCPStore``:

* ``get``, ``multi_get`` and ``wait`` wait for missing keys, up to the store's
  timeout (``wait``: its own), then raise ``DistStoreError`` ("wait timeout
  ..."), as ``TCPStore`` does; ``check`` looks once;
* ``compare_set(key, expected, desired)`` writes ``desired`` and returns it when
  the key holds ``expected``, or is missing and ``expected`` is empty; else it
  writes nothing and returns the value the key holds, or ``expected`` itself
  when the key is missing (``TCPStore``'s answer, which cannot tell a missing
  key from a match); a key that holds ``b""`` matches an empty ``expected``;
* ``add`` counts from 0 for a missing key and stores the count as decimal text.

Two calls are the Python class's alone: torch's trampoline for stores written
in Python does not forward ``delete_key`` and ``num_keys``, so a
``PrefixStore`` over an ``EtcdStore`` raises on them ("pure virtual function").
A value is limited by the members' ``--max-request-bytes`` (1.5 MiB by default).

Every read is linearizable (etcd's default): it sees every write that finished
before it, on whichever member it lands, and a member cut off from the
majority answers nothing rather than an old value. Several keys are read (or
written) in one transaction: one round trip, one consistent view. Every request
may be retried, on this member and the others, for up to the store's timeout
(Note [failing over between etcd members] in etcd_gateway.py); ``wait``'s
timeout bounds only how long it waits for keys while the cluster answers.

The cluster's members should compact their history
(``--auto-compaction-mode=revision --auto-compaction-retention=1000``): every
write is a revision, and beats write several times a second.

# Note [an add applied once]
A request sent again after its member failed to answer may have been applied
already. For ``set``, ``multi_set`` and ``compare_set`` that is harmless (the
second ``compare_set`` finds the value the first wrote and returns it). An
``add`` applied twice would count twice, and the membership's step counter
would then commit a step before every member finished it. So each ``add`` is
one transaction that writes the new count only if the key is as last read and
the call's *receipt* (``<prefix>/add/<random id>``) does not exist, and writes
the receipt with the count: a retry of an applied ``add`` finds its receipt
and returns the count the first attempt made. Receipts live on a lease (about
three store timeouts, renewed well before a call could outlive it), and the
next ``add`` deletes those of calls that returned, so few exist at any time.

# Note [adds that collide]
etcd has no counter: an ``add`` reads the count and writes the next one if
nobody wrote in between (a transaction that compares the key's revision). When
many processes add to one key at once (every member arriving at a roll call,
Note [a roll call] in tandem/control/membership.py), all but one find the key changed and try
again, and if each tried again at once, N of them would make N² transactions.
So a collision is followed by a pause drawn at random from a range that
doubles with each collision (2 ms, 4 ms, ... up to 0.2 s): the tries spread
out, and N adds cost about N log N transactions. An ``add`` of 0 to a key that exists (how a roll
call's judges read its count, twenty times a second) only reads: as a write it
would collide with every arrival under way, and the arrivals would starve.

# Note [waiting by watching]
``wait``, ``get`` and ``multi_get`` read their keys, and when one is missing
read again 10, 15, 22 and 34 ms later: most waits of a job (a step's decision,
a barrier's last arrival) end within those 80 ms. Past them, the waiter
watches the first missing key from the revision its last read saw (etcd's
watch API, a streaming ``POST /v3/watch`` on a connection of its own to the
member that answered last): the member pushes the write when it comes, so a
long wait costs the cluster nothing while it lasts, where polling ten times a
second would cost each waiter ten reads a second at the leader (BENCHMARKS.md,
the control plane on etcd). When the event comes, or after
:data:`_WATCH_SLICE_S`, or when the member fails, the waiter reads every key
again (failing over as every request does) and watches the next missing one:
a watch is only the signal to read, so a lost event or a dead member delays a
waiter by one slice at most, and never makes it return a key that is not
there.
"""

from __future__ import annotations

import base64
import datetime
import random
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, cast

import torch.distributed as dist

from tandem.store.etcd_gateway import EtcdGateway, EtcdRequestError, EtcdTLS

__all__ = ["EtcdStore"]

_TXN_OPS = 64          # operations in one transaction (etcd's --max-txn-ops is 128 by default)
_POLL_FIRST_S = 0.01   # Note [waiting by watching]
_POLL_MAX_S = 0.1
_POLLS = 4             # reads 10, 15, 22 and 34 ms apart (80 ms in all), then a watch
_WATCH_SLICE_S = 5.0   # the longest one watch lasts before the keys are read again
_SPENT_AT_ONCE = 8     # receipts an add deletes (Note [an add applied once])
_COLLIDE_FIRST_S = 0.002  # Note [adds that collide]
_COLLIDE_MAX_S = 0.2
_LEASE_MARGIN_S = 60.0


def _bytes(value: str | bytes | bytearray | memoryview) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _after(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])  # the prefixes here end in b"/"


def _range(key: bytes, count_only: bool = False) -> dict[str, Any]:
    return {"request_range": {"key": _b64(key), **({"count_only": True} if count_only else {})}}


def _put(key: bytes, value: bytes, lease: str | None = None) -> dict[str, Any]:
    return {"request_put": {"key": _b64(key), "value": _b64(value), **({"lease": lease} if lease else {})}}


def _delete(key: bytes) -> dict[str, Any]:
    return {"request_delete_range": {"key": _b64(key)}}


def _missing(key: bytes) -> dict[str, Any]:
    return {"key": _b64(key), "target": "VERSION", "result": "EQUAL", "version": 0}


def _holds(key: bytes, value: bytes) -> dict[str, Any]:
    return {"key": _b64(key), "target": "VALUE", "result": "EQUAL", "value": _b64(value)}


def _unchanged(key: bytes, mod_revision: int) -> dict[str, Any]:
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision}


class _KV:
    """One key as a range read it: its value and the revision that last wrote it."""

    def __init__(self, kv: dict[str, Any]) -> None:
        self.value = base64.b64decode(kv.get("value", ""))  # the gateway leaves out empty fields
        self.mod_revision = int(kv["mod_revision"])


def _ranged(response: dict[str, Any]) -> _KV | None:
    kvs = response.get("response_range", {}).get("kvs")
    return _KV(kvs[0]) if kvs else None


def _counted(response: dict[str, Any]) -> bool:
    return int(response.get("response_range", {}).get("count", 0)) > 0


class _Receipts:
    """The receipts of one store's ``add`` calls (Note [an add applied once]):
    their lease, and those of calls that returned, to delete."""

    def __init__(self, base: bytes) -> None:
        self._base = base
        self._lock = threading.Lock()
        self._lease: str | None = None
        self._lease_ends = 0.0
        self._spent: list[bytes] = []

    def new(self) -> bytes:
        return self._base + uuid.uuid4().hex.encode()

    def lease(self, gateway: EtcdGateway, timeout_s: float, deadline: float, what: str) -> str:
        """A lease that outlives a call started now by the store's timeout and a margin."""
        with self._lock:
            if self._lease is not None and self._lease_ends - time.monotonic() > timeout_s + _LEASE_MARGIN_S:
                return self._lease
        ttl = int(3 * timeout_s + 2 * _LEASE_MARGIN_S)
        granted = time.monotonic()
        answer = gateway.call("/v3/lease/grant", {"TTL": ttl}, deadline, what)
        with self._lock:
            self._lease, self._lease_ends = str(answer["ID"]), granted + int(answer.get("TTL", ttl))
            return self._lease

    def forget(self, lease: str) -> None:
        with self._lock:
            if self._lease == lease:
                self._lease = None

    def spend(self, receipt: bytes) -> None:
        with self._lock:
            if len(self._spent) < 4 * _SPENT_AT_ONCE:  # beyond that, the lease removes them
                self._spent.append(receipt)

    def to_delete(self) -> list[bytes]:
        """A few receipts of calls that returned (kept until :meth:`deleted` says they are gone)."""
        with self._lock:
            return self._spent[:_SPENT_AT_ONCE]

    def deleted(self, receipts: list[bytes]) -> None:
        with self._lock:
            self._spent = [r for r in self._spent if r not in receipts]


class EtcdStore(dist.Store):
    """A ``torch.distributed.Store`` kept by an etcd cluster (Note [a store on
    etcd]): every key lives under ``prefix``, on every member.

    Example::

        store = EtcdStore(["10.0.0.1:2379", "10.0.0.2:2379", "10.0.0.3:2379"], "jobs/run-42",
                          timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)

    Args:
        endpoints: the members' client addresses, ``host:port`` (no scheme).
        prefix: the key prefix of this job (say ``jobs/<run id>``); stores with
            the same prefix on the same cluster share their keys.
        timeout: how long ``get``, ``multi_get`` and ``wait`` wait for a key, and
            how long any request is retried while no member answers.
        tls: this node's certificate, key and the cluster's CA, for members that
            require client certificates; None for plain HTTP.

    Raises:
        ValueError: no endpoint, a malformed one, or a TLS file that does not exist.

    Every call may raise :class:`~tandem.store.etcd_gateway.EtcdUnavailableError`
    (no member answered within the store's timeout: the cluster lost its
    majority, or this node does not reach it) and
    :class:`~tandem.store.etcd_gateway.EtcdCertificateError` (a member refused
    this node's certificate).

    .. warning::
        A read that finds a key missing is retried for the whole timeout, as
        with ``TCPStore``: use ``check`` to look without waiting.
    """

    def __init__(self, endpoints: Sequence[str], prefix: str,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=300), tls: EtcdTLS | None = None) -> None:
        super().__init__()  # the pybind trampoline needs it
        self.set_timeout(timeout)
        self.prefix = prefix
        self._gateway = EtcdGateway(endpoints, tls)
        base = prefix.rstrip("/").encode() + b"/"
        self._kv = base + b"kv/"
        self._receipts = _Receipts(base + b"add/")

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The members' client addresses."""
        return self._gateway.endpoints

    @property
    def tls(self) -> EtcdTLS | None:
        """This node's TLS identity, if any."""
        return self._gateway.tls

    def __repr__(self) -> str:
        return f"EtcdStore({list(self.endpoints)!r}, {self.prefix!r})"

    # ------------------------------------------------------------------ writes
    def set(self, key: str, value: str | bytes) -> None:
        self._call("/v3/kv/put", _put(self._key(key), _bytes(value))["request_put"], f"set {key!r}")

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys and {len(values)} values")
        last = {self._key(k): _bytes(v) for k, v in zip(keys, values)}  # etcd refuses a key twice in one txn
        puts = [_put(k, v) for k, v in last.items()]
        for start in range(0, len(puts), _TXN_OPS):
            self._txn([], puts[start:start + _TXN_OPS], [], f"multi_set of {len(keys)} keys")

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the count under ``key`` (0 when missing) and return
        the new count, applied exactly once (Note [an add applied once]).

        Raises:
            ValueError: the key holds something other than a decimal integer.
        """
        k, what = self._key(key), f"add to {key!r}"
        deadline = self._deadline()
        if int(amount) == 0:  # a read of the count: a write would make the adds under way collide with it
            held = self._read_kvs([key], deadline)[0]
            if held is not None:
                return self._count(key, held)
        receipt = self._receipts.new()
        current: _KV | None = None  # first guess: the key is new
        collisions = 0
        while True:
            count = (self._count(key, current) if current is not None else 0) + int(amount)
            lease = self._receipts.lease(self._gateway, self._timeout_s(), deadline, what)
            compare = [_missing(k) if current is None else _unchanged(k, current.mod_revision), _missing(receipt)]
            spent = self._receipts.to_delete()
            success = [_put(k, str(count).encode()), _put(receipt, str(count).encode(), lease)]
            success += [_delete(r) for r in spent]
            try:
                answer = self._txn(compare, success, [_range(k), _range(receipt)], what, deadline)
            except EtcdRequestError as e:
                if "lease not found" not in str(e) or time.monotonic() > deadline:
                    raise
                self._receipts.forget(lease)  # it expired while this process was stopped: a new one
                continue
            if answer.get("succeeded"):
                self._receipts.deleted(spent)
                self._receipts.spend(receipt)
                return count
            now, earlier = (_ranged(r) for r in answer["responses"])
            if earlier is not None:  # a retry of this call, which an earlier attempt applied
                self._receipts.spend(receipt)
                return int(earlier.value)
            current = now
            # Another add came first (Note [adds that collide]): try again after a pause drawn from a range
            # that doubles with each collision.
            collisions += 1
            time.sleep(random.uniform(0, min(_COLLIDE_MAX_S, _COLLIDE_FIRST_S * 2 ** collisions)))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """``TCPStore``'s compare-and-set (Note [a store on etcd]): returns
        ``desired`` when it was written, else the value the key holds, or
        ``expected`` when the key is missing."""
        k, expected_raw, desired_raw = self._key(key), _bytes(expected), _bytes(desired)
        what = f"compare_set {key!r}"
        deadline = self._deadline()
        compare = _holds(k, expected_raw) if expected_raw else _missing(k)
        while True:
            answer = self._txn([compare], [_put(k, desired_raw)], [_range(k)], what, deadline)
            if answer.get("succeeded"):
                return desired_raw
            now = _ranged(answer["responses"][0])
            if now is None:
                if expected_raw:
                    return expected_raw
                compare = _missing(k)  # deleted since the compare: try again
            elif now.value != expected_raw:
                return now.value
            else:  # it holds exactly the expected value (b"" when an empty one is expected)
                compare = _unchanged(k, now.mod_revision)

    def delete_key(self, key: str) -> bool:
        answer = self._call("/v3/kv/deleterange", {"key": _b64(self._key(key))}, f"delete_key {key!r}")
        return int(answer.get("deleted", 0)) > 0

    # ------------------------------------------------------------------ reads
    def get(self, key: str) -> bytes:
        """The value under ``key``, waiting for it up to the store's timeout.

        Raises:
            torch.distributed.DistStoreError: the key did not appear in time.
        """
        return self.multi_get([key])[0]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values under ``keys``, read at once, waiting for the missing ones
        up to the store's timeout.

        Raises:
            torch.distributed.DistStoreError: a key did not appear in time.
        """
        return self._wait_for(keys, self._timeout(), values=True)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key of ``keys`` exists now (no waiting)."""
        return all(found is not None for found in self._read(keys, False, self._deadline()))

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        """Wait until every key of ``keys`` exists, up to ``timeout`` (default:
        the store's), reading, then watching (Note [waiting by watching]).

        Raises:
            torch.distributed.DistStoreError: a key did not appear in time.
        """
        self._wait_for(keys, self._timeout() if timeout is None else timeout, values=False)

    def num_keys(self) -> int:
        body = {"key": _b64(self._kv), "range_end": _b64(_after(self._kv)), "count_only": True}
        return int(self._call("/v3/kv/range", body, "num_keys").get("count", 0))

    # ------------------------------------------------------------------ the rest of the interface
    def clone(self) -> EtcdStore:
        """Another client of the same keys, with connections of its own."""
        return EtcdStore(self.endpoints, self.prefix, self._timeout(), self.tls)

    def close(self) -> None:
        """Close the connections to the members (a later call opens new ones)."""
        self._gateway.close()

    # ------------------------------------------------------------------ helpers
    def _key(self, key: str | bytes) -> bytes:
        return self._kv + _bytes(key)

    def _timeout(self) -> datetime.timedelta:
        return cast(datetime.timedelta, cast(Any, self).timeout)  # the base's property: torch's stubs omit it

    def _timeout_s(self) -> float:
        return self._timeout().total_seconds()

    def _deadline(self) -> float:
        return time.monotonic() + self._timeout_s()

    def _call(self, path: str, body: dict[str, Any], what: str, deadline: float | None = None) -> dict[str, Any]:
        return self._gateway.call(path, body, self._deadline() if deadline is None else deadline, what)

    def _txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]], failure: list[dict[str, Any]],
             what: str, deadline: float | None = None) -> dict[str, Any]:
        return self._call("/v3/kv/txn", {"compare": compare, "success": success, "failure": failure}, what, deadline)

    def _read_kvs(self, keys: Sequence[str], deadline: float) -> list[_KV | None]:
        """Each key's value and revision; None when missing."""
        answer = self._txn([], [_range(self._key(k)) for k in keys], [], f"read of {len(keys)} keys", deadline)
        return [_ranged(response) for response in answer.get("responses", [])]

    def _read(self, keys: Sequence[str], values: bool, deadline: float) -> list[bytes | None]:
        """Each key's value (``values``) or ``b""`` when it exists; None when missing."""
        return self._read_at(keys, values, deadline)[0]

    def _read_at(self, keys: Sequence[str], values: bool, deadline: float) -> tuple[list[bytes | None], int]:
        """:meth:`_read`, and the store's revision it saw (the oldest, over several transactions)."""
        out: list[bytes | None] = []
        revision = 0
        for start in range(0, len(keys), _TXN_OPS):
            chunk = keys[start:start + _TXN_OPS]
            ranges = [_range(self._key(k), count_only=not values) for k in chunk]
            answer = self._txn([], ranges, [], f"read of {len(keys)} keys", deadline)
            seen = int(answer.get("header", {}).get("revision", 0))
            revision = seen if revision == 0 else min(revision, seen)
            for response in answer.get("responses", []):
                if values:
                    kv = _ranged(response)
                    out.append(None if kv is None else kv.value)
                else:
                    out.append(b"" if _counted(response) else None)
        return out, revision

    def _wait_for(self, keys: Sequence[str], timeout: datetime.timedelta, values: bool) -> list[bytes]:
        started = time.monotonic()
        ends = started + timeout.total_seconds()
        pause = _POLL_FIRST_S
        polls = 0
        while True:
            found, revision = self._read_at(keys, values, self._deadline())
            if all(v is not None for v in found):
                return [v for v in found if v is not None]
            left = ends - time.monotonic()
            if left <= 0:
                missing = ", ".join(k for k, v in zip(keys, found) if v is None)
                raise dist.DistStoreError(
                    f"wait timeout after {round(timeout.total_seconds() * 1000)}ms, keys: {missing} (in the etcd "
                    f"store under {self.prefix!r} at {', '.join(self.endpoints)})")
            if polls < _POLLS or revision == 0:  # Note [waiting by watching]
                time.sleep(min(pause, left))
                pause = min(1.5 * pause, _POLL_MAX_S)
                polls += 1
                continue
            first = next(k for k, v in zip(keys, found) if v is None)
            self._gateway.watch(self._key(first), revision + 1, time.monotonic() + min(left, _WATCH_SLICE_S))

    def _count(self, key: str, kv: _KV) -> int:
        try:
            return int(kv.value)
        except ValueError:
            raise ValueError(f"add to {key!r}: it holds {kv.value[:40]!r}, not a decimal count; a key that "
                             "add counts in must be written by add alone") from None
