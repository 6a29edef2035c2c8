"""Joining the job, and an elastic job's control plane: who is a member, who
judges the dead, and how the world changes. Above tandem.comm (the groups and
collectives it builds and watches), below every wrapper.

- bootstrap.py: :func:`init` and :func:`shutdown` (``tandem.init``,
  ``tandem.shutdown``): create or adopt the default group, or, for a
  replacement, meet the running elastic job;
- group_record.py: who created this process's default group, and what
  :func:`init` added to it (Note [who owns the default group]);
- membership.py: who is in an elastic job, agreed through its store
  (Note [elastic membership]; :class:`ElasticConfig`, :class:`MembershipError`);
- judge.py: one member judges who is dead, for every member (Note [judge once]);
- roll_call.py: who has arrived at a point of a world change (Note [a roll call]);
- elastic_group.py: each generation's default group, and a replacement joining
  (Note [elastic default group]).

An elastic world change reads, in order: judge.py (a death found, the step
aborted), membership.py (``next_generation``), roll_call.py (its barriers),
elastic_group.py (``enter_generation``: the new generation's group); it starts
in tandem/elastic/run.py (``change_world``).
"""

from tandem.control.bootstrap import init, shutdown
from tandem.control.membership import ElasticConfig, MembershipError

__all__ = ["ElasticConfig", "MembershipError", "init", "shutdown"]
