"""A thin typed layer over torch.distributed: joining the job and who this process
is in it, and the watch over its collectives (ledger, dead peers, debug mode)."""

from tandem.comm.bootstrap import init, shutdown
from tandem.comm.fingerprint import CollectiveMismatchError
from tandem.comm.peers import PeerLostError
from tandem.comm.world import WorldInfo, world_from_env

__all__ = ["CollectiveMismatchError", "PeerLostError", "WorldInfo", "init", "shutdown",
           "world_from_env"]
