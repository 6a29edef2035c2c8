"""Which shards a world change assembles (``tandem.elastic.buddy``), with no processes:
the newest step at which every old rank's shard of one layout is offered, never
shards of two world sizes together (Note [a change cut short after its shards
moved]), and a rank's own shards taken once a change, until it has loaded the new
world's."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.elastic.buddy import BuddyCopies, ShardsLost, _choose


def test_the_newest_complete_step_is_chosen_and_one_step_back_when_a_copy_is_missing() -> None:
    # three old ranks; new rank 0 holds old 0 (steps 5 and 4) and old 2's copy of step 4
    headers = [[(5, 0, 3), (4, 0, 3), (4, 2, 3)], [(5, 1, 3), (4, 1, 3)]]
    assert _choose(headers) == (4, {0: (0, 1), 2: (0, 2), 1: (1, 1)})
    headers[0].append((5, 2, 3))
    assert _choose(headers) == (5, {0: (0, 0), 1: (1, 0), 2: (0, 3)})


def test_shards_of_two_world_sizes_at_one_step_are_never_assembled_together() -> None:
    # At step 7 new rank 0 offers old rank 0 of a world of 3, new rank 1 old ranks 1 and 2 of
    # a world of 4: by step alone they would cover "every old rank" of either.
    mixed = [[(7, 0, 3), (7, 3, 4)], [(7, 1, 4), (7, 2, 4)]]
    with pytest.raises(ShardsLost, match=r"the shards of old ranks \[0\] of world 4 are on no survivor"):
        _choose(mixed)
    mixed[1].append((7, 0, 4))  # the world of 4 complete: taken, the lone shard of 3 left
    assert _choose(mixed) == (7, {3: (0, 1), 1: (1, 0), 2: (1, 1), 0: (1, 2)})
    # an older step of a complete layout is taken over a newer incomplete one
    assert _choose([[(8, 0, 2), (6, 0, 2)], [(6, 1, 2)]]) == (6, {0: (0, 1), 1: (1, 0)})


def test_two_complete_layouts_at_one_step_give_every_rank_the_same_choice() -> None:
    headers = [[(3, 0, 2), (3, 0, 1)], [(3, 1, 2)]]
    assert _choose(headers) == (3, {0: (0, 0), 1: (1, 0)})  # the larger world's
    assert _choose([[(3, 0, 1)], [(3, 1, 2), (3, 0, 2)]]) == (3, {1: (1, 0), 0: (1, 1)})


def test_a_ranks_own_shards_are_taken_once_a_change_and_the_new_worlds_added_once_loaded() -> None:
    buddy = BuddyCopies()
    taken: list[int] = []

    def take() -> list[tuple[int, dict[str, Any]]]:
        taken.append(len(taken))
        return [(7, {"rank": 0, "world_size": 2 + len(taken)})]

    old = buddy.own_shard(take)
    assert buddy.own_shard(take) == old == [(7, {"rank": 0, "world_size": 3})]  # an attempt cut short: the same
    buddy.keep_own(7, {"rank": 0}, live=False)
    buddy.laid_out()  # the new world's loaded: a later attempt offers both layouts
    assert buddy.kept is None
    assert buddy.own_shard(take) == [(7, {"rank": 0, "world_size": 3}), (7, {"rank": 0, "world_size": 4})]
    buddy.refresh({"rank": 0}, 7, ("0",), 0)  # copies current (a world of one holds none): taken anew
    assert buddy.own_shard(take) == [(7, {"rank": 0, "world_size": 5})]


def test_a_grows_old_shards_are_offered_until_its_second_copies_arrive(monkeypatch: pytest.MonkeyPatch) -> None:
    # Note [a grow's copies ride on its first step]: old rank 1 of 2 grows into rank 1 of 3
    # with no copies sent; its own shard of step 7 and its copy of old rank 0's cover the new
    # world until its second copies arrive.
    import tandem.elastic.buddy as buddy_module

    arriving: list[dict[str, Any]] = []
    monkeypatch.setattr(buddy_module, "isend", lambda obj, to: type("Sent", (), {"wait": lambda self: None})())
    monkeypatch.setattr(buddy_module, "recv", lambda frm: arriving.pop(0))
    buddy = BuddyCopies()
    arriving.append({"step": 7, "shard": {"rank": 0, "world_size": 2}})
    buddy.refresh({"rank": 1, "world_size": 2}, 7, ("a", "b"), 1)  # a's copy of step 7
    old = [(7, {"rank": 1, "world_size": 2}), (6, {"rank": 1, "world_size": 2})]
    assert buddy.own_shard(lambda: old) == old  # the grow begins
    buddy.laid_out()
    buddy.cover(7)
    new = [(7, {"rank": 1, "world_size": 3})]
    grown = ("a", "b", "j")

    def offered(survivors: tuple[str, ...]) -> list[tuple[int, int, int]]:
        return [(at, s["rank"], s["world_size"]) for at, s in buddy._offered(new, survivors)]

    # a lost in the first step: the new world's shards of step 7 are not all anywhere; the old are
    assert offered(("b", "j")) == [(7, 1, 3), (7, 1, 2), (7, 0, 2)]
    arriving.append({"step": 8, "shard": {"rank": 0, "world_size": 3}})
    buddy.refresh({"rank": 1, "world_size": 3}, 8, grown, 1)  # the first copies: a's of step 8
    assert offered(("b", "j")) == [(7, 1, 3), (7, 1, 2), (8, 0, 3), (7, 0, 2)]
    arriving.append({"step": 9, "shard": {"rank": 0, "world_size": 3}})
    buddy.refresh({"rank": 1, "world_size": 3}, 9, grown, 1)  # the second: the old world's dropped
    assert offered(("b", "j")) == [(7, 1, 3), (9, 0, 3)]
