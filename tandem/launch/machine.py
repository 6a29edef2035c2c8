"""What this machine offers the workers: CPU cores and GPUs.

Measured here, passed into the pure rules of :mod:`tandem.launch.config`.
"""

from __future__ import annotations

import os

__all__ = ["usable_cpus", "visible_gpus"]


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask, which container
    limits and ``taskset`` narrow), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def visible_gpus() -> int:
    """CUDA devices this process can see; 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
