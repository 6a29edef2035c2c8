"""Uneven inputs: with tandem.join, ranks holding 3, 5 and 8 batches all finish,
with the parameters torch's DDP reaches under torch's Join on the same data."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (allreduce_hook,
                                                                       fp16_compress_hook)
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem
from tandem.testing import Case, CaseResults, RankFailure, run_cases, run_distributed
from tandem.testing.models import IN, OUT, make_model

BATCHES = (3, 5, 8)


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(4, IN, generator=g), torch.randn(4, OUT, generator=g))
            for _ in range(BATCHES[rank])]


def _train(ddp, ctx, rank: int, micro: int) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    with ctx:
        for k, (x, y) in enumerate(_batches(rank)):
            sync = (k + 1) % micro == 0
            if sync:
                nn.functional.mse_loss(ddp(x), y).backward()
                opt.step()
                opt.zero_grad()
            else:
                with ddp.no_sync():
                    nn.functional.mse_loss(ddp(x), y).backward()
    return {n: t.detach().clone() for n, t in ddp.module.state_dict().items()}


def _compare(rank: int, world_size: int, cases: list[dict]) -> list[float]:
    diffs = []
    for case in cases:
        kw, divide, micro = case["ddp"], case["divide"], case.get("micro", 1)
        ref_model = TorchDDP(make_model(case["model"], seed=rank), **kw)
        hook = case.get("hook")
        if hook is not None:
            ref_model.register_comm_hook(None, hook)
        ref = _train(ref_model, TorchJoin([ref_model], divide_by_initial_world_size=divide),
                     rank, micro)
        ours_model = tandem.DistributedDataParallel(make_model(case["model"], seed=rank), **kw)
        if hook is not None:
            ours_model.register_comm_hook(None, hook)
        ours = _train(ours_model, tandem.join([ours_model], divide_by_initial_world_size=divide),
                      rank, micro)
        diffs.append(max((ref[k].double() - ours[k].double()).abs().max().item() for k in ref))
    return diffs


CASES = [
    dict(model="mlp", ddp={}, divide=True),
    dict(model="mlp", ddp={}, divide=False),
    dict(model="mlp", ddp=dict(bucket_cap_mb=0.0001, gradient_as_bucket_view=True), divide=True),
    dict(model="batchnorm", ddp={}, divide=True),
    dict(model="switching", ddp=dict(find_unused_parameters=True), divide=True),
    dict(model="mlp", ddp={}, divide=True, micro=2),
    # torch's hooks on both: a joined rank runs the hook on zero buckets, as torch does.
    # fp16 sums of 3 ranks round differently with gloo's chunking (as without join).
    dict(model="mlp", ddp={}, divide=False, hook=fp16_compress_hook, tol=1e-3),
    dict(model="mlp", ddp={}, divide=True, hook=allreduce_hook),
]


@pytest.fixture(scope="module")
def three() -> CaseResults:
    """The 3-rank cases in one spawned group (tandem.testing.run_cases)."""
    return run_cases({"compare": Case(_compare, args=(CASES,), timeout=120),
                      "throw": Case(_throw, timeout=60)}, 3)


def test_uneven_inputs_match_torch_join(three) -> None:
    results = three["compare"]
    for rank, diffs in enumerate(results):
        for case, diff in zip(CASES, diffs):
            assert diff <= case.get("tol", 1e-6), f"rank {rank} {case}: max abs diff {diff:.3g}"


def _throw(rank: int, world_size: int) -> str:
    ddp = tandem.DistributedDataParallel(make_model("mlp", seed=rank))
    try:
        with ddp.join(throw_on_early_termination=True):
            for x, y in _batches(rank):
                nn.functional.mse_loss(ddp(x), y).backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_throw_on_early_termination_raises_on_every_rank(three) -> None:
    messages = three["throw"]
    assert messages[0] == "Rank 0 exhausted all inputs."
    for m in messages[1:]:
        assert "Detected at least one rank that exhausted inputs" in m, m


def _missing_under_join(rank: int, world_size: int) -> None:
    """Rank 0 runs out after one batch; rank 1's second backward leaves the
    head without a gradient (no find_unused_parameters)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(IN, OUT), "head": nn.Linear(OUT, OUT)})

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, x: torch.Tensor, use_head: bool) -> torch.Tensor:
            h = self.m["body"](x)
            return self.m["head"](h) if use_head else h

    ddp = tandem.DistributedDataParallel(Net())
    with ddp.join():
        for k, (x, y) in enumerate(_batches(rank)[:1 + rank]):
            nn.functional.mse_loss(ddp(x, use_head=k == 0), y).backward()


def test_a_missing_gradient_inside_join_raises_instead_of_hanging() -> None:
    # Before: the training rank gathered every rank's missing names, a
    # collective the joined rank does not mirror, and both waited forever.
    with pytest.raises(RankFailure) as failure:
        run_distributed(_missing_under_join, 2, timeout=60)
    message = failure.value.tracebacks[1]
    assert "rank 1: DistributedDataParallel: these parameters received no gradient" in message, message
    assert "rank 1: 'm.head.bias', 'm.head.weight'" in message and "inside tandem.join" in message, message
