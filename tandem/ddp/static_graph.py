"""``static_graph=True``: what the reducer learns in the first synchronised step
and relies on after it.

# Note [static graph]
The user promises that every step runs the same graph. The first synchronised
backward learns it: how many times each parameter's hook fires (a parameter
used twice in forward gets two gradients, summed by autograd and seen twice by
the hook), and which parameters some rank used (the used map is all-reduced once,
in that step). In that step every gradient waits for the end of backward, where
all are marked and launched. From the second step on, a parameter is ready
when its hook has fired the learned number of times, and the parameters no rank
used are marked unused as soon as backward starts: no graph walk and no used map.
"""

from __future__ import annotations

__all__ = ["StaticGraph"]


class StaticGraph:
    """Hook counts and the used map of a static graph (Note [static graph])."""

    def __init__(self, num_params: int) -> None:
        self._counts = [0] * num_params
        self.expected: list[int] | None = None   # per param, learned in step one
        self.used: list[int] | None = None       # per param: ranks that used it in step one

    @property
    def learning(self) -> bool:
        """Whether this is the step that learns the graph."""
        return self.expected is None

    def start_step(self) -> None:
        self._counts = [0] * len(self._counts)

    def count(self, i: int) -> bool:
        """Parameter ``i``'s hook fired: whether its gradient is now final (never
        while learning: every gradient waits for the end of backward; a hook
        that fires more often than learned is the reducer's to report)."""
        self._counts[i] += 1
        return self.expected is not None and self._counts[i] >= self.expected[i]

    def first_arrival(self, i: int) -> bool:
        """Whether the hook just fired for the first time in this step."""
        return self._counts[i] == 1

    def learn(self) -> list[int]:
        """End of the learning step: remember the counts; returns the parameters
        whose hooks fired, to be marked ready now."""
        self.expected = list(self._counts)
        return [i for i, n in enumerate(self._counts) if n]

    def unused(self) -> list[int]:
        """Parameters no rank used in step one: marked unused when backward starts."""
        assert self.used is not None, "the used map is learned in step one"
        return [i for i, n in enumerate(self.used) if not n]
