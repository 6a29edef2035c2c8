"""Where the members of a new world go on from (Note [an epoch's end seen apart]
in tandem/elastic/epoch_end.py); the scenario that needs it is in test_elastic.py."""

from __future__ import annotations

import pytest

from tandem.elastic.epoch_end import agreed_place


def test_an_epoch_counted_by_some_members_is_taken_back() -> None:
    assert agreed_place([(0, 48), (1, 0), (1, 0)], 48) == (0, 48)
    assert agreed_place([(1, 0), None, (0, 48)], 48) == (0, 48)  # a replacement's place does not count
    assert agreed_place([(0, 42), (1, 0)], 42) == (0, 42)  # an epoch that ends before the dataset does
    assert agreed_place([(2, 12), (2, 12), None], 48) == (2, 12)


def test_any_other_difference_stops_the_job_naming_the_places() -> None:
    with pytest.raises(RuntimeError, match=r"rank 0: epoch 0, 36 samples consumed, rank 1: epoch 0, 42"):
        agreed_place([(0, 36), (0, 42)], 48)  # a step committed on one rank only: never papered over
    with pytest.raises(RuntimeError, match="epoch 2, 0 samples"):
        agreed_place([(0, 48), (2, 0)], 48)
    with pytest.raises(RuntimeError, match="no rank"):
        agreed_place([None, None], 48)
