"""Activation checkpointing with fully_shard and with DDP (Note [recomputed
forward] in tandem/fsdp/schedule.py).

Three ways to checkpoint, as torchtitan and torch's tutorials do: torch's
non-reentrant ``checkpoint(..., use_reentrant=False)`` inside a block's
forward (the MLP), ``checkpoint_wrapper`` on each block, and
``apply_activation_checkpointing`` over the model, both before ``fully_shard``;
and ``checkpoint_wrapper`` around blocks already sharded (the recomputation then
runs the unit's own forward hooks inside backward). Each trains (float64, 2
ranks, 3 steps) to the same parameters as tandem without checkpointing, as
torch's FSDP2 / DDP with the same checkpointing, and as one process on the
global batch; and fully_shard gathers each unit exactly as often as without
checkpointing: once for forward and once for backward, the recomputation
reusing the backward's gather. All cases run in one spawned group.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

import tandem
from tandem.fsdp import fully_shard
from tandem.testing import max_abs_diff, run_distributed
from tandem.testing.models import GPT, GPTBlock

VOCAB, DIM, DEPTH, SEQ, BATCH, STEPS = 32, 16, 3, 8, 2, 3
TOL = 1e-12


@dataclass(frozen=True)
class Case:
    wrap: str = "fsdp"           # "fsdp", "ddp" or "local" (one process, the global batch)
    impl: str = "tandem"         # or "torch"
    ac: str = "none"             # "inner", "wrapper", "apply", "wrapper_after" (fsdp only)
    reshard: bool | None = None  # fully_shard's reshard_after_forward for the blocks


def _model(ac: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(VOCAB, DIM, DEPTH, checkpoint_mlp=ac == "inner").double()
    if ac == "wrapper":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    elif ac == "apply":
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda m: isinstance(m, GPTBlock))
    return model


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _global_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [_batch(step, r) for r in range(world_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _shard(model: GPT, case: Case, world_size: int) -> list[Any]:
    """fully_shard per block and at the root; returns tandem's units."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    shard: Any = (functools.partial(fully_shard, mesh=mesh, min_unit_bytes=0) if case.impl == "tandem"
                  else functools.partial(torch_fully_shard, mesh=mesh))
    for block in model.blocks:
        shard(block, reshard_after_forward=case.reshard)
    shard(model)
    if case.ac == "wrapper_after":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    return [u for m in model.modules() if (u := getattr(m, "_tandem_fsdp_unit", None)) is not None]


def _run(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    model = _model(case.ac)
    gathers: Counter[str] = Counter()
    if case.wrap == "fsdp":
        def count(event: Any) -> None:
            if event.op == "all_gather_into":  # tagged "unit <path>" (named at the root's first forward)
                gathers.update([event.tag.removeprefix("unit ").replace("._checkpoint_wrapped_module", "")])

        for comm in {id(u.comm): u.comm for u in _shard(model, case, world_size)}.values():
            comm.observers.append(count)
        run: nn.Module = model
    elif case.wrap == "ddp":
        run = (tandem.DistributedDataParallel(model) if case.impl == "tandem"
               else nn.parallel.DistributedDataParallel(model))
    else:
        run = model
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        gathers.clear()  # the last step's count stays
        tokens, target = _global_batch(step, world_size) if case.wrap == "local" else _batch(step, rank)
        F.cross_entropy(run(tokens).flatten(0, 1), target.flatten()).backward()
        opt.step()
        opt.zero_grad()
    params = {}
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_fsdp_wrapped_module.", "")
        params[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return {"params": params, "gathers": dict(gathers)}


CASES = {
    "local": Case(wrap="local"),
    **{f"{impl}_fsdp_{ac}": Case(impl=impl, ac=ac)
       for impl in ("tandem", "torch") for ac in ("none", "inner", "wrapper", "apply", "wrapper_after")},
    "tandem_fsdp_wrapper_keep": Case(ac="wrapper", reshard=False),
    "tandem_fsdp_none_keep": Case(reshard=False),
    **{f"{impl}_ddp_{ac}": Case(wrap="ddp", impl=impl, ac=ac)
       for impl in ("tandem", "torch") for ac in ("none", "inner", "wrapper", "apply")},
}


def _grid(rank: int, world_size: int) -> dict[str, Any]:
    out = {}
    for name, case in CASES.items():
        try:
            out[name] = _run(rank, world_size, case)
        except Exception as e:  # one broken case must not hide the others
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


@functools.cache
def _results() -> list[dict[str, Any]]:
    return run_distributed(_grid, 2, timeout=300)


def _get(results: dict[str, Any], name: str) -> dict[str, Any]:
    assert "error" not in results[name], f"{name}: {results[name]['error']}"
    return results[name]


AC = ["inner", "wrapper", "apply"]


# checkpoint_wrapper after wrapping: around sharded blocks under fully_shard; under
# DDP wrapping the blocks after wrapping the model is wrapping them before, 'wrapper'.
@pytest.mark.parametrize("wrap, ac", [("fsdp", ac) for ac in AC + ["wrapper_after"]] + [("ddp", ac) for ac in AC])
def test_checkpointed_training_equals_torch_and_no_checkpointing(wrap: str, ac: str) -> None:
    for rank, results in enumerate(_results()):
        got = _get(results, f"tandem_{wrap}_{ac}")["params"]
        for ref in (f"tandem_{wrap}_none", f"torch_{wrap}_{ac}", "local"):
            diff = max_abs_diff(got, _get(results, ref)["params"])
            assert diff <= TOL, f"rank {rank}: tandem_{wrap}_{ac} vs {ref}: max abs diff {diff:.3g}"


def test_checkpointing_with_units_kept_after_forward() -> None:
    for results in _results():
        got = _get(results, "tandem_fsdp_wrapper_keep")["params"]
        assert max_abs_diff(got, _get(results, "local")["params"]) <= TOL


@pytest.mark.parametrize("ac", AC + ["wrapper_after"])
def test_recomputation_reuses_the_backward_gather(ac: str) -> None:
    for results in _results():
        gathers = _get(results, f"tandem_fsdp_{ac}")["gathers"]
        # Without checkpointing: each block once in forward, once in backward; the root once.
        assert gathers == _get(results, "tandem_fsdp_none")["gathers"], gathers
        assert gathers == {"<root>": 1, **{f"blocks.{i}": 2 for i in range(DEPTH)}}, gathers
    for results in _results():  # kept after forward: one gather per block and step
        assert _get(results, "tandem_fsdp_wrapper_keep")["gathers"] == \
            _get(results, "tandem_fsdp_none_keep")["gathers"] == {"<root>": 1, **{f"blocks.{i}": 1
                                                                                for i in range(DEPTH)}}
