"""RPC and distributed autograd with tandem's DDP (issue 15 part 4).

The hybrid job of tandem/examples/rpc_hybrid.py: two trainers hold a dense MLP
under DistributedDataParallel (over the trainers' gloo group) and share an
EmbeddingBag held on a parameter server (a RemoteModule); a step is a
``dist_autograd.backward`` and a ``DistributedOptimizer`` step. Every run of the
grid happens inside one spawn of three processes, with torch's DDP and with
tandem's, and is compared with plain single-process training on the global batch.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandem.examples.rpc_hybrid import EMBEDDING_DIM, NUM_EMBEDDINGS, HybridConfig, HybridResult, \
    initial_table, make_batches, make_dense, run_rank
from tandem.testing import run_distributed

pytestmark = pytest.mark.skipif(not torch.distributed.rpc.is_available(), reason="torch built without RPC")

NUM_TRAINERS = 2
STEPS = 5
TOL = 1e-5
# A bucket cap of ~100 bytes: every parameter in a bucket of its own (the
# reduction then runs on the gradient itself, Note [in-place reduction]).
TINY_CAP_MB = 1e-4

GRID = [
    HybridConfig(ddp="torch", steps=STEPS, batch_size=8),
    HybridConfig(ddp="tandem", steps=STEPS, batch_size=8),
    HybridConfig(ddp="tandem", optimizer="local", steps=STEPS, batch_size=8),
    HybridConfig(ddp="tandem", steps=STEPS, batch_size=8, bucket_cap_mb=TINY_CAP_MB),
    HybridConfig(ddp="torch", steps=STEPS, batch_size=8, gradient_as_bucket_view=True),
    HybridConfig(ddp="tandem", steps=STEPS, batch_size=8, gradient_as_bucket_view=True),
    HybridConfig(ddp="torch", steps=STEPS, batch_size=8, find_unused_parameters=True),
    HybridConfig(ddp="tandem", steps=STEPS, batch_size=8, find_unused_parameters=True),
    HybridConfig(ddp="tandem", steps=STEPS, batch_size=8, static_graph=True),
]


def _rank(rank: int, world_size: int, configs: list[HybridConfig]) -> list[HybridResult] | None:
    store = os.environ["TANDEM_TEST_STORE"]  # a file in the harness's private directory: no ports
    return run_rank(rank, world_size, configs, rpc_init_method=f"file://{store}.rpc",
                    pg_init_method=f"file://{store}", timeout=60)


@pytest.fixture(scope="module")
def results() -> dict[HybridConfig, HybridResult]:
    out = run_distributed(_rank, NUM_TRAINERS + 1, args=(GRID,), timeout=150, init_process_group=False)
    assert out[0] is None and out[1] is None
    return {r.config: r for r in out[-1]}


def single_process(config: HybridConfig) -> tuple[list[list[float]], dict[str, torch.Tensor], torch.Tensor]:
    """The same training in one process on the global batch: per-trainer losses,
    the final dense weights and the final table.

    Each trainer applies its own table gradient on the parameter server, so the
    table moves by the sum of the trainers' (mean-loss) gradients: lr * NUM_TRAINERS
    on the gradient of the global mean. The dense gradients are averaged: lr."""
    table = nn.EmbeddingBag(NUM_EMBEDDINGS, EMBEDDING_DIM, mode="sum")
    with torch.no_grad():
        table.weight.copy_(initial_table(config.seed))
    dense = make_dense(config.seed)
    opt = torch.optim.SGD([{"params": dense.parameters(), "lr": config.lr},
                           {"params": table.parameters(), "lr": config.lr * NUM_TRAINERS}])
    losses: list[list[float]] = [[] for _ in range(NUM_TRAINERS)]
    for ids, labels in make_batches(config):
        per_trainer = [F.cross_entropy(dense(table(i)), y)
                       for i, y in zip(ids.chunk(NUM_TRAINERS), labels.chunk(NUM_TRAINERS))]
        opt.zero_grad()
        (sum(per_trainer) / NUM_TRAINERS).backward()  # type: ignore[union-attr]
        opt.step()
        for t, loss in enumerate(per_trainer):
            losses[t].append(loss.item())
    return losses, {n: p.detach() for n, p in dense.named_parameters()}, table.weight.detach()


def _max_diff(a: HybridResult, losses: list[list[float]], dense: list[dict[str, torch.Tensor]],
              table: torch.Tensor) -> float:
    diffs = [(a.embedding - table).abs().max().item()]
    for t, trainer in enumerate(a.trainers):
        diffs += [abs(x - y) for x, y in zip(trainer.losses, losses[t], strict=True)]
        diffs += [(trainer.dense[n] - dense[t][n]).abs().max().item() for n in dense[t]]
    return max(diffs)


def _check_replicas(result: HybridResult) -> None:
    """DDP's promise: every trainer ends each backward with the same averaged gradients."""
    first, *others = result.trainers
    assert first.dense_grads, "the autograd context holds the dense gradients"
    for t, other in enumerate(others, 1):
        for name in first.dense:
            assert torch.equal(first.dense_grads[name], other.dense_grads[name]), (
                f"{result.config}: trainers 0 and {t} left different gradients of {name!r} in their "
                f"autograd contexts (max diff "
                f"{(first.dense_grads[name] - other.dense_grads[name]).abs().max().item():.3g})")
            assert torch.equal(first.dense[name], other.dense[name]), \
                f"{result.config}: the replicas of {name!r} differ between trainers 0 and {t}"


