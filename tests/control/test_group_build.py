"""A generation's gloo backend built on a thread of its own (Note [a death
while the group is built] in tandem/control/elastic_group.py): the parts that
need no second process. A member's death during the build is in
tests/elastic/test_elastic.py (``lost-after-arriving``)."""

from __future__ import annotations

import datetime
import gc

import pytest
import torch
import torch.distributed as dist

from tandem._compat import given_gloo_backend, own_tcp_client
from tandem.comm.connections import _is_same, opened_connections
from tandem.control.elastic_group import _BuildStore, _GlooBuild
from tandem.control.generation import Generation
from tandem.store.job_secret import SignedStore

TIMEOUT = datetime.timedelta(seconds=10)
GENERATION = Generation(1, ("0",))


def _client_of(server: dist.TCPStore) -> dist.Store:
    """A connection of its own to ``server``, as a member's build opens one."""
    own = own_tcp_client(server)
    assert own is not None, "torch 2.7 or later (Store.clone), as constraints.txt pins"
    return own[0]


def test_a_built_backend_lets_its_store_connection_go() -> None:
    """Without the release, each world change would leave one more connection
    per member open on the store's host: a forgotten group lives as long as
    the process, and its backend holds its store."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, TIMEOUT)
    with opened_connections() as opened:
        build = _GlooBuild(_BuildStore(_client_of(server), GENERATION, "group"), 0, 1, TIMEOUT, "group")
        assert build.done.wait(10)
    backend = build.result()
    to_store = [c for c in opened if c.ports[1] == server.port]
    assert len(to_store) == 1 and _is_same(to_store[0])  # the build's own connection to the store
    build.store.release()
    gc.collect()
    assert not _is_same(to_store[0])  # closed, while the backend lives on
    with pytest.raises(RuntimeError, match="released once the group was built"):
        build.store.get("anything")
    del backend


def test_a_build_records_the_connections_it_opened() -> None:
    """A group built ahead is taken after its connections were opened, so the
    build records them: else a forgotten group built ahead would never be cut
    (Note [severing a forgotten group] in tandem/comm/connections.py), and a
    collective left in it would end when its peer exits, maybe as this process
    finalizes (SIGABRT)."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, TIMEOUT)
    generation = Generation(1, ("0", "1"))
    clients = [_client_of(server) for _ in range(2)]
    builds = [_GlooBuild(_BuildStore(client, generation, "group"), r, 2, TIMEOUT, "group")
              for r, client in enumerate(clients)]
    assert all(build.done.wait(10) for build in builds)
    backends = [build.result() for build in builds]
    for build in builds:  # the pair between the two ranks, seen from each side, and still open
        assert build.connections and all(_is_same(c) for c in build.connections), build.connections
        assert all(server.port not in c.ports for c in build.connections)
    del backends


def test_torch_builds_the_group_around_the_given_backend() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, TIMEOUT)
    build = _GlooBuild(_BuildStore(_client_of(server), GENERATION, "group"), 0, 1, TIMEOUT, "group")
    assert build.done.wait(10)
    given = build.result()
    with given_gloo_backend(given):
        dist.init_process_group("gloo", store=dist.PrefixStore("g/1/pg", server), rank=0, world_size=1)
    try:
        assert dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")) is given
        assert dist.distributed_c10d.ProcessGroupGloo is dist.ProcessGroupGloo  # put back
    finally:
        dist.destroy_process_group()


def test_a_group_torch_built_otherwise_is_said_so() -> None:
    with pytest.raises(RuntimeError, match="torch created no gloo backend where tandem gave it one"):
        with given_gloo_backend(object()):
            pass  # nothing built: the backend given was never taken
    assert dist.distributed_c10d.ProcessGroupGloo is dist.ProcessGroupGloo


def test_a_build_over_a_signed_connection_answers_after_its_maker_let_it_go() -> None:
    """A signed store is a store of Python's: below torch's PrefixStore it answers
    only while its Python object lives. A member building ahead keeps no reference
    of its own to its connection (Note [a group built ahead]); the build's store does."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, TIMEOUT)
    store = _BuildStore(SignedStore(_client_of(server), b"a job secret for the tests", "the test's store"),
                        GENERATION, "group")
    gc.collect()
    store.set("key", "value")
    assert store.get("key") == b"value"
