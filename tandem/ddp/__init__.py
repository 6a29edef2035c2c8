"""tandem's :class:`DistributedDataParallel`, a drop-in for torch's, and
:func:`join`, the context manager for ranks with uneven inputs."""

# The package's files: planning (plan.py), buckets (bucket.py), the reducer
# (reducer.py: the step and autograd's hooks, composed of a bucket group that owns
# the buckets and their launch order, bucket_group.py, and one reduction chosen
# when it is built, reduction.py; a gradient's way from its hook to its
# all-reduce reads in those three files) and the module wrapper (module.py: one
# class; the broadcasts that keep replicas equal in model_sync.py, its arguments
# in module_args.py).

from tandem.ddp.join import join
from tandem.ddp.module import DistributedDataParallel

__all__ = ["DistributedDataParallel", "join"]
