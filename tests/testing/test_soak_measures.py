"""The soak's measures of its events (Note [soak] in tandem/testing/soak.py), on
events written here: no job runs."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.testing.soak import _admission_stops, _undisturbed_step


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


def test_the_pace_leaves_out_the_steps_a_replacements_imports_slow() -> None:
    # A kill every 10 s, seen 0.03 s later; steps of 0.03 s, but of 0.036 s from 1 to 5 s after
    # each change (the next spare imports then). The pace is the undisturbed 0.03: with only a
    # second before a window left out (the rule before 2026-12-01), two of the three windows
    # counted in each 10 s held slowed steps, and their median was a slowed one.
    changes = [{"seen_at": 10.0 * k} for k in range(1, 6)]
    times, t = [], 0.0
    while t < 60.0:
        times.append(t)
        t += 0.036 if any(1.0 <= t - c["seen_at"] < 5.0 for c in changes) else 0.03
    commits = {s: {"t": at, "gen": 0, "step": s} for s, at in enumerate(times)}
    worlds = {(0, s): 4 for s in commits}
    kills = [(c["seen_at"] - 0.03, 100 + k) for k, c in enumerate(changes)]
    assert _undisturbed_step(commits, worlds, 4, kills, changes) == pytest.approx(0.03)
