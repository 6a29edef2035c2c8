"""tandem's layer over torch.distributed, below everything else in tandem. It holds:

- joining the job and who this process is in it (bootstrap.py, world.py,
  launch_vars.py, slurm.py, device.py, group_record.py, timeouts.py), the typed
  view of a process group every collective goes through (group.py), its
  connections (connections.py) and the ranks by node (node_groups.py);
- the watch over collectives: the ledger, heartbeats and dead peers, debug mode,
  a rank cut off from the store (monitor.py, ledger.py, peers.py, process_id.py,
  fingerprint.py, wait_board.py, cut_off.py, watched_call.py, exit.py), and a
  rank's collectives as a trace (trace.py);
- the stores the job agrees in and who may write them: a TCP store on the job's
  address, an etcd cluster, the job secret (listening_store.py, etcd_store.py,
  etcd_gateway.py, store_address.py, job_secret.py);
- an elastic job's control plane: who is a member, the judge, roll calls, a
  world change (membership.py, judge.py, roll_call.py, elastic_group.py,
  failure_gate.py);
- point-to-point messages that carry their own shapes (:func:`send`,
  :func:`recv`; p2p.py, plain_data.py).

An elastic world change reads, in order: judge.py (a death found, the step
aborted), membership.py (``next_generation``), roll_call.py (its barriers),
elastic_group.py (``enter_generation``: the new generation's group); it starts
in tandem/elastic/run.py (``change_world``)."""

from tandem.comm.bootstrap import init, shutdown
from tandem.comm.fingerprint import CollectiveMismatchError
from tandem.comm.p2p import irecv, isend, recv, send
from tandem.comm.peers import PeerLostError
from tandem.comm.world import WorldInfo, world_from_env

__all__ = ["CollectiveMismatchError", "PeerLostError", "WorldInfo", "init", "irecv", "isend", "recv", "send",
           "shutdown", "world_from_env"]