def test_torch_ddp_hybrid_matches_single_process(results: dict[HybridConfig, HybridResult]) -> None:
    """The harness and the reference agree on torch's own DDP (the yardstick)."""
    for config in (GRID[0], GRID[4], GRID[6]):
        result = results[config]
        _check_replicas(result)
        losses, dense, table = single_process(config)
        assert _max_diff(result, losses, [dense] * NUM_TRAINERS, table) <= TOL
        assert losses[0][-1] < losses[0][0], "the job learns"


@pytest.mark.parametrize("index", [1, 2, 3, 5, 7, 8], ids=["plain", "local-optimizer", "bucket-per-param",
                                                             "gradient-as-bucket-view", "find-unused-parameters",
                                                             "static-graph"])
def test_tandem_ddp_hybrid_equals_torch_ddp(results: dict[HybridConfig, HybridResult], index: int) -> None:
    config = GRID[index]
    result = results[config]
    _check_replicas(result)
    # torch's DDP with the same gradient layout and unused-parameter search
    # (static_graph and the optimizer and bucket choices change no number).
    yardstick = results[dataclasses.replace(config, ddp="torch", optimizer="distributed", bucket_cap_mb=25.0,
                                            static_graph=False)]
    # Equal to torch's DDP in the same job (bit for bit, today)...
    diff = _max_diff(result, [t.losses for t in yardstick.trainers],
                     [t.dense for t in yardstick.trainers], yardstick.embedding)
    assert diff <= TOL, f"{config}: differs from torch's DDP by {diff:.3g}"
    # ...and to single-process training on the global batch.
    losses, dense, table = single_process(config)
    assert _max_diff(result, losses, [dense] * NUM_TRAINERS, table) <= TOL


# ---------------------------------------------------------------------- what is refused

def _refusals(rank: int, world_size: int) -> dict[str, str]:
    """Two trainers, RPC only for its autograd contexts (a local graph): what
    tandem's DDP refuses under distributed autograd, and the error for a
    parameter only some ranks used (Note [distributed autograd])."""
    import datetime

    import torch.distributed as dist
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc

    import tandem

    store = os.environ["TANDEM_TEST_STORE"]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store}.rpc",
                                                                     rpc_timeout=60))
    out = {}
    try:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
        options: dict[str, dict[str, Any]] = {"zero": {"zero_stage": 1}, "fused": {}}
        for name, kwargs in options.items():
            torch.manual_seed(0)
            ddp = tandem.DistributedDataParallel(nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 2)), **kwargs)
            if name == "fused":
                ddp.fuse_optimizer(torch.optim.SGD(ddp.parameters(), lr=0.1))
            try:
                with dist_autograd.context():
                    ddp(x)
            except RuntimeError as e:
                out[name] = str(e)
        torch.manual_seed(0)
        model = nn.ModuleDict({"a": nn.Linear(6, 2), "b": nn.Linear(6, 2)})

        class UsesB(nn.Module):  # rank 1 never touches "b"
            def __init__(self) -> None:
                super().__init__()
                self.m = model

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.m["a"](x) + (self.m["b"](x) if rank == 0 else 0)

        ddp = tandem.DistributedDataParallel(UsesB(), find_unused_parameters=True)
        try:
            with dist_autograd.context() as context_id:
                dist_autograd.backward(context_id, [ddp(x).sum()])
        except RuntimeError as e:
            out["partly_used"] = str(e)
    finally:
        dist.barrier()
        rpc.shutdown()
        dist.destroy_process_group()
    return out


def test_zero_fused_and_partly_used_parameters_are_refused_on_every_rank() -> None:
    results = run_distributed(_refusals, 2, timeout=90, init_process_group=False)
    for rank, out in enumerate(results):
        assert f"rank {rank}" in out["zero"] and "ZeRO" in out["zero"], out
        assert "fuse_optimizer" in out["fused"] and "distributed autograd" in out["fused"], out
        assert "['m.b.weight', 'm.b.bias']" in out["partly_used"], out
        assert "some ranks but not on others" in out["partly_used"], out
