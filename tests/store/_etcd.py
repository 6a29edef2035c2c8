"""An etcd cluster of 1 or 3 members on 127.0.0.1 for the tests, on free ports
with its data in a temporary directory, optionally with mutual TLS:
:class:`EtcdCluster`, :func:`etcd_missing`, :func:`cryptography_missing`.

Every member is killed and the data removed when the ``with`` block ends,
failed test or not; a member also dies with the test process (its parent-death
signal), so a killed pytest leaves no member behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import ipaddress
import json
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from tandem.store.etcd_gateway import EtcdTLS
from tandem.testing.start_close import StartAndClose

__all__ = ["EtcdCluster", "cryptography_missing", "etcd_missing", "make_identity"]

HOST = "127.0.0.1"
_START_S = 30.0
_PR_SET_PDEATHSIG = 1


def etcd_missing() -> str | None:
    """Why the etcd tests cannot run here, or None."""
    if shutil.which("etcd") is None:
        return "the etcd binary is not installed (apt-get install etcd-server; .ci/run installs it)"
    return None


def cryptography_missing() -> str | None:
    """Why the TLS tests cannot run here, or None."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return "the TLS tests make their certificates with the cryptography package, which is not installed"
    return None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def make_identity(directory: Path, names: list[str], ca_name: str = "tandem test etcd CA") -> Path:
    """A CA in ``directory`` (``ca.crt``) and, for each name, ``<name>.crt`` and
    ``<name>.key`` signed by it, good for server and client auth on 127.0.0.1."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca = (x509.CertificateBuilder().subject_name(ca_subject).issuer_name(ca_subject)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    (directory / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=2))
                .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(HOST))]),
                               critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (directory / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return directory


class EtcdCluster(StartAndClose):
    """``members`` etcd members (1 or 3) on 127.0.0.1, started by ``with``.

    Args:
        members: how many.
        tls: require client certificates (mutual TLS) from a CA made for this cluster.
        election_ms: etcd's election timeout (its heartbeat is a tenth of it).
    """

    def __init__(self, members: int = 1, *, tls: bool = False, election_ms: int = 1000) -> None:
        if members not in (1, 3):
            raise ValueError(f"members={members}: a test cluster has 1 or 3")
        self.names = [f"m{i}" for i in range(members)]
        self.use_tls = tls
        self.election_ms = election_ms
        self.directory = Path(tempfile.mkdtemp(prefix="tandem-etcd-"))
        ports = _free_ports(2 * members)
        self.client_ports, self.peer_ports = ports[:members], ports[members:]
        self._procs: list[subprocess.Popen[bytes] | None] = []

    @property
    def endpoints(self) -> list[str]:
        """The members' client addresses, ``host:port``."""
        return [f"{HOST}:{p}" for p in self.client_ports]

    @property
    def tls(self) -> EtcdTLS | None:
        """A client identity the members accept (None without TLS)."""
        if not self.use_tls:
            return None
        d = self.directory / "tls"
        return EtcdTLS(ca_file=d / "ca.crt", cert_file=d / "client.crt", key_file=d / "client.key")

    def foreign_tls(self) -> EtcdTLS:
        """A client identity from another CA (that trusts this cluster's CA): the members refuse it."""
        d = make_identity(self.directory / "foreign", ["client"])
        return EtcdTLS(ca_file=self.directory / "tls" / "ca.crt", cert_file=d / "client.crt",
                       key_file=d / "client.key")

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        if self.use_tls:
            make_identity(self.directory / "tls", [*self.names, "client"])
        for i in range(len(self.names)):
            log = open(self.directory / f"{self.names[i]}.log", "wb")
            with log:
                self._procs.append(subprocess.Popen(self._command(i), stdin=subprocess.DEVNULL, stdout=log,
                                                    stderr=subprocess.STDOUT, preexec_fn=_die_with_parent))
        self._wait_healthy()

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` and reap it."""
        proc = self._procs[index]
        if proc is not None:
            proc.kill()
            proc.wait()
            self._procs[index] = None

    def close(self) -> None:
        """Kill every member and remove the data."""
        for i in range(len(self._procs)):
            self.kill(i)
        shutil.rmtree(self.directory, ignore_errors=True)

    # ------------------------------------------------------------------ helpers
    def _scheme(self) -> str:
        return "https" if self.use_tls else "http"

    def _command(self, i: int) -> list[str]:
        name, scheme = self.names[i], self._scheme()
        peers = ",".join(f"{n}={scheme}://{HOST}:{p}" for n, p in zip(self.names, self.peer_ports))
        client, peer = f"{scheme}://{HOST}:{self.client_ports[i]}", f"{scheme}://{HOST}:{self.peer_ports[i]}"
        command = ["etcd", "--name", name, "--data-dir", str(self.directory / f"{name}.data"),
                   "--logger", "zap", "--log-level", "warn",
                   "--listen-client-urls", client, "--advertise-client-urls", client,
                   "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                   "--initial-cluster", peers, "--initial-cluster-state", "new",
                   "--initial-cluster-token", self.directory.name,
                   "--heartbeat-interval", str(self.election_ms // 10), "--election-timeout", str(self.election_ms),
                   "--auto-compaction-mode", "revision", "--auto-compaction-retention", "1000"]
        if self.use_tls:
            d = self.directory / "tls"
            for side in ("", "peer-"):
                command += [f"--{side}client-cert-auth", f"--{side}trusted-ca-file", str(d / "ca.crt"),
                            f"--{side}cert-file", str(d / f"{name}.crt"), f"--{side}key-file", str(d / f"{name}.key")]
        return command

    def _context(self) -> ssl.SSLContext | None:
        tls = self.tls
        return None if tls is None else tls.context()

    def healthy(self, i: int) -> bool:
        """Whether member ``i`` says the cluster has a leader."""
        url = f"{self._scheme()}://{HOST}:{self.client_ports[i]}/health"
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(url, timeout=1.0, context=self._context()) as answer:
                return bool(json.loads(answer.read()).get("health") == "true")
        return False

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + _START_S
        while time.monotonic() < deadline:
            ended = [n for n, p in zip(self.names, self._procs) if p is not None and p.poll() is not None]
            if ended:
                raise RuntimeError(f"etcd member {ended[0]} exited at its start:\n{self._log_tail(ended[0])}")
            if all(self.healthy(i) for i in range(len(self.names))):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the etcd cluster was not healthy within {_START_S:g} s:\n"
                           + "\n".join(self._log_tail(n) for n in self.names))

    def _log_tail(self, name: str) -> str:
        path = self.directory / f"{name}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return f"--- {name}:\n" + "\n".join(lines[-15:])
