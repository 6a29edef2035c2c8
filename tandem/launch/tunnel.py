"""The stores of a job of several nodes behind TLS, keyed by the job secret:
:class:`Tunnels`.

# Note [stores behind TLS]
torch's ``TCPStore`` has no authentication: whoever reaches its port can list
every key, read, overwrite and add to them, and so stop or hang a job even
when every value tandem reads is signed (Note [signed store] in
tandem/store/job_secret.py). So in a job of several nodes no store listens on
the network at all. Each store listens on 127.0.0.1 of the node that hosts
it, and the network reaches it through ``stunnel`` (an existing TLS tunnel,
OpenSSL underneath), in TLS 1.3 with a pre-shared key derived from the job
secret (an HMAC: the secret itself never leaves the node):

* the node that hosts a store runs a server tunnel on the store's public
  address (the endpoint's, or this node's own for the workers' store) that
  forwards to the store on loopback;
* every other node's launcher runs a client tunnel on 127.0.0.1 to each store
  it uses, and it and its workers connect there (``MASTER_ADDR=127.0.0.1``);
  a node's clients of a store it hosts connect to it on loopback directly.

A process without the key cannot finish the handshake, so it cannot open a
session with any store: nothing to list, read, write or add to. TLS also ends
what a signature alone cannot: nobody on the path reads the traffic, and a
value seen once cannot be replayed under the same key.

Told, on both sides: a node whose secret differs fails the handshake, which
its client tunnel reports ("binder does not verify" at the server, an alert at
the client). The node is told at once that "this job's secret differs from
yours" and how to share one (:class:`SecretDiffersError`); the hosting
launcher logs one line per address that tried, and counts the rest. Bytes
that are not TLS at all (a scan, a stranger's ``TCPStore`` client) are
refused the same way and logged once per address.

The tunnel's cost is two more hops on loopback and the encryption: a store
operation takes about twice as long (BENCHMARKS.md, "Stores behind TLS").
A job of one node keeps everything on 127.0.0.1 and uses no tunnel.

What TLS does not cover: gloo's own listening sockets (each rank's pairs
connect to the addresses exchanged through the now authenticated store; gloo
has no TLS in torch's wheels). A stranger who connects there can disturb a
group's connection setup, not join it or read a store.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import hmac
import logging
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["STUNNEL_MISSING", "SecretDiffersError", "TunnelError", "Tunnels", "free_port", "stunnel_path", "tls_key"]

logger = logging.getLogger(__name__)

_IDENTITY = "tandem"
_LOOPBACK = "127.0.0.1"
_START_S = 10.0
_PROBE_S = 5.0
_MAX_BACKOFF_S = 1.0
_MAX_LINES = 8  # refused addresses named in the log; the rest are counted
_READER_JOIN_S = 5.0  # close() waits this long for the log's reader to reach the log's end
_PR_SET_PDEATHSIG = 1

STUNNEL_MISSING = (
    "a job of several nodes keeps its stores behind TLS (stunnel), and stunnel is not installed on this node: "
    "install it (apt-get install stunnel4, dnf install stunnel, or conda install -c conda-forge stunnel) on "
    "every node, or pass --open-stores to every node's tandem run to leave the stores open to the network as "
    "torchrun's are (docs: Who can join a job)")

SECRET_DIFFERS = (
    "this job's secret differs from yours: {what} at {where} refused this node's TLS handshake, which only a "
    "process with the job's secret completes. Give every node the same secret: copy one file to every node and "
    "export TANDEM_JOB_SECRET_FILE=<that file> before each node's launch (docs: Who can join a job)")


class TunnelError(RuntimeError):
    """A tunnel could not start, or its far end could not be reached."""


class SecretDiffersError(TunnelError):
    """The far end refused this node's handshake: its job secret differs (Note [stores behind TLS])."""


def stunnel_path() -> str | None:
    """The ``stunnel`` program on this node, or None."""
    return shutil.which("stunnel") or shutil.which("stunnel4")


