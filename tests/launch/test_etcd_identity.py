"""The pieces of ``--rdzv-backend etcd`` that need no namespaces (Note [a
replicated control plane] in tandem/launch/etcd_plane.py): a member started by
:class:`EtcdControlPlane` serves only clients whose certificate the same job
secret made, and says so to one with another; which endpoint a node runs;
nothing of it left once it is closed."""

from __future__ import annotations

import datetime
import shutil
import socket
from pathlib import Path

import pytest

from tandem.store.etcd_gateway import EtcdCertificateError
from tandem.store.store_address import EtcdAddress
from tandem.launch.etcd_plane import EtcdControlPlane, node_identity


def _missing() -> str | None:
    if shutil.which("etcd") is None:
        return "the etcd binary is not installed (apt-get install etcd-server; .ci/run installs it)"
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return "the certificates are made with cryptography, which is not installed"
    return None


def _free_port() -> int:
    # a client port whose next port (the member's peer port) is free too
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return int(port)
    raise RuntimeError("no two free ports in a row")


@pytest.mark.skipif(_missing() is not None, reason=str(_missing()))
def test_a_member_serves_the_job_secret_s_clients_and_refuses_another_secret_s(tmp_path: Path) -> None:
    plane = EtcdControlPlane(f"127.0.0.1:{_free_port()}", "ident", b"the job's secret" * 2, member="0")
    try:
        plane.start()
        assert plane.member is not None and plane.member.pid is not None
        store = plane.store("workers/x", datetime.timedelta(seconds=20))
        store.set("k", "v")
        assert store.get("k") == b"v"
        # Another node of the same job makes its own identity from the same secret: trusted.
        other = node_identity(b"the job's secret" * 2, tmp_path / "other", "127.0.0.1")
        assert EtcdAddress(tuple(plane.endpoints), "tandem/ident/workers/x", str(other)).store(
            datetime.timedelta(seconds=5)).get("k") == b"v"
        # Another secret: refused at once, saying so.
        stranger = node_identity(b"another secret!!" * 2, tmp_path / "stranger", "127.0.0.1")
        with pytest.raises(EtcdCertificateError, match="refused this node's certificate|does not trust"):
            EtcdAddress(tuple(plane.endpoints), "tandem/ident/workers/x", str(stranger)).store(
                datetime.timedelta(seconds=5)).get("k")
    finally:
        plane.close()
    assert not plane.directory.exists()
    assert plane.member is not None and plane.member.pid is None


def test_which_member_a_node_runs() -> None:
    with pytest.raises(ValueError, match="odd number"):
        EtcdControlPlane("127.0.0.1:2379,127.0.0.1:2381", "r", b"s" * 32, member="0")
    with pytest.raises(ValueError, match=r"etcd_member='5': expected 0..2"):
        EtcdControlPlane("127.0.0.1:2379,127.0.0.1:2381,127.0.0.1:2383", "r", b"s" * 32, member="5")
    if _missing() is None:
        plane = EtcdControlPlane("127.0.0.1:2379,127.0.0.1:2381,127.0.0.1:2383", "r", b"s" * 32, member="none")
        try:
            assert plane.member is None and (plane.tls_dir / "node.crt").exists()
        finally:
            plane.close()
