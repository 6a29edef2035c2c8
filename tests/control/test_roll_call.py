"""The roll call of a world change (Note [a roll call] in tandem/control/membership.py), on an in-process store."""

from __future__ import annotations

import torch.distributed as dist

from tandem.control.roll_call import RollCall, waited


def test_an_arrival_whose_id_is_not_written_hides_no_later_one() -> None:
    # A member that drew its number and died before writing its id (or has not written it
    # yet) must not keep the judges from seeing those that came after it.
    store = dist.HashStore()
    roll = RollCall(store, "g/1/regroup")
    assert roll.arrive("a") == 1 and roll.arrive("b") == 2
    assert store.add("g/1/regroup/count", 1) == 3  # drew 3, wrote nothing
    assert roll.arrive("c") == 4
    assert roll.arrived() == ["a", "b", "c"]
    assert roll.arrived() == ["a", "b", "c"]  # read once each
    store.set("g/1/regroup/at/3", "late")
    assert roll.arrived() == ["a", "b", "c", "late"]
    assert RollCall(store, "g/1/regroup").arrived() == ["a", "b", "late", "c"]  # a new reader: in number order


def test_the_first_outcome_stands_and_a_wait_without_one_times_out() -> None:
    store = dist.HashStore()
    roll = RollCall(store, "g/1/arrived/group")
    assert roll.outcome(0.01) is None and not waited(store, [roll.outcome_key], 0.01)
    assert roll.decide("all") == "all"
    assert roll.decide('{"2": "has died"}') == "all"
    assert roll.outcome(0.01) == "all" and waited(store, [roll.outcome_key], 0.01)