def tls_key(secret: bytes) -> str:
    """The pre-shared key of a job's tunnels, as hex: an HMAC of a fixed text under the secret."""
    return hmac.new(secret, b"tandem: the TLS key of the job's stores", hashlib.sha256).hexdigest()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


# A line of stunnel's log: "2026.11.29 06:49:48 LOG5[3]: text"; the bracket names the connection.
_LINE = re.compile(r"LOG(\d)\[([^\]]+)\]: (.*)")
_ACCEPTED = re.compile(r"accepted connection from (\S+):(\d+)$")


class _Stunnel:
    """One ``stunnel`` process with one service (a server or a client tunnel),
    its log read by a thread of its own."""

    def __init__(self, program: str, workdir: Path, name: str, *, accept: tuple[str, int],
                 connect: tuple[str, int], client: bool, psk_file: Path,
                 on_refused: Callable[[str, bool], None] | None = None) -> None:
        self.name = name
        self.accept = accept
        self.connect = connect
        self._on_refused = on_refused
        self._conns: dict[str, tuple[str, str]] = {}  # an open connection's id -> its peer's address and port
        self._outcomes: dict[str, str] = {}  # a client tunnel's connection, by its local port -> how it went
        self._changed = threading.Condition()
        config = workdir / f"{name}.conf"
        lines = ["foreground = yes", "pid =", "syslog = no", "debug = 6",
                 "socket = l:TCP_NODELAY=1", "socket = r:TCP_NODELAY=1",
                 # A store's connection lives as long as the job: never closed for idling.
                 "TIMEOUTidle = 31536000", f"[{name}]", f"accept = {_host_port(*accept)}",
                 f"connect = {_host_port(*connect)}", "sslVersion = TLSv1.3", f"PSKsecrets = {psk_file}"]
        if client:
            lines += ["client = yes", f"PSKidentity = {_IDENTITY}"]
        config.write_text("\n".join(lines) + "\n")
        config.chmod(0o600)
        self._proc = subprocess.Popen([program, str(config)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, errors="replace",
                                      preexec_fn=_die_with_parent)
        self._tail: list[str] = []
        self._reader: threading.Thread | None = None
        self._ready(name)
        self._reader = threading.Thread(target=self._read, name=f"tandem-tls-{name}", daemon=True)
        self._reader.start()

    def _ready(self, name: str) -> None:
        """Read the log until the service accepts connections; raise with the log's
        errors if it exits first, or says nothing of it within :data:`_START_S`."""
        assert self._proc.stdout is not None
        silent = threading.Timer(_START_S, self._proc.kill)  # the log ends: never a wait for a line that never comes
        silent.start()
        try:
            for line in self._proc.stdout:
                if "LOG3" in line:
                    self._tail.append(line.rstrip())
                if "Accepting new connections" in line:
                    return
        finally:
            silent.cancel()
        self.close()
        raise TunnelError(f"the TLS tunnel for {name} could not listen on {_host_port(*self.accept)}: "
                          + (" / ".join(t.split(": ", 1)[-1] for t in self._tail[-3:])
                             or f"stunnel said nothing of it within {_START_S:g} s"))

    # ------------------------------------------------------------------ the log
    def _read(self) -> None:
        """Note [the log's reader owns the pipe]: a file closed by one thread
        while another reads it raises ``ValueError: I/O operation on closed
        file`` in the reader, printed as an unhandled thread's error at the
        end of the launcher's output. So only this thread closes the log, at
        its end (the process exited); :meth:`close` ends the process and waits
        for this thread, bounded, and never closes the pipe under it."""
        stdout = self._proc.stdout
        assert stdout is not None
        try:
            for line in stdout:
                match = _LINE.search(line)
                if match is not None:
                    self._event(match.group(2), match.group(3).strip())
        finally:
            with contextlib.suppress(OSError):
                stdout.close()

    def _event(self, conn: str, text: str) -> None:
        accepted = _ACCEPTED.search(text)
        if accepted is not None:
            self._conns[conn] = (accepted.group(1), accepted.group(2))
            return
        closed = text.startswith("Connection") and ("reset" in text or "closed" in text)
        peer, port = (self._conns.pop if closed else self._conns.get)(conn, ("an unknown address", ""))
        if self._on_refused is not None:  # a server tunnel: it says whom it refused
            if text.startswith("SSL_accept:"):
                self._on_refused(peer, "binder does not verify" in text)
            return
        outcome = None
        if text.startswith("TLS connected"):
            outcome = "ok"
        elif text.startswith("SSL_connect:"):
            outcome = "secret"
        elif text.startswith("s_connect: connect ") or text.startswith("No more addresses to connect"):
            outcome = "unreachable"
        elif closed:
            outcome = "closed"
        if outcome is not None and port:
            with self._changed:
                self._outcomes.setdefault(port, outcome)
                self._changed.notify_all()

    # ------------------------------------------------------------------ a client's probe
    def probe(self, timeout_s: float) -> str:
        """Open one connection through this client tunnel and say how its far
        end answered: ``ok``, ``secret`` (the handshake was refused),
        ``unreachable`` (no TCP connection) or ``closed``; ``timeout`` when the
        log said nothing within ``timeout_s``."""
        try:
            s = socket.create_connection(self.accept, timeout=timeout_s)
        except OSError:  # the tunnel took it and already closed it (its far end refused at once)
            return "closed"
        with s:
            port = str(s.getsockname()[1])
            deadline = time.monotonic() + timeout_s
            with self._changed:
                while port not in self._outcomes:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._proc.poll() is not None:
                        return "timeout"
                    self._changed.wait(left)
                return self._outcomes.pop(port)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._reader is not None:  # it closes the log at its end (Note [the log's reader owns the pipe])
            self._reader.join(_READER_JOIN_S)
        elif self._proc.stdout is not None:  # no reader yet: the service never came up
            with contextlib.suppress(OSError):
                self._proc.stdout.close()


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str) -> int:
    """A port free on ``host`` now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Tunnels:
    """One launcher's TLS tunnels (Note [stores behind TLS]): the stores it
    hosts, served on their public addresses, and those of other nodes it
    reaches through 127.0.0.1.

    Args:
        secret: the job secret (the tunnels' key is derived from it).
        on_refused: called with one line per address whose connection a
            served tunnel refused (at most a few lines; the rest are counted).

    Raises:
        TunnelError: stunnel is not installed (:data:`STUNNEL_MISSING`).
    """

    def __init__(self, secret: bytes, *, on_refused: Callable[[str], None] | None = None) -> None:
        program = stunnel_path()
        if program is None:
            raise TunnelError(STUNNEL_MISSING)
        self._program = program
        self._on_refused = on_refused or (lambda line: logger.warning("%s", line))
        self._dir = Path(tempfile.mkdtemp(prefix="tandem-tls-"))
        self._psk = self._dir / "psk"
        self._psk.touch(mode=0o600)
        self._psk.write_text(f"{_IDENTITY}:{tls_key(secret)}\n")
        self._served: dict[tuple[str, int], tuple[_Stunnel, int]] = {}   # public -> (tunnel, loopback port)
        self._reached: dict[tuple[str, int], _Stunnel] = {}
        self._lock = threading.Lock()
        self._refused: dict[tuple[str, bool], int] = {}  # (address, another secret) -> count
        self.other_secret: str | None = None
        """The first node refused for another secret, in words (for the launcher's error)."""
        self._count = 0

    @property
    def refused(self) -> int:
        """How many connections the served tunnels refused."""
        return sum(self._refused.values())

    def serve(self, host: str, port: int, store_port: int, what: str) -> int:
        """Serve the store on 127.0.0.1:``store_port`` at ``host:port`` (``port``
        0: a free one) behind TLS; returns the public port."""
        for _ in range(3 if port == 0 else 1):
            public = port or free_port(host)
            try:
                tunnel = self._start(what, accept=(host, public), connect=(_LOOPBACK, store_port), client=False)
            except TunnelError:
                if port:
                    raise
                continue  # the free port was taken meanwhile: another
            self._served[(host, public)] = (tunnel, store_port)
            return public
        raise TunnelError(f"no free port on {host} for the TLS tunnel of {what}")

    def reach(self, host: str, port: int, what: str, *, timeout_s: float) -> tuple[str, int]:
        """The address on this node through which the store at ``host:port`` is
        reached: its loopback port when this node serves it, else a client
        tunnel's, once a handshake through it has succeeded (retried while the
        far end does not answer yet, for up to ``timeout_s``).

        Raises:
            SecretDiffersError: the far end refused the handshake.
            TunnelError: no connection within ``timeout_s``.
        """
        served = self._served.get((host, port))
        if served is not None:
            return _LOOPBACK, served[1]
        tunnel = self._reached.get((host, port))
        if tunnel is None:
            tunnel = self._start(what, accept=(_LOOPBACK, 0), connect=(host, port), client=True)
            self._reached[(host, port)] = tunnel
        deadline = time.monotonic() + timeout_s
        backoff = 0.05
        outcome = "timeout"
        while time.monotonic() < deadline:
            outcome = tunnel.probe(min(_PROBE_S, max(0.1, deadline - time.monotonic())))
            if outcome == "ok":
                return tunnel.accept
            if outcome == "secret":
                self.drop(host, port)
                raise SecretDiffersError(SECRET_DIFFERS.format(what=what, where=_host_port(host, port)))
            time.sleep(backoff)  # the far end is not up yet: ask again, as a store's client would
            backoff = min(_MAX_BACKOFF_S, 2 * backoff)
        self.drop(host, port)
        raise TunnelError(f"{what} at {_host_port(host, port)} could not be reached through TLS within "
                          f"{timeout_s:g} s (the last try: {outcome})")

    def drop(self, host: str, port: int) -> None:
        """Close the tunnel to or for ``host:port``, if any (a previous attempt's store)."""
        served = self._served.pop((host, port), None)
        if served is not None:
            served[0].close()
        reached = self._reached.pop((host, port), None)
        if reached is not None:
            reached.close()

    def close(self) -> None:
        """Close every tunnel and remove the key."""
        for host, port in list(self._served) + list(self._reached):
            self.drop(host, port)
        shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------ helpers
    def _start(self, what: str, *, accept: tuple[str, int], connect: tuple[str, int], client: bool) -> _Stunnel:
        self._count += 1
        name = f"{'c' if client else 's'}{self._count}"
        if client:  # a free loopback port for the client end
            accept = (_LOOPBACK, free_port(_LOOPBACK))
        return _Stunnel(self._program, self._dir, name, accept=accept, connect=connect, client=client,
                        psk_file=self._psk, on_refused=None if client else self._refusal(what))

    def _refusal(self, what: str) -> Callable[[str, bool], None]:
        def refused(peer: str, secret: bool) -> None:
            with self._lock:
                seen = self._refused.get((peer, secret), 0)
                self._refused[(peer, secret)] = seen + 1
                named = len(self._refused)
            if seen or named > _MAX_LINES:
                return
            why = ("its job secret differs from this job's" if secret
                   else "it did not open TLS with this job's secret")
            more = "" if named < _MAX_LINES else "; more refused addresses are counted, not named"
            if secret and self.other_secret is None:
                self.other_secret = f"a node at {peer} with another job secret was refused at {what}"
            self._on_refused(f"refused a connection from {peer} to {what}: {why} (more like it "
                             f"are refused silently{more})")
        return refused

    def __enter__(self) -> Tunnels:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

