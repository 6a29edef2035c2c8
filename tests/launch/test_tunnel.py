"""The stores of a job of several nodes behind TLS (Note [stores behind TLS]
in tandem/launch/tunnel.py), on this machine's loopback: a store served by one
set of tunnels and reached through another, as two nodes' launchers do. The
namespace test of a stranger on a third node is in test_cluster_faults.py.

Also, for ``--open-stores``: torch's rendezvous state signed, so that a
stranger who lists the store's keys and overwrites each with a pickle runs no
code (Note [the rendezvous' state] in tandem/launch/signed_rendezvous.py)."""

from __future__ import annotations

import dataclasses
import datetime
import pickle
import socket
import threading
import time
from pathlib import Path
from typing import cast

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters

from tandem.store.job_secret import new_secret
from tandem.store.listening_store import listening_store
from tandem.launch.agent import _tunnels
from tandem.launch.config import LaunchConfig
from tandem.launch.signed_rendezvous import rendezvous_handler
from tandem.launch import tunnel
from tandem.launch.tunnel import STUNNEL_MISSING, SecretDiffersError, TunnelError, Tunnels

TIMEOUT = datetime.timedelta(seconds=10)
SECRET = new_secret().encode()


@pytest.fixture
def served():
    """A store on loopback, served behind TLS by one node's tunnels; the refusal lines they logged."""
    store = listening_store("127.0.0.1", 0, timeout=TIMEOUT)
    lines: list[str] = []
    with Tunnels(SECRET, on_refused=lines.append) as hosting:
        public = hosting.serve("127.0.0.1", 0, store.port, "the workers' store")
        yield store, public, lines


