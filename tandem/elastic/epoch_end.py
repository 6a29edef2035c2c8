"""Where the members of a new world are in the data, agreed: :func:`agreed_place`.

# Note [an epoch's end seen apart]
The Trainer ends an epoch after its last step: the epoch is counted, the
evaluation runs, a checkpoint is saved. A member that sees a loss in the
epoch's last step (its buddy copy to the dead rank fails) goes to regroup
with the epoch's samples all consumed and the epoch not yet counted; a member
that saw nothing there counts it, and sees the loss only in the save's
collective. After the regroup the first would end the epoch (evaluate, save:
collectives) while the second trains the next epoch's first step: each waits
in a collective the other never issues, for as long as the group's timeout (a
ZeRO-2 soak with a failure every 3 s stalled 300 s so).

So the members tell each other their place after every regroup, and those that
counted the epoch take it back: every member ends it again, together. What
the end did on the ranks that got through it is redone: the evaluation runs
again (its record comes twice in the history when the first one completed) and
the save is written again. A replacement's place does not count: it receives
rank 0's. Any other difference between the members' places is a bug of
tandem's (a step is committed on every rank or on none), and stops the job
with the places named rather than training on different samples.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["agreed_place"]


def agreed_place(places: Sequence[tuple[int, int] | None], epoch_end: int) -> tuple[int, int]:
    """The ``(epoch, consumed)`` every member of a new world goes on from, given
    each rank's (None for a rank without state: a replacement) and the number
    of samples consumed when an epoch ends, under Note [an epoch's end seen
    apart]: the epoch not yet counted where some members counted it and others
    did not.

    Raises:
        RuntimeError: the members' places differ otherwise, naming each rank's.
    """
    held = {(place[0], place[1]) for place in places if place is not None}
    if not held:
        raise RuntimeError("no rank of the new world holds a training state")
    if len(held) == 1:
        return next(iter(held))
    ended = {(epoch + 1, 0) if consumed >= epoch_end else (epoch, consumed) for epoch, consumed in held}
    if len(ended) == 1:  # the same place, counted by some and not by others: end it again, together
        return min(held)
    where = ", ".join(f"rank {r}: epoch {p[0]}, {p[1]} samples consumed" for r, p in enumerate(places)
                      if p is not None)
    raise RuntimeError(f"the members of the new world are at different places in the data ({where}), "
                       f"an epoch ending at {epoch_end} samples; a step was committed on some ranks only, which is a "
                       "bug in tandem: please report it with this message")
