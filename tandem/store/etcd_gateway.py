"""A client of an etcd cluster's v3 JSON gateway that fails over between the
members: :class:`EtcdGateway`, :class:`EtcdTLS`, and the errors it raises.
Standard library only (``http.client``, ``ssl``, ``json``).

# Note [failing over between etcd members]
Every member of an etcd cluster answers every request: a follower forwards a
write to the leader and asks the leader before it answers a read (reads are
linearizable, etcd's default: a member cut off from the majority answers
nothing rather than an old value). So the client keeps the members' addresses
and sends each request to the member that answered last (at first, one drawn
at random, so that many clients spread over the members), and, when that one
does not answer, to the next, round the list:

* a member that refuses the connection (its process is gone) is passed over at
  once; one that does not answer within :data:`_ATTEMPT_S` is passed over too
  (a member cut off from the majority holds a request for etcd's own limit of
  seven seconds before it says so);
* during a leader's election (one to two seconds after the leader is lost, with
  etcd's default ticks) the members answer with errors ("etcdserver: no
  leader", "leader changed", "request timed out") or not at all: those are tried
  again, round the list, with a short pause that grows to :data:`_MAX_PAUSE_S`,
  until the caller's deadline;
* a request that no member answered by the deadline raises
  :class:`EtcdUnavailableError`, which names every member and what each did:
  the cluster has lost its majority, or this node does not reach it;
* what retrying cannot mend raises at once: a member that refuses this node's
  TLS certificate (:class:`EtcdCertificateError`: every member trusts the same
  CA, so the others would refuse it too), one this node does not trust, and a
  request etcd rejects as malformed (:class:`EtcdRequestError`).

A request sent again after a member failed to answer may have been applied
already (etcd applied it and the answer was lost): the store's operations are
built so that applying one twice is harmless (Note [a counter without contention] in
etcd_store.py).

Each thread has its own connections (one kept alive per member), so a thread
that polls for a key never waits behind another thread's request.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import random
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["EtcdCertificateError", "EtcdGateway", "EtcdRequestError", "EtcdTLS", "EtcdUnavailableError"]

logger = logging.getLogger(__name__)

_ATTEMPT_S = 2.0     # the longest one member gets to answer one request before the next is asked
_FIRST_PAUSE_S = 0.05
_MAX_PAUSE_S = 0.5   # the longest pause between two rounds of the members
# gRPC codes that say the request itself is wrong (a malformed key, too many operations in a
# transaction, a lease that is gone, no permission): the same request fails on every member. The
# others (unavailable: no leader, leader changed, request timed out; resource exhausted: too many
# requests) pass with an election.
_REJECTED_CODES = {3: "invalid argument", 5: "not found", 6: "already exists", 7: "permission denied",
                   11: "out of range", 12: "unimplemented", 16: "unauthenticated"}
_NO_SPACE = "database space exceeded"


class EtcdUnavailableError(dist.DistNetworkError):
    """No member of the etcd cluster answered a request in time (Note [failing
    over between etcd members]): it lost its majority, or is unreachable."""


class EtcdCertificateError(dist.DistNetworkError):
    """A TLS handshake with a member failed for a reason retrying cannot mend:
    the member refused this node's certificate, or this node does not trust
    the member's."""


class EtcdRequestError(dist.DistStoreError):
    """etcd rejected a request as wrong (not for want of a leader)."""


@dataclass(frozen=True, kw_only=True)
class EtcdTLS:
    """This node's TLS identity toward an etcd cluster that requires client
    certificates (etcd's ``--client-cert-auth``).

    Raises:
        ValueError: a file does not exist.
    """

    ca_file: str | os.PathLike[str]
    """The CA certificate that signed the members' certificates: this node trusts them through it."""
    cert_file: str | os.PathLike[str]
    """This node's certificate, signed by the CA the members trust (their ``--trusted-ca-file``)."""
    key_file: str | os.PathLike[str]
    """The private key of ``cert_file``."""

    def __post_init__(self) -> None:
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if not os.path.isfile(path):
                raise ValueError(f"EtcdTLS.{name}={os.fspath(path)!r}: no such file")

    def context(self) -> ssl.SSLContext:
        """A client context that presents this identity and trusts only ``ca_file``."""
        context = ssl.create_default_context(cafile=os.fspath(self.ca_file))
        context.load_cert_chain(os.fspath(self.cert_file), os.fspath(self.key_file))
        return context


class _NoAnswer(Exception):
    """One member did not answer one request; ``why`` says how, in words;
    ``lost``: an open connection broke (worth one more try on a new one)."""

    def __init__(self, why: str, *, lost: bool = False) -> None:
        super().__init__(why)
        self.why = why
        self.lost = lost


def _endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"etcd endpoint {text!r}: expected 'host:port' (such as '10.0.0.5:2379'), "
                         "without a scheme; pass tls=EtcdTLS(...) for https")
    return host.strip("[]"), int(port)


