"""tandem: data-parallel training for PyTorch.

Change one import, keep your script::

    import tandem
    world = tandem.init()
    model = tandem.DistributedDataParallel(model)   # or: tandem.fully_shard(model)
"""

import logging as _logging

from tandem import checkpoint, comm_hooks, fsdp
from tandem.checkpoint import CheckpointError, load_sharded_checkpoint, save_sharded_checkpoint
from tandem.comm import WorldInfo, init, irecv, isend, recv, send, shutdown
from tandem.data import DistributedSampler, RunningMean, all_reduce_mean, all_reduce_sum, gather_samples, \
    weighted_mean
from tandem.dp import DataParallel
from tandem.fsdp import FSDPModule, fully_shard
from tandem.ddp import DistributedDataParallel, join
from tandem.launch import spawn
from tandem.nn import SyncBatchNorm
from tandem.tools.check import CheckReport, check
from tandem.tools.plan import PlanReport, plan
from tandem.train import DistributedLoader, Trainer, TrainerConfig, TrainingState, atomic_save, \
    capture_rng_state, gather_for_metrics, latest_checkpoint, load_checkpoint, no_sync, prepare, \
    restore_rng_state, save_checkpoint, seed_everything, unwrap
from tandem.zero import ZeroOptimizer

__all__ = ["CheckReport", "CheckpointError", "DataParallel", "DistributedDataParallel", "DistributedLoader",
           "DistributedSampler", "FSDPModule", "PlanReport", "RunningMean", "SyncBatchNorm", "Trainer",
           "TrainerConfig", "TrainingState", "WorldInfo", "ZeroOptimizer", "all_reduce_mean", "all_reduce_sum",
           "atomic_save", "capture_rng_state", "check", "checkpoint", "comm_hooks", "fsdp", "fully_shard",
           "gather_for_metrics", "gather_samples", "init", "irecv", "isend", "join", "latest_checkpoint",
           "load_checkpoint", "load_sharded_checkpoint", "no_sync", "plan", "prepare", "recv",
           "restore_rng_state", "save_checkpoint", "save_sharded_checkpoint", "seed_everything", "send",
           "shutdown", "spawn", "unwrap", "weighted_mean"]
__version__ = "0.1.0"

_logging.getLogger(__name__).addHandler(_logging.NullHandler())
