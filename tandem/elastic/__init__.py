"""Elastic training: a job that loses a rank goes on, and grows back when a
replacement joins, with no sample lost or seen twice and nothing read from disk.

Read in this order:

- who is in the job, agreed through its store, and each generation's default
  group: the control plane, tandem/control/ (membership.py, Note [elastic
  membership]; elastic_group.py), below every wrapper, since ``tandem.init``
  (a replacement's join) and fully_shard's second group use it.
- run.py: what a rank does when the world changes (Note [elastic trainer]):
  :class:`ElasticRun` catches a peer's failure, agrees on the next generation,
  regroups, and shares the training state with a replacement;
  :class:`WorldChange` is what it reports.
- loop.py: the same for a loop the user writes, through
  ``tandem.prepare(elastic=...)`` (Note [elastic prepare]).
- buddy.py: a second copy of each rank's shard on the next rank, so that a
  sharded state survives the loss of its owner (Note [buddy copies]).
- fsdp_shards.py: a fully_shard model's shards out of a world and back into a
  new one (Note [elastic fully_shard]); the units themselves are laid out again
  by tandem/fsdp/regroup.py. zero_shards.py: the same for a ZeRO optimizer's
  (Note [elastic ZeRO]).
- world.py: one rank's part, which the Trainer and a prepared loop both hold
  (:class:`ElasticWorld`: the decisions, the buddy copies, one step back).

A world change reads, in order: run.py (``ElasticRun.change_world``),
tandem/control/membership.py (``next_generation``),
tandem/control/elastic_group.py (``enter_generation``),
tandem/control/group_record.py (``start_watch``); ``change_world`` then calls
the ``rebuild`` that the Trainer (world.py) or a prepared loop (loop.py) gave it.

The launcher's
side (``tandem run --elastic``: replacements, nodes that rejoin) is
tandem/launch/elastic_agent.py and node_roll.py.

Above ddp/, fsdp/, zero/ and checkpoint/ (and tandem/control/ below them); below train/.
"""
