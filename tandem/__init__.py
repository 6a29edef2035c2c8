"""tandem: data-parallel training for PyTorch.

Change one import, keep your script::

    import tandem
    world = tandem.init()
    model = tandem.DistributedDataParallel(model)
"""

import logging as _logging

from tandem import comm_hooks
from tandem.comm import WorldInfo, init, shutdown
from tandem.dp import DataParallel
from tandem.ddp import DistributedDataParallel, join
from tandem.launch import spawn
from tandem.nn import SyncBatchNorm
from tandem.zero import ZeroOptimizer

__all__ = ["DataParallel", "DistributedDataParallel", "SyncBatchNorm", "WorldInfo", "ZeroOptimizer", "init",
           "join", "shutdown", "spawn"]
__version__ = "0.1.0"

_logging.getLogger(__name__).addHandler(_logging.NullHandler())
