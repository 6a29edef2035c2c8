"""What the members of an elastic job agree on, and by which settings:
:class:`Generation` (one membership of the job), :class:`Decision` (a step's),
:class:`ElasticConfig`, the errors of the agreement, and :data:`PREFIX`, where
its keys are in the job's store (Note [elastic membership] in membership.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum

from tandem.comm.peers import QUICK_SLICE_S, WAIT_SLICE_S, Liveness

__all__ = ["PREFIX", "Decision", "ElasticConfig", "Generation", "MembershipError", "NothingToJoin"]

PREFIX = "tandem/elastic"
"""Where the membership's keys are in the job's store."""
_MONITOR_BEATS_A_WINDOW = 5  # an elastic job's monitor beats (ElasticConfig.liveness)


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """How an elastic job notices a loss and regroups.

    Raises:
        ValueError: a field is out of range.
    """

    min_world_size: int = 1
    """The fewest ranks worth going on with; below it the survivors stop with an error."""
    beat_s: float = 0.25
    """How often each member writes its heartbeat."""
    stale_after_s: float = 10.0  # Note [deaths seen at once] in tandem/comm/process_id.py
    """A heartbeat this old means its member is dead: the deaths nobody saw
    (a host lost with its launcher, a cut link). A process that ended is seen
    at once, from its kernel or its launcher; a rank paused for less than this
    is not counted dead."""
    regroup_timeout_s: float = 300.0
    """How long the survivors wait for every member to be accounted for (arrived
    or dead) before giving up."""
    connect_timeout_s: float = 30.0  # Note [arrivals] in elastic_group.py
    """How long building a generation's group may take once every member has
    arrived. A member that dies between its arrival and its connection fails
    the change at once where the group's backend is built on a thread of its
    own (gloo; Note [a death while the group is built] in elastic_group.py),
    else after this long, not after the group's timeout."""

    def __post_init__(self) -> None:
        if self.min_world_size < 1:
            raise ValueError(f"ElasticConfig: min_world_size must be >= 1, got {self.min_world_size}")
        for name in ("beat_s", "stale_after_s", "regroup_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ElasticConfig: {name} must be > 0, got {getattr(self, name)}")
        if self.stale_after_s < 4 * self.beat_s:
            raise ValueError(f"ElasticConfig: stale_after_s={self.stale_after_s} must be at least four "
                             f"beats (beat_s={self.beat_s}), or a slow beat reads as a death")

    def liveness(self, *, quick: bool = False) -> Liveness:
        """The window a collective's wait judges the peers' beats by, and its
        slices: a beat long at most, so that a death that fails no connection
        of a waiting rank is seen within a beat. Each rank's monitor beats five
        times a window: its beat is what a watch reads only when it has no
        verdict (Note [a watch reads the verdict] in tandem/comm/peers.py), and
        what tells the rank it is cut off (Note [cut off] in
        tandem/comm/cut_off.py, after twice the window); the deaths are seen
        from the members' or their nodes' beats, ``beat_s`` apart. ``quick``:
        a look reads nothing until something happened, and the slices are
        :data:`~tandem.comm.peers.QUICK_SLICE_S` at most (Note [a quick look]
        in tandem/comm/peers.py)."""
        # Note [dead peers] in tandem/comm/peers.py
        return Liveness(beat_s=self.stale_after_s / _MONITOR_BEATS_A_WINDOW, stale_after_s=self.stale_after_s,
                        slice_s=min(self.beat_s, QUICK_SLICE_S if quick else WAIT_SLICE_S))


class Decision(Enum):
    """What every member does with a step whose reduction it finished."""

    COMMIT = "commit"    # step the optimizer
    PREPARE = "prepare"  # step, and build the next generation's group, with the replacements that wait, meanwhile
    GROW = "grow"        # step, then admit the replacements that wait (their group is built, where it can be)
    ABORT = "abort"      # a member is gone: drop the gradients, regroup, redo the step


@dataclass(frozen=True)
class Generation:
    """One membership of the job: its number and its members in rank order."""

    number: int
    members: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, member: str) -> int:
        return self._ranks[member]

    def has(self, member: str) -> bool:
        return member in self._ranks

    @functools.cached_property
    def _ranks(self) -> dict[str, int]:
        return {m: r for r, m in enumerate(self.members)}

    def joined_since(self, previous: Generation) -> tuple[str, ...]:
        return tuple(m for m in self.members if m not in previous.members)

    def lost_since(self, previous: Generation) -> tuple[str, ...]:
        return tuple(m for m in previous.members if m not in self.members)


class MembershipError(RuntimeError):
    """The job cannot go on elastically: too few members left, this member was
    judged dead by the others, or the regroup timed out."""


class NothingToJoin(MembershipError):
    """A replacement found every member of the job gone: it has finished (or died)."""
