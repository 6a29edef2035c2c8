"""Start jobs: the ``tandem run`` launcher and :func:`spawn`, on torch's elastic agent.

:class:`LaunchConfig` is what a job is (the ``tandem run`` flags resolved);
:func:`spawn` runs a function in new processes from Python. A job that cannot
start raises :class:`LaunchError`, and a spawned process that fails
:class:`SpawnError`.
"""

# The package's modules:
#
# - :mod:`~tandem.launch.config`: what a job is (:class:`LaunchConfig`) and the pure
#   rules from flags to it (workers per node, rendezvous, threads).
# - :mod:`~tandem.launch.rendezvous`: a fresh store for each attempt's workers.
# - :mod:`~tandem.launch.etcd_plane`: ``--rdzv-backend etcd``: every store on an etcd
#   cluster the nodes run, so that no node's loss ends the job.
# - :mod:`~tandem.launch.agent`: torch's ``LocalElasticAgent``, built and run.
# - :mod:`~tandem.launch.logs` and :mod:`~tandem.launch.output`: the workers' log
#   files, and their lines on the console with rank prefixes.
# - :mod:`~tandem.launch.summary`: the short report when a worker fails.
# - :mod:`~tandem.launch.elastic_agent` and :mod:`~tandem.launch.spare`: ``--elastic``'s
#   agent, and the spare worker it makes each replacement of.
# - :mod:`~tandem.launch.cli`: the ``tandem`` command, and what each worker runs;
#   :mod:`~tandem.launch.spawn`: the same from Python.
#
# A launch reads in cli.py (``main``: the flags to a LaunchConfig and a
# WorkerCommand, then ``run_job``), config.py (the rules and the config),
# agent.py (``run_workers``: torch's agent built over the node's control plane)
# and rendezvous.py (each attempt's fresh store for its workers).

from tandem.launch.agent import LaunchError
from tandem.launch.config import LaunchConfig
from tandem.launch.spawn import SpawnError, spawn

__all__ = ["LaunchConfig", "LaunchError", "SpawnError", "spawn"]
