"""tandem: data-parallel training for PyTorch.

Change one import, keep your script::

    import tandem
    world = tandem.init()
    model = tandem.DistributedDataParallel(model)   # or: tandem.fully_shard(model)
"""

import logging as _logging
from typing import TYPE_CHECKING as _TYPE_CHECKING

# Each public name is imported on first use (PEP 562), so that a process that needs
# only a part of tandem (the launcher, `tandem plan --help`) does not import the
# rest; `import tandem; tandem.X` works as before. The imports below are the same
# names, for type checkers and documentation tools.
if _TYPE_CHECKING:
    from tandem import checkpoint, comm_hooks, fsdp
    from tandem.checkpoint import CheckpointError, load_sharded_checkpoint, save_sharded_checkpoint
    from tandem.comm import WorldInfo, irecv, isend, recv, send
    from tandem.control import init, shutdown
    from tandem.data import DistributedSampler, RunningMean, all_reduce_mean, all_reduce_sum, gather_samples, \
        weighted_mean
    from tandem.diloco import DiLoCo, DiLoCoConfig, node_mesh
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

_FROM = {  # module: the public names tandem takes from it
    "tandem.checkpoint": ("CheckpointError", "load_sharded_checkpoint", "save_sharded_checkpoint"),
    "tandem.comm": ("WorldInfo", "irecv", "isend", "recv", "send"),
    "tandem.control": ("init", "shutdown"),
    "tandem.data": ("DistributedSampler", "RunningMean", "all_reduce_mean", "all_reduce_sum", "gather_samples",
                    "weighted_mean"),
    "tandem.diloco": ("DiLoCo", "DiLoCoConfig", "node_mesh"),
    "tandem.dp": ("DataParallel",),
    "tandem.fsdp": ("FSDPModule", "fully_shard"),
    "tandem.ddp": ("DistributedDataParallel", "join"),
    "tandem.launch": ("spawn",),
    "tandem.nn": ("SyncBatchNorm",),
    "tandem.tools.check": ("CheckReport", "check"),
    "tandem.tools.plan": ("PlanReport", "plan"),
    "tandem.train": ("DistributedLoader", "Trainer", "TrainerConfig", "TrainingState", "atomic_save",
                     "capture_rng_state", "gather_for_metrics", "latest_checkpoint", "load_checkpoint", "no_sync",
                     "prepare", "restore_rng_state", "save_checkpoint", "seed_everything", "unwrap"),
    "tandem.zero": ("ZeroOptimizer",),
}
_EXPORTS = {name: module for module, names in _FROM.items() for name in names}


def __getattr__(name: str) -> object:
    import importlib.util

    module = _EXPORTS.get(name)
    if module is None:
        # A subpackage (``tandem.zero``), as when ``import tandem`` imported them all.
        if name.startswith("_") or importlib.util.find_spec(f"tandem.{name}") is None:
            raise AttributeError(f"module 'tandem' has no attribute {name!r}")
        return importlib.import_module(f"tandem.{name}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = ["CheckReport", "CheckpointError", "DataParallel", "DiLoCo", "DiLoCoConfig", "DistributedDataParallel",
           "DistributedLoader",
           "DistributedSampler", "FSDPModule", "PlanReport", "RunningMean", "SyncBatchNorm", "Trainer",
           "TrainerConfig", "TrainingState", "WorldInfo", "ZeroOptimizer", "all_reduce_mean", "all_reduce_sum",
           "atomic_save", "capture_rng_state", "check", "checkpoint", "comm_hooks", "fsdp", "fully_shard",
           "gather_for_metrics", "gather_samples", "init", "irecv", "isend", "join", "latest_checkpoint",
           "load_checkpoint", "load_sharded_checkpoint", "no_sync", "node_mesh", "plan", "prepare", "recv",
           "restore_rng_state", "save_checkpoint", "save_sharded_checkpoint", "seed_everything", "send",
           "shutdown", "spawn", "unwrap", "weighted_mean"]
__version__ = "0.1.0"

_logging.getLogger(__name__).addHandler(_logging.NullHandler())
