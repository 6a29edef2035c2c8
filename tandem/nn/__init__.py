"""Layers for data-parallel training: :class:`SyncBatchNorm` and the function it
computes, :func:`sync_batch_norm`."""

# The package's files: SyncBatchNorm (sync_batchnorm.py) and its autograd
# function (functional.py).

from tandem.nn.functional import sync_batch_norm
from tandem.nn.sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm", "sync_batch_norm"]
