"""Streaming DiLoCo's fragments and their schedule (Note [fragments and their
schedule] in tandem/diloco/fragments.py), on grids of sizes, in one process."""

from __future__ import annotations

import itertools

import pytest

from tandem.diloco.fragments import fragments_due, plan_fragments


@pytest.mark.parametrize("numels", [[1], [5, 5, 5, 5], [100, 1, 1, 1], [1, 1, 1, 100], [0, 0, 3], [7] * 9,
                                    [1000, 10, 1000, 10, 1000, 10], list(range(1, 20))])
def test_every_parameter_once_in_runs_of_consecutive_parameters_none_empty(numels: list[int]) -> None:
    for count in range(1, len(numels) + 1):
        plan = plan_fragments(numels, count)
        assert len(plan) == count and all(plan)
        assert list(itertools.chain(*plan)) == list(range(len(numels)))  # consecutive, in order, each once
        if len(set(numels)) == 1:  # equal parameters: fragments differ by at most one parameter
            sizes = [len(f) for f in plan]
            assert max(sizes) - min(sizes) <= 1, plan


def test_fragments_of_about_equal_size() -> None:
    assert plan_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert plan_fragments([1000, 10, 1000, 10, 1000, 10], 3) == [[0, 1], [2, 3], [4, 5]]


def test_more_fragments_than_parameters_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="fragments=3 is more than the model's 2 parameters"):
        plan_fragments([4, 4], 3)


@pytest.mark.parametrize("sync_every,count", [(1, 1), (4, 1), (4, 2), (4, 4), (6, 3), (10, 3), (7, 2)])
def test_each_fragment_syncs_once_every_h_steps_the_last_at_the_h_th(sync_every: int, count: int) -> None:
    due = {t: fragments_due(t, sync_every, count) for t in range(1, 3 * sync_every + 1)}
    for f in range(count):
        steps = [t for t, fs in due.items() if f in fs]
        assert len(steps) == 3 and steps[1] - steps[0] == steps[2] - steps[1] == sync_every, (f, steps)
    assert due[sync_every][-1] == count - 1  # the last fragment at the H-th step, as DiLoCo's one
    if count <= sync_every:
        assert all(len(fs) <= 1 for fs in due.values())  # one fragment at a time
