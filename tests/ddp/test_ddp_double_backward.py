"""Double backward through tandem's DDP: ``loss.backward(create_graph=True)``
trains like one process on the global batch (torch 2.13's DDP fails it on CPU),
and gradient penalties (``torch.autograd.grad(out, x, create_graph=True)`` and
then a backward of a loss that holds the penalty) train like torch's DDP and like
one process on the global batch. And a model whose every parameter sits behind a
reentrant checkpoint still finishes its backward at the outer pass's end.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

import tandem
from tandem.testing import grad_of, run_distributed

TOL = 1e-6
GLOBAL_BATCH = 8
STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


class AllCheckpointed(nn.Module):
    """Two reentrant checkpoint segments and nothing outside them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
        self.b = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True)  # reentrant checkpoints need an input that does
        h = checkpoint(self.a, x, use_reentrant=True)
        return checkpoint(self.b, h, use_reentrant=True)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 4, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "penalty":
        x = x.clone().requires_grad_(True)
        out = model(x)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return nn.functional.mse_loss(out, y) + 0.5 * (gx ** 2).sum(dim=1).mean()
    return nn.functional.mse_loss(model(x), y)


def _train(wrapped: nn.Module, params: list[nn.Parameter], rank: int, world: int, mode: str) -> dict:
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    grads = []
    for step in range(STEPS):
        x, y = _data(step)
        n = GLOBAL_BATCH // world
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        opt.zero_grad()
        loss = _loss(wrapped, x, y, mode)
        loss.backward(create_graph=mode == "create_graph")
        grads.append([grad_of(p).detach().clone() for p in params])
        opt.step()
    return {"grads": grads, "params": [p.detach().clone() for p in params]}


def _diff(a: dict, b: dict) -> float:
    pairs = [(x, y) for ga, gb in zip(a["grads"], b["grads"]) for x, y in zip(ga, gb)]
    pairs += list(zip(a["params"], b["params"]))
    return max((x - y).abs().max().item() for x, y in pairs)


def _grid(rank: int, world_size: int) -> dict[str, float]:
    out = {}
    for mode in ("create_graph", "penalty"):
        local_model = _model()
        local = _train(local_model, list(local_model.parameters()), 0, 1, mode)
        m = _model()
        ours = _train(tandem.DistributedDataParallel(m), list(m.parameters()), rank, world_size, mode)
        out[f"{mode}: tandem vs local"] = _diff(ours, local)
        if mode == "penalty":
            # torch 2.13's DDP on CPU fails backward(create_graph=True) itself ("a leaf
            # Variable that requires grad is being used in an in-place operation").
            m = _model()
            theirs = _train(TorchDDP(m), list(m.parameters()), rank, world_size, mode)
            out[f"{mode}: tandem vs torch"] = _diff(ours, theirs)
    local_model = AllCheckpointed()
    local = _train(local_model, list(local_model.parameters()), 0, 1, "plain")
    m = AllCheckpointed()
    ours = _train(tandem.DistributedDataParallel(m), list(m.parameters()), rank, world_size, "plain")
    out["all checkpointed: tandem vs local"] = _diff(ours, local)
    return out


def test_double_backward_matches_torch_ddp_and_local_training() -> None:
    for rank, diffs in enumerate(run_distributed(_grid, 2, timeout=120)):
        assert len(diffs) == 4
        bad = {k: v for k, v in diffs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"
