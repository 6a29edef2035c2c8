"""tandem's DistributedDataParallel: planning (plan.py), buckets (bucket.py), the
reducer (reducer.py, built from one file per stage of a gradient's way: the
autograd hooks, readiness, launch, finish and write-back; reducer.py lists them)
and the module wrapper (module.py, built in layers: module_state, module_join,
module_fuse, module_copy; its arguments in module_args.py)."""

from tandem.ddp.join import join
from tandem.ddp.module import DistributedDataParallel

__all__ = ["DistributedDataParallel", "join"]
