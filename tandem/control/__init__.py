"""Joining the job, and an elastic job's control plane: who is a member, who
judges the dead, and how the world changes. Above tandem.comm (the groups it
builds, the beats and collectives it watches) and tandem.store (the stores it
agrees in), below every wrapper (fully_shard builds its second group here).

- bootstrap.py: :func:`init` and :func:`shutdown` (``tandem.init``,
  ``tandem.shutdown``): create or adopt the default group, or, for a
  replacement, meet the running elastic job;
- group_record.py: who created this process's default group, and what
  :func:`init` added to it (Note [who owns the default group]);
- generation.py: what the members agree on (a :class:`Generation`, a step's
  ``Decision``), by which settings (:class:`ElasticConfig`), and the errors of
  the agreement (:class:`MembershipError`);
- membership.py: who is in an elastic job, agreed through its store (Note
  [elastic membership]);
- roll_call.py: the barriers of a world change, which thousands of members
  can pass (Note [a roll call]);
- judge.py: one member judges who is dead, for every member (Note [judge once]);
- news.py: a thread that waits for news of a generation (a death named, a
  member gone to regroup), so that a collective's watch reads nothing until
  then (Note [news of a generation]);
- join_requests.py: the asks to join as the members read them, and a
  stranger's refused (Note [a stranger asks to join]);
- elastic_group.py: each generation's default group, built once its members
  have arrived, its backend on a thread a death can abandon (for a
  replacement, while the members train their last step without it), and a
  replacement joining (Note [elastic default group], Note [arrivals], Note [a
  death while the group is built], Note [a group built ahead]).

An elastic world change reads, in order: tandem/elastic/run.py
(``ElasticRun.change_world``: the step aborted), membership.py
(``next_generation``: the members agree on the next generation, through a roll
call: roll_call.py), elastic_group.py (``enter_generation``: the members arrive, the old
group is left, the new one built), group_record.py (``start_watch``: the
monitor and the record move onto the new group). The death that starts it is
found during a step's decision: membership.py (``decide_step``), judge.py (the
verdict, and the ``abort`` it proposes).
"""

from tandem.control.bootstrap import init, shutdown
from tandem.control.generation import ElasticConfig, MembershipError

__all__ = ["ElasticConfig", "MembershipError", "init", "shutdown"]
