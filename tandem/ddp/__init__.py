"""tandem's DistributedDataParallel: planning (plan.py), buckets (bucket.py), the
reducer (reducer.py) and the module wrapper (module.py)."""

from tandem.ddp.join import join
from tandem.ddp.module import DistributedDataParallel

__all__ = ["DistributedDataParallel", "join"]
