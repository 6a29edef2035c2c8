"""tandem's :class:`DataParallel`, a drop-in for ``torch.nn.DataParallel``,
and its steps as functions: :func:`scatter` the inputs, :func:`replicate` the
module, run the replicas in threads (:func:`parallel_apply`), :func:`gather`
the outputs."""

# The package's files: scatter and gather (scatter_gather.py), replicate
# (replicate.py), run in threads (parallel_apply.py); the wrapper is module.py.

from tandem.dp.module import DataParallel
from tandem.dp.parallel_apply import parallel_apply
from tandem.dp.replicate import replicate
from tandem.dp.scatter_gather import gather, scatter, scatter_kwargs

__all__ = ["DataParallel", "gather", "parallel_apply", "replicate", "scatter", "scatter_kwargs"]
