"""The soak's measures of its events (Note [soak] in tandem/testing/soak.py), on
events written here: no job runs."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.testing.soak import _admission_stops


def _commits(times: list[float], switch: int) -> dict[int, dict[str, Any]]:
    """Commit ``s`` at ``times[s]``, in generation 1 before step ``switch`` and 2 from it."""
    return {s: {"t": t, "gen": 1 if s < switch else 2, "step": s} for s, t in enumerate(times)}


def test_an_admission_stops_the_members_from_the_old_worlds_last_commit_to_the_new_ones_first() -> None:
    # Steps of 0.1 s; the new world's first step (3) commits 0.35 s after the old world's
    # last (2): 0.25 s more than a step. A member's regroup_s (0.05) leaves out that its first
    # step waited for the replacement.
    commits = _commits([0.0, 0.1, 0.2, 0.55, 0.65], switch=3)
    admission = {"step": 3, "generation": 2, "joined": ["j1"], "lost_ranks": [], "regroup_s": 0.05}
    assert _admission_stops(commits, [admission], pace_s=0.1) == [pytest.approx(0.25)]


def test_an_admission_another_change_followed_before_its_first_step_is_left_out() -> None:
    commits = _commits([0.0, 0.1, 0.2, 0.9], switch=3)  # step 3 committed in generation 2...
    admission = {"step": 3, "generation": 1, "joined": ["j1"], "lost_ranks": []}  # ...not the admission's
    assert _admission_stops(commits, [admission], pace_s=0.1) == []
    assert _admission_stops(commits, [{**admission, "step": 4, "generation": 2}], pace_s=0.1) == []
