"""The job's control plane on an etcd cluster that its nodes run:
:class:`EtcdControlPlane`, :class:`EtcdMember`, :func:`node_identity`.

# Note [a replicated control plane]
By default an elastic job keeps its control plane (the rendezvous, the roll of
nodes, each attempt's workers' store, and in it the membership, the beats and
each generation's group) in ``TCPStore`` s that one node hosts: when that node
goes, so does every key, and a partition is won by whichever side holds the
store. ``tandem run --rdzv-backend etcd --rdzv-endpoint A:2379,B:2379,C:2379``
keeps all of it on an etcd cluster of three (or five) members instead, one on
each of the nodes named, which ``tandem run`` starts there:

* etcd (Raft) keeps every key on every member and answers while a majority of
  them run and reach each other. Losing any one node of three loses nothing;
  in a partition, the side with two members goes on and the side with one
  cannot write or read (etcd's reads are linearizable), so its workers' beats
  stop landing and they stop with the cut-off message and exit 75 (Note [cut
  off] in tandem/comm/cut_off.py). Never two groups training one run.
* The members speak TLS only, to each other and to clients, and require a
  client certificate. Every node makes its certificates from the job secret,
  which never leaves the node: the CA's private key is derived from the secret
  (HMAC-SHA512, as an EC P-256 scalar), so every node signs with the same CA
  and trusts the same CA, and a process without the secret has no certificate
  a member accepts (its handshake is refused: Note [failing over between etcd
  members] in tandem/store/etcd_gateway.py says so in one line).
* The rendezvous is torch's own (its c10d backend keeps its state in any
  store with ``compare_set``; :class:`~tandem.store.etcd_store.EtcdStore` has
  it); the roll of nodes (Note [nodes of an elastic job] in node_roll.py) and
  each attempt's workers' store (Note [the workers' store on etcd] in
  tandem/store/store_address.py) are prefixes beside it.
* A member listens on its endpoint's address: clients on the endpoint's port,
  peers on the next port (``2379``, ``2380``: etcd's own pair). Its data lives
  in a temporary directory of the launcher, removed when it ends; the member
  dies with its launcher.

Which endpoint this node runs: the one whose address is this node's
(``--local-addr`` or an interface's); ``--rdzv-conf etcd_member=K`` names the
K-th (0-based) where several nodes share an address, and ``etcd_member=none``
runs none (a node beyond the members, or a cluster run by hand with the same
TLS identity).

At the end a node that runs a member waits, as the host of a TCP store does,
until every other node on the roll has finished (Note [nodes of an elastic
job]), then keeps its member a moment longer (:data:`LINGER_S`) so that the
others read the last "done" before two members are gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import hashlib
import hmac
import ipaddress
import logging
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tandem.store.etcd_store import EtcdStore
from tandem.store.store_address import EtcdAddress
from tandem.launch.config import split_endpoint
from tandem.launch.machine import interface_of

__all__ = ["ETCD_MISSING", "EtcdControlPlane", "EtcdMember", "LINGER_S", "node_identity"]

logger = logging.getLogger(__name__)

LINGER_S = 1.5
"""How long a node keeps its member after every node finished (see the Note)."""
ETCD_MISSING = ("`tandem run --rdzv-backend etcd` starts an etcd member on this node and finds no `etcd` "
                "binary on PATH; install it (Debian and Ubuntu: apt-get install etcd-server) on every node "
                "named in --rdzv-endpoint")
_START_S = 30.0
_STOP_S = 5.0
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
_CA_NAME = "tandem etcd CA"
_PR_SET_PDEATHSIG = 1


def node_identity(secret: bytes, directory: Path, host: str) -> Path:
    """Write ``ca.crt``, ``node.crt`` and ``node.key`` into ``directory``: the
    job's CA (its key derived from ``secret``) and a certificate for ``host``
    it signed, good as a member's (server and peer) and as a client's.

    Raises:
        RuntimeError: the ``cryptography`` package is missing.
    """
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise RuntimeError("`tandem run --rdzv-backend etcd` makes the job's TLS certificates with the "
                           "cryptography package: pip install 'tandem[etcd]' (or cryptography)") from None
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    digest = hmac.new(secret, b"tandem/etcd-ca-key/v1", hashlib.sha512).digest()
    ca_key = ec.derive_private_key(int.from_bytes(digest, "big") % (_P256_ORDER - 1) + 1, ec.SECP256R1())
    serial = int.from_bytes(hmac.new(secret, b"tandem/etcd-ca-serial/v1", hashlib.sha256).digest()[:16], "big") >> 1
    now = datetime.datetime.now(datetime.timezone.utc)
    since, until = now - datetime.timedelta(days=1), now + datetime.timedelta(days=365)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _CA_NAME)])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(serial).not_valid_before(since).not_valid_after(until)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    try:
        names: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(host))]
    except ValueError:
        names = [x509.DNSName(host)]
    names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(since).not_valid_after(until)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    (directory / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / "node.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file = directory / "node.key"
    key_file.touch(mode=0o600)
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return directory


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class EtcdMember:
    """One etcd member of the job's cluster, run by this node's launcher.

    Args:
        index: its place among ``endpoints``.
        endpoints: every member's client address, ``host:port``; a member's
            peer port is its client port plus one.
        tls_dir: this node's identity (:func:`node_identity`).
        directory: where its data and log go.
        token: the cluster's token (the same on every member; the run id).
    """

    def __init__(self, index: int, endpoints: list[str], tls_dir: Path, directory: Path, token: str) -> None:
        self.index = index
        self.endpoints = endpoints
        self.host, self.port = split_endpoint(endpoints[index], "--rdzv-endpoint")
        self._tls = tls_dir
        self._directory = directory
        self._token = token
        self._proc: subprocess.Popen[bytes] | None = None
        self.log = directory / "etcd.log"

    def command(self) -> list[str]:
        peers = []
        for i, endpoint in enumerate(self.endpoints):
            host, port = split_endpoint(endpoint, "--rdzv-endpoint")
            peers.append(f"member{i}=https://{host}:{port + 1}")
        client, peer = f"https://{self.host}:{self.port}", f"https://{self.host}:{self.port + 1}"
        command = ["etcd", "--name", f"member{self.index}", "--data-dir", str(self._directory / "data"),
                   "--logger", "zap", "--log-level", "warn",
                   "--listen-client-urls", client, "--advertise-client-urls", client,
                   "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                   "--initial-cluster", ",".join(peers), "--initial-cluster-state", "new",
                   "--initial-cluster-token", self._token,
                   "--auto-compaction-mode", "revision", "--auto-compaction-retention", "1000"]
        for side in ("", "peer-"):
            command += [f"--{side}client-cert-auth", f"--{side}trusted-ca-file", str(self._tls / "ca.crt"),
                        f"--{side}cert-file", str(self._tls / "node.crt"),
                        f"--{side}key-file", str(self._tls / "node.key")]
        return command

    def start(self) -> None:
        """Start it, and wait until it listens for clients (it answers once a
        majority of the members runs).

        Raises:
            RuntimeError: no ``etcd`` binary, or the member ended or did not
                listen within 30 s; the message has its log's last lines.
        """
        if shutil.which("etcd") is None:
            raise RuntimeError(ETCD_MISSING)
        with open(self.log, "wb") as log:
            self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + _START_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the etcd member at {self.endpoints[self.index]} exited at its start "
                                   f"(status {self._proc.returncode}):\n{self._tail()}")
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.5):
                logger.info("etcd member %d listens at %s", self.index, self.endpoints[self.index])
                return
            time.sleep(0.05)
        raise RuntimeError(f"the etcd member at {self.endpoints[self.index]} did not listen within "
                           f"{_START_S:g} s:\n{self._tail()}")

    @property
    def pid(self) -> int | None:
        """The member's process id while it runs; None before start and after stop."""
        return self._proc.pid if self._proc is not None else None

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=_STOP_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def _tail(self) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(lines[-15:])


