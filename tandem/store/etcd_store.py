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

# Note [a counter without contention]
etcd has no increment. Counting with one key would make an ``add`` a
compare-and-swap: when every member of a job adds to one key at once (a
step's commit, each arrival at a roll call, Note [a roll call] in
tandem/control/roll_call.py), all but one find the key changed and try
again, one after the other through Raft, so each ``add`` waits longer the
more members there are. So a count is kept as keys, one per ``add``, and
nothing is compared:

* store key ``k``'s count lives in ``<prefix>/kv/<k>`` (its *base*: ``0`` when
  an ``add`` created it, or what ``set`` wrote) and in one key per ``add``
  under ``<prefix>/n/<hex of k>/``: ``1/<id>`` for an add of one (counted,
  not read), ``v/<id>`` holding any other amount. The count is the base plus
  those. ``k`` in hexadecimal keeps one count's keys apart from another's
  (store keys may hold ``/``).
* An ``add`` is one transaction: put its key, create the base if missing, and
  read the base and the count. A transaction's reads see its own writes and
  no later one, so the count it returns is the count at its revision: every
  ``add`` of a key gets a number of its own, and the numbers of adds of one
  run 1, 2, 3, ... in the order etcd applied them, as ``TCPStore``'s do.
* An ``add`` of 0 to a key that exists (how a roll call's judges read its
  count) only reads.
* ``get`` and ``multi_get`` read a key's count keys with its base, in the same
  transaction; ``set``, ``multi_set`` and a ``compare_set`` that writes delete
  them with the write (the written value is the new base, as in ``TCPStore``),
  and ``delete_key`` deletes them with the base. ``check`` and ``wait`` look
  at the base alone: the first ``add`` creates it.

An ``add`` sent again after its member failed to answer may have been
applied already; its key (a random id drawn once per call) is put only if it
is missing, so a retry of an applied ``add`` writes nothing, finds its key,
and returns the count at the revision that created it.

A count's keys stay until ``set`` or ``delete_key`` removes them, like the
keys of every step a job's membership counts: a job long enough to fill the
members' quota (2 GiB by default) should delete what it no longer reads.

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


def _bytes(value: str | bytes | bytearray | memoryview) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _after(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])  # the prefixes here end in b"/"


def _range(key: bytes, *, prefix: bool = False, count_only: bool = False, keys_only: bool = False,
           revision: int = 0, max_create_revision: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"key": _b64(key)}
    if prefix:
        body["range_end"] = _b64(_after(key))
    for name, value in (("count_only", count_only), ("keys_only", keys_only), ("revision", revision),
                        ("max_create_revision", max_create_revision)):
        if value:
            body[name] = value
    return {"request_range": body}


def _put(key: bytes, value: bytes) -> dict[str, Any]:
    return {"request_put": {"key": _b64(key), "value": _b64(value)}}


def _delete(key: bytes, prefix: bool = False) -> dict[str, Any]:
    return {"request_delete_range": {"key": _b64(key), **({"range_end": _b64(_after(key))} if prefix else {})}}


def _missing(key: bytes) -> dict[str, Any]:
    return {"key": _b64(key), "target": "VERSION", "result": "EQUAL", "version": 0}


def _none_under(prefix: bytes) -> dict[str, Any]:
    """Holds while no key starts with ``prefix`` (a compare over a range holds when each key's does)."""
    return {**_missing(prefix), "range_end": _b64(_after(prefix))}


def _none_written_under_since(prefix: bytes, revision: int) -> dict[str, Any]:
    return {"key": _b64(prefix), "range_end": _b64(_after(prefix)), "target": "MOD", "result": "LESS",
            "mod_revision": revision + 1}


def _holds(key: bytes, value: bytes) -> dict[str, Any]:
    return {"key": _b64(key), "target": "VALUE", "result": "EQUAL", "value": _b64(value)}


def _unchanged(key: bytes, mod_revision: int) -> dict[str, Any]:
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision}


class _KV:
    """One key as a range read it: its value and the revisions that created and last wrote it."""

    def __init__(self, kv: dict[str, Any]) -> None:
        self.value = base64.b64decode(kv.get("value", ""))  # the gateway leaves out empty fields
        self.mod_revision = int(kv.get("mod_revision", 0))
        self.create_revision = int(kv.get("create_revision", 0))


def _kvs(response: dict[str, Any]) -> list[_KV]:
    return [_KV(kv) for kv in response.get("response_range", {}).get("kvs", [])]


