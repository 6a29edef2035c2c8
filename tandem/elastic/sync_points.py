"""Where an elastic job with local steps goes back to when the world changes:
:class:`SyncPoints`.

# Note [elastic local steps]
Between two syncs of DiLoCo (Note [local steps and the outer step] in
tandem/diloco/diloco.py) each rank's steps live in its own parameters only:
a rank that dies takes its steps since the last sync with it, and the samples
it trained on with them. So a change of world takes every rank back to the
last sync, and the window since is trained again by the new world, on the
same samples (the loaders go back to the positions the sync had committed,
and split the rest over the new world: Note [exact split] in
tandem/data/split.py). Nothing is lost and nothing is counted twice, at the
price of the window's steps (at most ``sync_every``, on every rank).

After each sync, each rank keeps a point: the DiLoCo state (the synced
parameters, the outer optimizer, the residual), its inner optimizer's state,
the loop's (the loaders' committed positions, the RNG, the registered
objects) and the step. A rank can be one sync ahead of another: the sync's
all-reduce completes on one and fails on the other when a peer dies in it.
So each rank keeps its last two points, the ranks of the new world gather the
steps they hold, and all go back to the latest one they all hold (a
completed sync on every survivor is the same average everywhere). The
parameters are set to the synced ones; a replacement then receives rank 0's
state, which is the point's, whole.

A window must not cross an epoch's end (the loop has left that epoch's
iteration, and its samples could not come again): in an elastic job every
epoch's end is a sync too (:meth:`tandem.DiLoCo.sync_now`), and a replacement
is admitted only right after a sync. Only syncs of the whole model at once
can be gone back to (one fragment, no overlap, no mix). What it costs: one
more copy of the synced parameters and of both optimizers' states per point.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from tandem.comm.group import GroupComm
from tandem.control.generation import MembershipError
from tandem.comm.plain_data import all_gather_object
from tandem.comm.watched_call import watched
from tandem.checkpoint.state import TrainingState
from tandem.diloco import DiLoCo
from tandem.elastic.run import Resumed

__all__ = ["SyncPoints"]


class SyncPoints:
    """A rank's last two syncs, to go back to (Note [elastic local steps]).

    Args:
        diloco: what syncs the local steps.
        optimizer: the inner optimizer.
        state: the loop's counters; ``state.step`` counts committed steps.
        loop: captures and restores the loop's own state (``capture()`` /
            ``restore(point)``, as :class:`~tandem.elastic.world.LoopPoints`, and
            ``complete()``: the registered objects of the last point, taken as
            the next step is decided).
    """

    def __init__(self, diloco: DiLoCo, optimizer: torch.optim.Optimizer, state: TrainingState, loop: Any) -> None:
        self.diloco, self._optimizer, self._state, self._loop = diloco, optimizer, state, loop
        self._points: list[tuple[int, dict[str, Any]]] = []  # (committed steps, what to go back to)

    def committed(self) -> bool:
        """A step committed: keep it if it synced. Returns whether the ranks are at
        a sync now, where a replacement may be admitted."""
        at_sync = self.diloco.synced_at == self.diloco.step
        if at_sync:
            self.capture()
        return at_sync

    def epoch_end(self) -> None:
        """An epoch ends: sync there, so that no window crosses it."""
        self.diloco.sync_now()
        self.capture()

    def regroup(self, has_state: bool) -> Resumed | None:
        """A new world (a collective of it): sync over it from now on, and go back
        to the latest sync every rank holds (:meth:`go_back`). Returns where the
        state went back to, if it did."""
        self.diloco.reset_process_group(GroupComm(None))
        was_at = self._state.step
        step = self.go_back(has_state)
        return None if step is None or step == was_at else Resumed(step, checkpoint=False)

    def capture(self) -> None:
        """Keep this rank's state now, right after a sync."""
        step = self._state.step
        point = {"diloco": copy.deepcopy(self.diloco.state_dict()),
                 "optimizer": copy.deepcopy(self._optimizer.state_dict()), "loop": self._loop.capture()}
        self._points = [*[p for p in self._points if p[0] != step][-1:], (step, point)]

    @property
    def steps(self) -> list[int]:
        return [step for step, _ in self._points]

    def go_back(self, has_state: bool) -> int | None:
        """On every rank of a new world (a collective): go back to the latest sync
        every rank with a state holds. ``has_state`` is False on a replacement
        whose state has not arrived. Returns the step gone back to (None on such
        a replacement)."""
        rank = dist.get_rank()
        held: list[Any] = [None] * dist.get_world_size()
        watched("all_gather_object of the sync points", all_gather_object, held, self.steps if has_state else None)
        common = set.intersection(*(set(h) for h in held if h is not None))
        if not common:
            raise MembershipError(f"rank {rank}: the ranks hold syncs at steps {held}, none in common: "
                                  "the job cannot go back to one; restart it from your last checkpoint")
        if not has_state:
            return None
        step = max(common)
        point = dict(self._points)[step]
        self._loop.complete()  # the registered objects as the loop left them, if no step was decided since
        self.diloco.load_state_dict(copy.deepcopy(point["diloco"]))
        self.diloco.take_synced()
        self._optimizer.load_state_dict(copy.deepcopy(point["optimizer"]))
        self._loop.restore(point["loop"])
        self._state.step = step
        self._points = [(s, p) for s, p in self._points if s <= step]
        return step
