"""A step that a peer's death broke goes on without communication: :class:`FailureGate`.

# Note [a broken step goes on]
In an elastic loop the user writes (Note [elastic prepare] in
tandem/elastic/loop.py), a peer that dies inside the model's forward or backward
fails a collective there, and the exception would leave ``model(x)`` or
``loss.backward()`` in the user's own code, which cannot catch it without a try
in every script. DDP's reducer has its failure handler for the one place it
communicates (Note [recovered reduction failures] in tandem/ddp/reducer.py);
a fully-sharded model communicates in every unit's forward and backward, so its
collectives carry a gate instead (``FSDPModule.set_failure_handler``):

- a collective whose launch or wait fails is offered to the gate's ``claim``
  (the loop's: it claims a peer's failure, and records it for the optimizer's
  step, which drops the step and regroups); claimed, the gate is broken and the
  call returns as if the collective had completed, its output left as it is;
- while the gate is broken, every collective of the groups it guards is not
  issued at all (its peers are gone: each would fail again, or wait for a
  timeout), and returns at once, its output left as it is.

So the rest of the step runs on stale or partial values (a gathered parameter
of a dead peer's rows, say), which is harmless: the step is dropped before
anything is stepped on, and the world's rebuild reopens the gate. An error the
gate does not claim is raised as before.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["FailureGate"]


class FailureGate:
    """Whether a peer's failure broke this rank's step (Note [a broken step goes on]).

    Args:
        claim: asked about each failed collective; True when it recovers from
            the error (a peer's failure, recorded for the step's decision).
    """

    def __init__(self, claim: Callable[[BaseException], bool]) -> None:
        self._claim = claim
        self.broken = False

    def claims(self, error: BaseException) -> bool:
        """Offer ``error`` to the claim; once claimed, the gate is broken."""
        claimed = self._claim(error)
        self.broken = self.broken or claimed
        return claimed

    def reopen(self) -> None:
        """The world was rebuilt: collectives are issued again."""
        self.broken = False

    def __repr__(self) -> str:
        return f"FailureGate(broken={self.broken})"
