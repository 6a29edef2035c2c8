"""tandem's thin typed layer over torch.distributed, below every wrapper. It holds:

- who this process is in the job, read from a launcher's variables, and the
  device it computes on (world.py, launch_vars.py, slurm.py, device.py,
  timeouts.py);
- the typed view of a process group every collective goes through (group.py),
  the gate a broken step's collectives pass (failure_gate.py), a group's gloo
  connections (connections.py) and the ranks by node (node_groups.py);
- the watch over collectives: the ledger, the heartbeat and dead peers, debug
  mode, a rank cut off from the store, a clean exit (monitor.py, ledger.py,
  peers.py, process_id.py, fingerprint.py, wait_board.py, cut_off.py,
  watched_call.py, exit.py, thread_exit.py), and a rank's collectives as a trace (trace.py);
- point-to-point messages that carry their own shapes (:func:`send`,
  :func:`recv`; p2p.py, plain_data.py).

Joining the job (``tandem.init``, ``tandem.shutdown``) and an elastic job's
control plane are one layer up, in tandem/control/; collectives that send int8
or int4 blocks in tandem/quantized/; the stores the job agrees in, and the job
secret, one layer down, in tandem/store/.
"""

from tandem.comm.fingerprint import CollectiveMismatchError
from tandem.comm.p2p import irecv, isend, recv, send
from tandem.comm.peers import PeerLostError
from tandem.comm.world import WorldInfo, world_from_env

__all__ = ["CollectiveMismatchError", "PeerLostError", "WorldInfo", "irecv", "isend", "recv", "send",
           "world_from_env"]
