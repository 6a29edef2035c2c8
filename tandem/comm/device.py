"""Which device a process computes on: the backend a job picks by default, and
the GPU a process binds (from its local rank, or a Slurm task's own GPU)."""

from __future__ import annotations

import torch

__all__ = ["bind_device", "default_backend"]


def default_backend() -> str:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return "nccl"
    return "gloo"


def bind_device(backend: str, local_rank: int, rank: int, *, local_world_size: int | None = None,
                 slurm_task: bool = False) -> torch.device:
    # "nccl" or a per-device spec such as "cpu:gloo,cuda:nccl": the job computes on GPUs.
    if "nccl" not in backend:
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"rank {rank}: backend {backend!r} needs CUDA, but "
                         "torch.cuda.is_available() is False; pass backend='gloo' or None")
    index = local_rank
    if slurm_task and local_world_size is not None and count < local_world_size:
        # Note [a Slurm task's own GPUs]
        # srun --gpus-per-task (or --gpu-bind) gives each task its own GPUs and
        # hides the node's others: the task sees fewer GPUs than the node has
        # tasks, and its GPU is cuda:0 whatever its SLURM_LOCALID. torchrun never
        # hides GPUs, so elsewhere a LOCAL_RANK beyond the GPUs is an error.
        index = 0
    elif local_rank >= count:
        raise ValueError(
            f"rank {rank}: LOCAL_RANK={local_rank} but this node has {count} CUDA device(s); "
            f"start at most {count} processes per node (torchrun --nproc-per-node {count}), "
            "or set LOCAL_RANK and LOCAL_WORLD_SIZE if the launcher did not")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
