"""A thin typed layer over torch.distributed: joining the job and who this process
is in it, the watch over its collectives (ledger, dead peers, debug mode), and
point-to-point messages that carry their own shapes (:func:`send`, :func:`recv`)."""

from tandem.comm.bootstrap import init, shutdown
from tandem.comm.fingerprint import CollectiveMismatchError
from tandem.comm.p2p import irecv, isend, recv, send
from tandem.comm.peers import PeerLostError
from tandem.comm.world import WorldInfo, world_from_env

__all__ = ["CollectiveMismatchError", "PeerLostError", "WorldInfo", "init", "irecv", "isend", "recv", "send",
           "shutdown", "world_from_env"]
