"""Data for data-parallel training: a resumable DistributedSampler (sampler.py)
and metrics reduced or gathered across ranks (metrics.py)."""

from tandem.data.metrics import RunningMean, all_reduce_mean, all_reduce_sum, gather_samples, weighted_mean
from tandem.data.sampler import DistributedSampler

__all__ = ["DistributedSampler", "RunningMean", "all_reduce_mean", "all_reduce_sum", "gather_samples",
           "weighted_mean"]
