"""Data for data-parallel training: a resumable :class:`DistributedSampler`,
metrics reduced or gathered across ranks, and this rank's share of a DataLoader
as ``tandem.prepare`` makes it (:class:`DistributedLoader`)."""

from tandem.data.loader import DistributedLoader, gather_for_metrics
from tandem.data.metrics import RunningMean, all_reduce_mean, all_reduce_sum, gather_samples, weighted_mean
from tandem.data.sampler import DistributedSampler

__all__ = ["DistributedLoader", "DistributedSampler", "RunningMean", "all_reduce_mean", "all_reduce_sum",
           "gather_for_metrics", "gather_samples", "weighted_mean"]
