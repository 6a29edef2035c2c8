"""Uneven inputs: with tandem.join, ranks holding 3, 5 and 8 batches all finish,
with the parameters torch's DDP reaches under torch's Join on the same data."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (allreduce_hook,
                                                                       fp16_compress_hook)
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem
from tandem.testing import run_distributed
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


def test_uneven_inputs_match_torch_join() -> None:
    results = run_distributed(_compare, 3, args=(CASES,), timeout=120)
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


def test_throw_on_early_termination_raises_on_every_rank() -> None:
    messages = run_distributed(_throw, 3, timeout=60)
    assert messages[0] == "Rank 0 exhausted all inputs."
    for m in messages[1:]:
        assert "Detected at least one rank that exhausted inputs" in m, m