class EtcdControlPlane:
    """The job's stores on an etcd cluster (Note [a replicated control plane]).

    Args:
        endpoints: ``--rdzv-endpoint``, the members' client addresses, comma-separated.
        run_id: the job's id; every key lives under ``tandem/<run_id>/``.
        secret: the job secret, which makes this node's TLS identity.
        local_addr: this node's address (``--local-addr``), if given.
        member: ``--rdzv-conf etcd_member``: which endpoint this node runs
            (its index, or ``"none"``); None to find it by address.

    Raises:
        ValueError: the endpoints are malformed, an even number, or this node's
            member is ambiguous or out of range.
    """

    def __init__(self, endpoints: str, run_id: str, secret: bytes, *, local_addr: str | None = None,
                 member: str | None = None) -> None:
        self.endpoints = [e.strip() for e in endpoints.split(",") if e.strip()]
        hosts = [split_endpoint(e, "--rdzv-endpoint")[0] for e in self.endpoints]
        if len(self.endpoints) % 2 == 0:
            raise ValueError(f"--rdzv-endpoint {endpoints!r}: {len(self.endpoints)} etcd members; give an odd "
                             "number (3 or 5), each host:port, so that a majority survives a partition")
        self.run_id = run_id
        index = _member_index(hosts, local_addr, member)
        self.directory = Path(tempfile.mkdtemp(prefix="tandem-etcd-"))
        here = hosts[index] if index is not None else (local_addr or socket.gethostname())
        self.tls_dir = node_identity(secret, self.directory / "tls", here)
        self.member = (EtcdMember(index, self.endpoints, self.tls_dir, self.directory, f"tandem-{run_id}")
                       if index is not None else None)

    def start(self) -> None:
        if self.member is not None:
            self.member.start()

    def address(self, name: str) -> EtcdAddress:
        """The store ``name`` of this job (``tandem/<run id>/<name>``)."""
        return self.at(f"tandem/{self.run_id}/{name}")

    def at(self, prefix: str) -> EtcdAddress:
        """The store under ``prefix`` on this cluster, reached with this node's identity."""
        return EtcdAddress(tuple(self.endpoints), prefix, str(self.tls_dir))

    def store(self, name: str, timeout: datetime.timedelta) -> EtcdStore:
        return self.address(name).store(timeout)

    def close(self, *, linger: bool = False) -> None:
        """Stop this node's member (after :data:`LINGER_S` with ``linger``) and
        remove its data and identity."""
        if self.member is not None:
            if linger:
                time.sleep(LINGER_S)
            self.member.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


def _member_index(hosts: list[str], local_addr: str | None, member: str | None) -> int | None:
    if member is not None:
        if member.strip().lower() == "none":
            return None
        try:
            index = int(member)
        except ValueError:
            index = -1
        if not 0 <= index < len(hosts):
            raise ValueError(f"--rdzv-conf etcd_member={member!r}: expected 0..{len(hosts) - 1} (the member's "
                             "place in --rdzv-endpoint) or none")
        return index
    mine = [i for i, host in enumerate(hosts)
            if host == local_addr or (not host.startswith("127.") and interface_of(host) is not None)]
    if len(mine) > 1:
        raise ValueError(f"this node holds the addresses of etcd members {mine} of --rdzv-endpoint; say which "
                         "one it runs with --rdzv-conf etcd_member=K (K from 0), a different K on each node")
    return mine[0] if mine else None