def _ranged(response: dict[str, Any]) -> _KV | None:
    kvs = _kvs(response)
    return kvs[0] if kvs else None


def _counted(response: dict[str, Any]) -> int:
    return int(response.get("response_range", {}).get("count", 0))


def _revision(answer: dict[str, Any]) -> int:
    return int(answer.get("header", {}).get("revision", 0))


class _Count:
    """The etcd keys of one store key (Note [a counter without contention]):
    its base, and under ``adds`` one key per ``add`` (``ones`` of one,
    ``others`` of any other amount)."""

    def __init__(self, base: bytes, adds: bytes) -> None:
        self.base = base
        self.adds = adds
        self.ones = adds + b"1/"
        self.others = adds + b"v/"

    def glance(self) -> list[dict[str, Any]]:
        """The base, and how many adds there are (two operations: what a read of a value needs first)."""
        return [_range(self.base), _range(self.adds, prefix=True, count_only=True)]

    def reads(self, revision: int = 0) -> list[dict[str, Any]]:
        """The base, the number of adds of one and the other adds, at ``revision`` (0: now)."""
        return [_range(self.base, revision=revision),
                _range(self.ones, prefix=True, count_only=True, revision=revision),
                _range(self.others, prefix=True, revision=revision)]

    @staticmethod
    def value(responses: list[dict[str, Any]]) -> tuple[_KV | None, bytes | None]:
        """The base and the value a read of the key answers, from :meth:`reads`' responses; None when missing."""
        return _Count.total(_ranged(responses[0]), _counted(responses[1]), _kvs(responses[2]))

    @staticmethod
    def total(base: _KV | None, ones: int, others: list[_KV]) -> tuple[_KV | None, bytes | None]:
        if base is None:
            return None, None
        if not ones and not others:
            return base, base.value
        try:
            return base, str(int(base.value) + ones + sum(int(kv.value) for kv in others)).encode()
        except ValueError:  # not a count: the add that put a key here is about to delete it and say why
            return base, base.value


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
        self._adds = base + b"n/"

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
        self.multi_set([key], [value])

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys and {len(values)} values")
        last = {k: _bytes(v) for k, v in zip(keys, values)}  # etcd refuses a key twice in one txn
        writes: list[dict[str, Any]] = []
        for k, v in last.items():  # the value written is the new base: a count's adds go with the old one
            count = self._count(k)
            writes += [_put(count.base, v), _delete(count.adds, prefix=True)]
        what = f"set {keys[0]!r}" if len(keys) == 1 else f"multi_set of {len(keys)} keys"
        for start in range(0, len(writes), _TXN_OPS):
            self._txn([], writes[start:start + _TXN_OPS], [], what)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the count under ``key`` (0 when missing) and return
        the new count: one transaction, applied once however often it is sent,
        and never retried because of another ``add`` (Note [a counter without
        contention]).

        Raises:
            ValueError: the key holds something other than a decimal integer.
        """
        count, what, amount = self._count(key), f"add to {key!r}", int(amount)
        deadline = self._deadline()
        if amount == 0:  # a read of the count (a transaction that could write goes through Raft) ...
            value = _Count.value(self._txn([], count.reads(), [], what, deadline)["responses"])[1]
            if value is None:  # ... and a missing key created at 0
                answer = self._txn([_missing(count.base)], [_put(count.base, b"0")], count.reads(), what, deadline)
                value = b"0" if answer.get("succeeded") else _Count.value(answer["responses"])[1]
            return self._decimal(key, value)
        mine = (count.ones if amount == 1 else count.others) + uuid.uuid4().hex.encode()
        create_base = {"request_txn": {"compare": [_missing(count.base)], "success": [_put(count.base, b"0")]}}
        answer = self._txn([_missing(mine)], [_put(mine, b"" if amount == 1 else str(amount).encode()),
                                              create_base, *count.reads()],
                           [_range(mine)], what, deadline)
        if answer.get("succeeded"):
            value = _Count.value(answer["responses"][2:])[1]
        else:  # a retry of this call, which an earlier attempt applied: the count when that attempt was
            created = _ranged(answer["responses"][0])
            assert created is not None  # the compare failed: the key is there
            value = self._count_at(count, created.create_revision, what, deadline)
        try:
            return self._decimal(key, value)
        except ValueError:
            self._txn([], [_delete(mine)], [], what, deadline)  # the key holds no count: leave it as it was
            raise

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """``TCPStore``'s compare-and-set (Note [a store on etcd]): returns
        ``desired`` when it was written, else the value the key holds, or
        ``expected`` when the key is missing."""
        count, expected_raw, desired_raw = self._count(key), _bytes(expected), _bytes(desired)
        what = f"compare_set {key!r}"
        deadline = self._deadline()
        compare = [_holds(count.base, expected_raw) if expected_raw else _missing(count.base),
                   _none_under(count.adds)]
        write = [_put(count.base, desired_raw)]
        while True:
            answer = self._txn(compare, write, count.reads(), what, deadline)
            if answer.get("succeeded"):
                return desired_raw
            base, value = _Count.value(answer["responses"])
            if base is None:
                if expected_raw:
                    return expected_raw
                compare = [_missing(count.base), _none_under(count.adds)]  # deleted since the compare: again
                write = [_put(count.base, desired_raw)]
            elif value != expected_raw:
                assert value is not None
                return value
            else:  # it holds exactly the expected value: a count, or b"" when an empty one is expected
                compare = [_unchanged(count.base, base.mod_revision),
                           _none_written_under_since(count.adds, _revision(answer))]
                write = [_put(count.base, desired_raw), _delete(count.adds, prefix=True)]

    def delete_key(self, key: str) -> bool:
        count = self._count(key)
        answer = self._txn([], [_delete(count.base), _delete(count.adds, prefix=True)], [], f"delete_key {key!r}")
        return int(answer["responses"][0].get("response_delete_range", {}).get("deleted", 0)) > 0

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

    def _read(self, keys: Sequence[str], values: bool, deadline: float) -> list[bytes | None]:
        """Each key's value (``values``) or ``b""`` when it exists; None when missing."""
        return self._read_at(keys, values, deadline)[0]

    def _read_at(self, keys: Sequence[str], values: bool, deadline: float) -> tuple[list[bytes | None], int]:
        """:meth:`_read`, and the store's revision it saw (the oldest, over several transactions). Whether a
        key exists is read from its base; a value with the number of the key's adds, and where it has any,
        read again with its count (Note [a counter without contention]): a count read later is as valid
        an answer as one read at once."""
        out: list[bytes | None] = []
        revision = 0
        per_key = 2 if values else 1
        step = _TXN_OPS // per_key
        for start in range(0, len(keys), step):
            chunk = [self._count(k) for k in keys[start:start + step]]
            reads = ([op for count in chunk for op in count.glance()] if values else
                     [_range(count.base, count_only=True) for count in chunk])
            answer = self._txn([], reads, [], f"read of {len(keys)} keys", deadline)
            seen = _revision(answer)
            revision = seen if revision == 0 else min(revision, seen)
            responses = answer.get("responses", [])
            for i, count in enumerate(chunk):
                if not values:
                    out.append(b"" if _counted(responses[i]) else None)
                    continue
                base = _ranged(responses[2 * i])
                if base is not None and _counted(responses[2 * i + 1]):
                    counted = self._txn([], count.reads(), [], f"read of {len(keys)} keys", deadline)
                    out.append(_Count.value(counted["responses"])[1])
                else:
                    out.append(None if base is None else base.value)
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
            self._gateway.watch(self._count(first).base, revision + 1, time.monotonic() + min(left, _WATCH_SLICE_S))

    def _count(self, key: str) -> _Count:
        return _Count(self._kv + _bytes(key), self._adds + _bytes(key).hex().encode() + b"/")

    def _count_at(self, count: _Count, revision: int, what: str, deadline: float) -> bytes | None:
        """The value of ``count`` when etcd was at ``revision``; past the members' compaction of their
        history, the base as it is now and the adds created up to ``revision``."""
        try:
            return _Count.value(self._txn([], count.reads(revision), [], what, deadline)["responses"])[1]
        except EtcdRequestError as e:
            if "compacted" not in str(e):
                raise
        reads = [_range(count.base), _range(count.ones, prefix=True, keys_only=True, max_create_revision=revision),
                 _range(count.others, prefix=True, max_create_revision=revision)]
        responses = self._txn([], reads, [], what, deadline)["responses"]
        return _Count.total(_ranged(responses[0]), len(_kvs(responses[1])), _kvs(responses[2]))[1]

    def _decimal(self, key: str, value: bytes | None) -> int:
        try:
            return int(value or b"")
        except ValueError:
            shown = (value or b"")[:40]
            raise ValueError(f"add to {key!r}: it holds {shown!r}, not a decimal count; a key that add counts "
                             "in must be written by add, or set to a decimal integer") from None
