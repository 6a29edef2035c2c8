"""tandem's :class:`DistributedDataParallel`, a drop-in for torch's, and
:func:`join`, the context manager for ranks with uneven inputs."""

# The package's files: planning (plan.py), the buckets (bucket.py: the flat
# buffer, a bucket, and one reducer's group of buckets launched in bucket order),
# how a bucket is reduced and its averages delivered to param.grad (reduction.py:
# all-reduce, ZeRO's reduce-scatter, a communication hook), the reducer
# (reducer.py: the step and autograd's hooks) and the module wrapper (module.py:
# one class; the broadcasts that keep replicas equal in model_sync.py, its
# arguments in module_args.py).
#
# A gradient's way from its hook to param.grad reads in reducer.py (_on_grad),
# bucket.py (BucketGroup.take/ready, launch_complete), reduction.py
# (AllReduce.launch), tandem/comm/group.py (the all-reduce), then reducer.py
# (_finish) and reduction.py (GradDelivery.deliver).

from tandem.ddp.join import join
from tandem.ddp.module import DistributedDataParallel

__all__ = ["DistributedDataParallel", "join"]
