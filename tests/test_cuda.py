"""The nccl/CUDA path. CI has no GPU: these skip there, and run on a GPU machine."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem
from tandem.testing import run_distributed

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def _train(model: nn.Module, device: torch.device, rank: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def _make(seed: int, device: torch.device) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)


@needs_cuda
def test_world_of_one_on_cuda_picks_nccl_and_binds_the_device() -> None:
    world = tandem.init()
    try:
        assert world.backend == "nccl" and world.device == torch.device("cuda", 0)
        ddp = tandem.DistributedDataParallel(_make(0, world.device), device_ids=[0])
        ref = _train(_make(0, world.device), world.device, 0)
        ours = _train(ddp, world.device, 0)
        for a, b in zip(ref, ours):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    finally:
        tandem.shutdown()


def _nccl(rank: int, world_size: int) -> float:
    world = tandem.init()
    try:
        ref = _train(TorchDDP(_make(rank, world.device), device_ids=[rank]), world.device, rank)
        ours = _train(tandem.DistributedDataParallel(_make(rank, world.device), device_ids=[rank],
                                                     bucket_cap_mb=0.001), world.device, rank)
        return max((a - b).abs().max().item() for a, b in zip(ref, ours))
    finally:
        tandem.shutdown()


@needs_two_gpus
def test_two_ranks_on_nccl_equal_torch() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}
    diffs = run_distributed(_nccl, 2, init_process_group=False, env=env, timeout=180)
    assert max(diffs) <= 1e-6