def _wait_for(check, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_node_with_the_secret_reaches_the_store_through_its_tunnel(served) -> None:
    store, public, lines = served
    with Tunnels(SECRET) as other:
        local = other.reach("127.0.0.1", public, "the workers' store", timeout_s=10)
        assert local[0] == "127.0.0.1" and local[1] not in (public, store.port)
        client = dist.TCPStore(*local, None, False, TIMEOUT)
        client.set("through", cast(str, b"tls"))  # a store takes bytes; torch's stubs say str
        assert store.get("through") == b"tls"
        store.set("back", b"again")
        assert client.get("back") == b"again" and client.add("n", 5) == 5
        assert other.reach("127.0.0.1", public, "the workers' store", timeout_s=10) == local  # one tunnel
    assert lines == []


def test_a_client_without_the_secret_opens_no_session(served) -> None:
    store, public, lines = served
    store.set("secret-key", b"value")
    with pytest.raises(dist.DistError):
        dist.TCPStore("127.0.0.1", public, None, False, datetime.timedelta(seconds=1))
    for data in (pickle.dumps({"x": 1}), b"\xff" * 4096):
        with socket.create_connection(("127.0.0.1", public)) as s:
            s.sendall(data)
    _wait_for(lambda: len(lines) == 1, "the refusal's line")
    assert lines == ["refused a connection from 127.0.0.1 to the workers' store: it did not open TLS "
                     "with this job's secret (more like it are refused silently)"]
    assert store.get("secret-key") == b"value" and store.num_keys() == 1  # nothing written


def test_a_node_with_another_secret_is_told_at_once_and_logged_once(served) -> None:
    _, public, lines = served
    with Tunnels(b"another secret") as wrong:
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(SecretDiffersError) as told:
                wrong.reach("127.0.0.1", public, "the workers' store", timeout_s=30)
            assert time.monotonic() - started < 10
            assert str(told.value).startswith("this job's secret differs from yours: the workers' store at "
                                              f"127.0.0.1:{public} refused this node's TLS handshake")
            assert "TANDEM_JOB_SECRET_FILE" in str(told.value)
    _wait_for(lambda: len(lines) == 1, "the refusal's line")
    assert lines == ["refused a connection from 127.0.0.1 to the workers' store: its job secret "
                     "differs from this job's (more like it are refused silently)"]


def test_a_store_not_up_yet_is_waited_for_and_one_never_up_fails_naming_it() -> None:
    store = listening_store("127.0.0.1", 0, timeout=TIMEOUT)
    with Tunnels(SECRET) as hosting, Tunnels(SECRET) as other:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with pytest.raises(TunnelError, match=f"the rendezvous store at 127.0.0.1:{port} could not be reached "
                                              "through TLS within 0.5 s"):
            other.reach("127.0.0.1", port, "the rendezvous store", timeout_s=0.5)
        hosting.serve("127.0.0.1", port, store.port, "the rendezvous store")
        local = other.reach("127.0.0.1", port, "the rendezvous store", timeout_s=10)
        assert dist.TCPStore(*local, None, False, TIMEOUT).add("up", 1) == 1
        # The node that serves it reaches it on loopback, with no tunnel of its own.
        assert hosting.reach("127.0.0.1", port, "the rendezvous store", timeout_s=1) == ("127.0.0.1", store.port)


def test_a_tunnel_closed_while_its_log_is_read_raises_nothing_in_the_reader(monkeypatch) -> None:
    """Note [the log's reader owns the pipe] in tandem/launch/tunnel.py: the
    reader is held inside a log line while the launcher closes the tunnel; when
    it goes on, the log it reads is still open, it reads to the end and closes
    it, and no thread dies of "I/O operation on closed file" (printed last in
    the output of a launcher whose rendezvous gave up)."""
    inside, release = threading.Event(), threading.Event()
    event = tunnel._Stunnel._event

    def held(self: tunnel._Stunnel, conn: str, text: str) -> None:
        inside.set()
        assert release.wait(30)
        event(self, conn, text)

    died: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    monkeypatch.setattr(tunnel._Stunnel, "_event", held)
    monkeypatch.setattr(tunnel, "_READER_JOIN_S", 0.05)  # close() gives up on the held reader at once
    store = listening_store("127.0.0.1", 0, timeout=TIMEOUT)
    hosting = Tunnels(SECRET)
    public = hosting.serve("127.0.0.1", 0, store.port, "the store")
    served = hosting._served[("127.0.0.1", public)][0]
    with socket.create_connection(("127.0.0.1", public), timeout=10):
        assert inside.wait(10), "the tunnel logged no line for a connection"
    hosting.close()
    assert served._reader is not None and served._reader.is_alive()
    release.set()
    served._reader.join(10)
    assert not served._reader.is_alive() and died == []
    assert served._proc.stdout is not None and served._proc.stdout.closed


def test_without_stunnel_a_job_of_several_nodes_says_what_to_do(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(TunnelError) as told:
        Tunnels(SECRET)
    assert str(told.value) == STUNNEL_MISSING and "--open-stores" in STUNNEL_MISSING


def test_tunnels_only_for_several_nodes_with_a_secret_and_not_with_open_stores() -> None:
    one, many = (LaunchConfig(nproc_per_node=1, min_nodes=n, max_nodes=n, rdzv_endpoint="10.0.0.1:29400")
                 for n in (1, 2))
    assert _tunnels(one, SECRET, None) is None
    assert _tunnels(dataclasses.replace(many, open_stores=True), SECRET, None) is None
    assert _tunnels(many, None, None) is None  # refused elsewhere: a job of several nodes needs a secret
    tunnels = _tunnels(many, SECRET, None)
    assert isinstance(tunnels, Tunnels)
    tunnels.close()


class Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.path, "w"))


def test_open_stores_a_stranger_who_overwrites_every_listed_key_runs_no_code(tmp_path: Path) -> None:
    port = listening_store("127.0.0.1", 0, timeout=TIMEOUT).port  # a free port: closed when dropped
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="open", min_nodes=1,
                                  max_nodes=2, is_host=True, read_timeout=5)
    handler = rendezvous_handler(params, secret=SECRET, many_nodes=False)
    assert handler.num_nodes_waiting() == 0  # its state is written
    stranger = dist.TCPStore("127.0.0.1", port, None, False, TIMEOUT)
    keys = stranger.list_keys()
    assert keys, "the stranger lists the keys (the store is open)"
    marker = tmp_path / "ran"
    for key in keys:
        stranger.set(key, cast(str, pickle.dumps(Marker(str(marker)))))  # bytes, as above
    refused = None
    deadline = time.monotonic() + 10
    while refused is None and time.monotonic() < deadline:  # torch's handler reads its state at most once a second
        try:
            handler.num_nodes_waiting()
        except Exception as e:  # noqa: BLE001 - torch wraps the refusal in its own errors
            refused = e
    assert not marker.exists()
    assert refused is not None and "not signed with this job's secret" in repr(refused) + repr(refused.__cause__)
    handler.shutdown()