class EtcdGateway:
    """Requests to an etcd cluster's v3 JSON gateway (``POST /v3/...``), sent to
    one member and failed over to the next (Note [failing over between etcd
    members]).

    Args:
        endpoints: the members' client addresses, ``host:port``.
        tls: this node's identity for members that require TLS; None for plain HTTP.

    Raises:
        ValueError: no endpoint, or one that is not ``host:port``.
    """

    def __init__(self, endpoints: Sequence[str], tls: EtcdTLS | None = None) -> None:
        if isinstance(endpoints, str) or not endpoints:
            raise ValueError(f"endpoints={endpoints!r}: expected a list of 'host:port', one per etcd member")
        self.endpoints: tuple[str, ...] = tuple(endpoints)
        self._addresses = [_endpoint(e) for e in self.endpoints]
        self.tls = tls
        self._context = tls.context() if tls is not None else None
        # The member that answered last (shared by the threads: a hint, races are harmless); clients start at
        # a member of their own, so that a job's thousands of clients share the members' TLS and JSON work.
        self._preferred = random.randrange(len(self.endpoints))
        self._local = threading.local()
        self._open: weakref.WeakSet[http.client.HTTPConnection] = weakref.WeakSet()
        self._open_lock = threading.Lock()

    def call(self, path: str, body: dict[str, Any], deadline: float, what: str) -> dict[str, Any]:
        """The answer of the first member that answers ``POST path`` with ``body``;
        every member is asked at least once, and asked again until ``deadline``
        (``time.monotonic()``). ``what`` names the request in errors.

        Raises:
            EtcdUnavailableError: no member answered by the deadline.
            EtcdCertificateError: a member refused this node's certificate, or
                this node does not trust the member's.
            EtcdRequestError: etcd rejected the request.
        """
        data = json.dumps(body).encode()
        started = time.monotonic()
        why: dict[str, str] = {}
        pause = _FIRST_PAUSE_S
        first_round = True
        while True:
            start = self._preferred
            for i in [*range(start, len(self.endpoints)), *range(start)]:
                left = deadline - time.monotonic()
                if left <= 0 and not first_round:
                    break
                try:
                    answer = self._post(i, path, data, min(_ATTEMPT_S, max(left, 0.2)))
                except _NoAnswer as e:
                    why[self.endpoints[i]] = e.why
                    continue
                if i != self._preferred:  # a failover: said once, when it happens
                    logger.info("etcd: %s answers now (%s), after %s", self.endpoints[i], what,
                                "; ".join(f"{k}: {v}" for k, v in why.items()))
                self._preferred = i
                return answer
            first_round = False
            if time.monotonic() + pause >= deadline:
                raise EtcdUnavailableError(self._unavailable(what, time.monotonic() - started, why))
            time.sleep(pause)
            pause = min(2 * pause, _MAX_PAUSE_S)

    def watch(self, key: bytes, start_revision: int, until: float) -> bool:
        """Wait until ``key`` is written at revision ``start_revision`` or later
        (Note [waiting by watching] in etcd_store.py): True when an event came
        (or etcd ended the watch, its history compacted), False at ``until``
        (``time.monotonic()``) or when the member did not answer; either way the
        caller reads again. One connection of its own, to the member that
        answered last, closed when this returns."""
        host, port = self._addresses[self._preferred]
        left = until - time.monotonic()
        if left <= 0:
            return False
        connection = (http.client.HTTPSConnection(host, port, timeout=min(left, _ATTEMPT_S), context=self._context)
                      if self._context is not None else
                      http.client.HTTPConnection(host, port, timeout=min(left, _ATTEMPT_S)))
        body = {"create_request": {"key": base64.b64encode(key).decode(), "start_revision": str(start_revision)}}
        try:
            connection.request("POST", "/v3/watch", body=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                return False
            while True:
                left = until - time.monotonic()
                if left <= 0:
                    return False
                assert connection.sock is not None
                connection.sock.settimeout(left)
                line = response.readline()
                if not line:
                    return False
                result = json.loads(line).get("result") or {}
                if result.get("events") or result.get("canceled"):
                    return True
        except (OSError, ValueError, http.client.HTTPException):  # timed out, refused, lost: read again
            return False
        finally:
            connection.close()

    def close(self) -> None:
        """Close every thread's connections (a later call opens new ones)."""
        with self._open_lock:
            connections = list(self._open)
        for connection in connections:
            connection.close()

    # ------------------------------------------------------------------ one member, one request
    def _connection(self, i: int) -> http.client.HTTPConnection:
        connections: dict[int, http.client.HTTPConnection] | None = getattr(self._local, "connections", None)
        if connections is None:
            connections = self._local.connections = {}
        connection = connections.get(i)
        if connection is None:
            host, port = self._addresses[i]
            if self._context is not None:
                connection = http.client.HTTPSConnection(host, port, timeout=_ATTEMPT_S, context=self._context)
            else:
                connection = http.client.HTTPConnection(host, port, timeout=_ATTEMPT_S)
            connections[i] = connection
            with self._open_lock:
                self._open.add(connection)
        return connection

    def _post(self, i: int, path: str, data: bytes, timeout_s: float) -> dict[str, Any]:
        connection = self._connection(i)
        reused = connection.sock is not None
        try:
            status, raw = self._exchange(connection, path, data, timeout_s)
        except _NoAnswer as e:
            if not (reused and e.lost):
                raise
            # A kept-alive connection the member closed since (idle, or restarted): once more, on a new one.
            status, raw = self._exchange(connection, path, data, timeout_s)
        return self._answer(i, status, raw)

    def _exchange(self, connection: http.client.HTTPConnection, path: str, data: bytes,
                  timeout_s: float) -> tuple[int, bytes]:
        connection.timeout = timeout_s
        if connection.sock is not None:
            connection.sock.settimeout(timeout_s)
        endpoint = f"{connection.host}:{connection.port}"
        try:
            connection.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            raw = response.read()
        except ssl.SSLCertVerificationError as e:
            connection.close()
            raise EtcdCertificateError(self._untrusted(endpoint, e)) from None
        except ssl.SSLError as e:
            connection.close()
            reason = e.reason or str(e)
            if "ALERT" in reason.upper():  # the member ended the handshake: it refused this node's certificate
                raise EtcdCertificateError(self._refused(endpoint, reason)) from None
            if "WRONG_VERSION_NUMBER" in reason.upper():
                raise EtcdCertificateError(f"the etcd member at {endpoint} does not speak TLS ({reason}): "
                                           "its client URL is http://; create the store without tls=") from None
            raise _NoAnswer(f"TLS error ({reason})", lost=True) from None
        except (socket.timeout, TimeoutError):
            connection.close()
            raise _NoAnswer(f"no answer within {timeout_s:.1f} s") from None
        except ConnectionRefusedError:
            connection.close()
            raise _NoAnswer("connection refused") from None
        except (OSError, http.client.HTTPException) as e:
            connection.close()
            raise _NoAnswer(f"connection lost ({type(e).__name__}: {e})" if str(e) else
                            f"connection lost ({type(e).__name__})", lost=True) from None
        if response.will_close:
            connection.close()
        return response.status, raw

    def _answer(self, i: int, status: int, raw: bytes) -> dict[str, Any]:
        endpoint = self.endpoints[i]
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            text = raw[:120].decode(errors="replace").strip()
            if status == 400 and "HTTPS server" in text:
                raise EtcdCertificateError(f"the etcd member at {endpoint} requires TLS ({text!r}): create the "
                                           "store with tls=EtcdTLS(ca_file=..., cert_file=..., key_file=...)")
            raise _NoAnswer(f"answered HTTP {status} {text!r}, which is not etcd's v3 JSON gateway")
        if status == 200:
            return answer
        code = answer.get("code")
        message = answer.get("message") or answer.get("error") or raw[:200].decode(errors="replace")
        if _NO_SPACE in str(message):
            raise EtcdRequestError(f"the etcd cluster is full and takes no more writes ({message}, at {endpoint}): "
                                   "run its members with --auto-compaction-mode=revision "
                                   "--auto-compaction-retention=1000, then compact, defragment and disarm the "
                                   "alarm (etcdctl compact, defrag, alarm disarm)")
        if code in _REJECTED_CODES:
            raise EtcdRequestError(f"the etcd member at {endpoint} rejected the request "
                                   f"({_REJECTED_CODES[code]}): {message}")
        raise _NoAnswer(f"etcd said {message!r}")  # no leader, leader changed, request timed out, too many requests

    # ------------------------------------------------------------------ errors, in words
    def _unavailable(self, what: str, waited_s: float, why: dict[str, str]) -> str:
        members = "; ".join(f"{e}: {why.get(e, 'not asked')}" for e in self.endpoints)
        hint = ""
        if self.tls is None and any("RemoteDisconnected" in w for w in why.values()):
            hint = ("; a member that requires TLS closes plain HTTP connections at once: if the members do, "
                    "pass tls=EtcdTLS(...)")
        return (f"the etcd control plane lost its majority or is unreachable: no member answered ({what}) "
                f"within {waited_s:.1f} s [{members}]. A cluster of {len(self.endpoints)} answers while a "
                f"majority of its members run and reach each other: restart the members that are down, or "
                f"check this node's network to them{hint}")

    def _refused(self, endpoint: str, reason: str) -> str:
        cert = os.fspath(self.tls.cert_file) if self.tls is not None else "none"
        return (f"the etcd cluster refused this node's certificate: the member at {endpoint} ended the TLS "
                f"handshake ({reason}). This node's certificate ({cert}) is not signed by the CA the members "
                "trust (their --trusted-ca-file), or it has expired or lacks clientAuth: give this node a "
                "certificate signed by the cluster's CA and pass it as EtcdTLS(cert_file=..., key_file=...)")

    def _untrusted(self, endpoint: str, e: ssl.SSLCertVerificationError) -> str:
        ca = os.fspath(self.tls.ca_file) if self.tls is not None else "the system's CAs"
        return (f"this node does not trust the etcd member at {endpoint}: its certificate is not signed by "
                f"{ca} ({e.verify_message}); pass the CA that signed the members' certificates as "
                "EtcdTLS(ca_file=...)")
