"""A thin typed layer over torch.distributed: joining the job and who this process is in it."""

from tandem.comm.bootstrap import init, shutdown
from tandem.comm.world import WorldInfo, world_from_env

__all__ = ["WorldInfo", "init", "shutdown", "world_from_env"]
