"""Nothing a peer sends can run code here (Note [plain data] in
tandem/comm/plain_data.py): one rank sends an object whose unpickling would
create a marker file, through every path tandem exchanges objects by (a
GroupComm's all_gather_object, the object collectives the elastic paths use,
the gather and the all-to-all that send tensors as bytes, tandem.recv's spec);
the others refuse it naming that rank, the marker never appears, and plain
data still goes through every path unchanged.

One spawned group of 2 ranks (tandem.testing.run_cases): rank 1 plays the
stranger in each case.
"""

from __future__ import annotations

import collections
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tandem
from tandem.comm.group import GroupComm
from tandem.comm.plain_data import RefusedObjectError, all_gather_ints, all_gather_object, \
    all_to_all_with_tensors, broadcast_object_list
from tandem.testing import Case, CaseResults, run_cases

Point = collections.namedtuple("Point", "x y")


class Marker:
    """Unpickled, it creates the file ``path`` (what a stranger's payload would do, harmlessly)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


_UNWAITED: list[object] = []

PLAIN: dict[str, Any] = {"step": 3, "name": "x", "none": None, "t": torch.arange(4.0),
                         "nested": [(1, 2.5), {"k": True}], "dtype": torch.bfloat16}


def _refused(fn) -> str:
    try:
        fn()
    except RefusedObjectError as e:
        return str(e)
    return "not refused"


def _group_gather(rank: int, world_size: int, marker: str) -> dict[str, object]:
    comm = GroupComm(None)
    plain = comm.all_gather_object({**PLAIN, "rank": rank}, tag="plain")
    sent = Marker(marker) if rank == 1 else {"rank": rank}
    return {"plain": [p["rank"] for p in plain] == [0, 1] and torch.equal(plain[1]["t"], PLAIN["t"]),
            "refused": _refused(lambda: comm.all_gather_object(sent, tag="a stranger's object"))}


def _elastic_collectives(rank: int, world_size: int, marker: str) -> dict[str, object]:
    out: dict[str, object] = {}
    gathered: list[object] = [None] * world_size
    all_gather_object(gathered, {**PLAIN, "rank": rank})
    box: list[object] = [PLAIN if rank == 1 else None]
    broadcast_object_list(box, src=1)
    out["plain"] = [g["rank"] for g in gathered] == [0, 1] and box[0]["name"] == "x"  # type: ignore[index]
    # payloads of unequal lengths on the two ranks: each whole, in one call and in a GroupComm's
    sizes = {"small": 10, "medium": 2048, "long": 6144}
    for name, length in sizes.items():
        mixed: list[object] = [None] * world_size
        all_gather_object(mixed, "x" * (length if rank == 0 else 5))
        grouped = GroupComm(None).all_gather_object("y" * (length if rank == 1 else 5), tag=name)
        out[f"mixed_{name}"] = mixed == ["x" * length, "x" * 5] and grouped == ["y" * 5, "y" * length]
    evil: list[object] = [Marker(marker) if rank == 1 else None]
    out["broadcast"] = _refused(functools.partial(broadcast_object_list, evil, 1))
    out["gather"] = _refused(functools.partial(all_gather_object, [None] * world_size,
                                               Marker(marker) if rank == 1 else rank))
    return out


def _state() -> dict[str, Any]:
    """A state with a tensor of each kind sent as bytes by the gather and the all-to-all, and the rest."""
    return {"model": {"w": torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(3, 4),
                      "b": torch.arange(5, dtype=torch.int32)},
            "flags": torch.tensor([True, False, True]), "scalar": torch.tensor(7.5),
            "half": torch.tensor([1.5, -2.0, 3.25], dtype=torch.float16), "empty": torch.empty(0, 3),
            "transposed": torch.arange(12.0).reshape(3, 4).t(), "rest": [3, "x", None, (1, 2.5)],
            "dtype": torch.bfloat16}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                and a.untyped_storage().nbytes() == a.numel() * a.element_size())  # its own storage, no view
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _exchanged_with_tensors(rank: int, world_size: int, marker: str) -> dict[str, object]:
    # objs[j] goes to rank j: rank 0 sends rank 1 a state of every kind, each rank itself a
    # tensor of a length of its own, and rank 1 sends rank 0 no tensor at all.
    mine: list[Any] = ([{"self": torch.arange(3.0)}, _state()] if rank == 0
                       else [{"from": 1, "rest": (None, "y")}, {"self": torch.arange(5, dtype=torch.int64)}])
    got = all_to_all_with_tensors(mine)
    if rank == 0:
        same = _same(got[0], {"self": torch.arange(3.0)}) and got[1] == {"from": 1, "rest": (None, "y")}
    else:
        same = _same(got[0], _state()) and _same(got[1], {"self": torch.arange(5, dtype=torch.int64)})
    evil = [{"t": torch.ones(2), "evil": Marker(marker)}] * 2 if rank == 1 else [{"t": torch.ones(1)}] * 2
    return {"same": same, "refused": _refused(functools.partial(all_to_all_with_tensors, evil))}


def _recv(rank: int, world_size: int, marker: str) -> dict[str, object]:
    if rank == 1:
        tandem.send({"t": torch.ones(2), "p": Point(torch.zeros(1), 5)}, dst=0)
        # not waited for: a refused spec's data is never received
        _UNWAITED.append(tandem.isend({"t": torch.ones(2), "evil": Marker(marker)}, dst=0))
        dist.barrier()  # rank 0 has read the spec: this rank may leave
        return {}
    got = tandem.recv(src=1)
    plain = isinstance(got["p"], Point) and got["p"].y == 5 and torch.equal(got["t"], torch.ones(2))
    refused = _refused(lambda: tandem.recv(src=1))
    dist.barrier()
    return {"plain": plain, "refused": refused}


def _ints(rank: int, world_size: int) -> dict[str, object]:
    with pytest.raises(ValueError, match="no values to gather"):
        all_gather_ints([])
    return {"one": all_gather_ints([rank + 5]), "wide": all_gather_ints([rank, -rank << 62, 2**63 - 1 - rank])}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[CaseResults, Path]:
    marker = tmp_path_factory.mktemp("stranger") / "MARKER"
    m = str(marker)
    out = run_cases({"group_gather": Case(_group_gather, args=(m,)),
                     "elastic_collectives": Case(_elastic_collectives, args=(m,)),
                     "recv": Case(_recv, args=(m,)),
                     "exchanged_with_tensors": Case(_exchanged_with_tensors, args=(m,)),
                     "ints": Case(_ints)}, 2)
    return out, marker


def test_group_all_gather_object_refuses_code_and_names_the_sender(results) -> None:
    out, marker = results
    for rank, r in enumerate(out["group_gather"]):
        assert r["plain"], rank
        assert f"rank {rank} refused a stranger's object from rank 1" in r["refused"], r["refused"]
        assert "not plain data" in r["refused"]
    assert not marker.exists()


def test_object_collectives_refuse_code_from_the_sender(results) -> None:
    out, marker = results
    r0, r1 = out["elastic_collectives"]
    assert r0["plain"] and r1["plain"]
    for name in ("small", "medium", "long"):  # payloads of unequal lengths
        assert r0[f"mixed_{name}"] and r1[f"mixed_{name}"], name
    assert "rank 0 refused a broadcast_object_list's objects from rank 1" in r0["broadcast"], r0
    assert r1["broadcast"] == "not refused"  # the sender keeps its own objects
    for rank, r in enumerate((r0, r1)):
        assert f"rank {rank} refused an all_gather_object's object from rank 1" in r["gather"], r
    assert not marker.exists()


def test_recv_refuses_a_spec_that_is_not_plain_data(results) -> None:
    out, marker = results
    r0 = out["recv"][0]
    assert r0["plain"]  # a namedtuple of this module still arrives as one
    assert "rank 0 refused the spec of a tandem.recv message from rank 1" in r0["refused"], r0
    assert not marker.exists()


def test_objects_exchanged_with_their_tensors_as_bytes_arrive_equal_and_refuse_code(results) -> None:
    # all_to_all_with_tensors: each rank gets what every rank sent it, of unequal lengths, each
    # tensor equal, of its dtype and shape, in a storage of its own; code is refused by its receivers.
    out, marker = results
    for rank, r in enumerate(out["exchanged_with_tensors"]):
        assert r["same"], rank
        assert f"rank {rank} refused an all_to_all's tensor-free part from rank 1" in r["refused"], r
    assert not marker.exists()


def test_all_gather_ints_gives_every_rank_each_ranks_numbers_in_rank_order(results) -> None:
    out, _ = results
    for r in out["ints"]:
        assert r["one"] == [[5], [6]]
        assert r["wide"] == [[0, 0, 2**63 - 1], [1, -1 << 62, 2**63 - 2]]
