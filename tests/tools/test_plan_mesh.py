"""``tandem plan`` on a 2-D mesh (dp x tp) with torch's tensor parallelism
(Note [planning a tensor-parallel mesh] in tandem/planner/tensor_parallel.py): the local
shapes it derives from a ``tp_plan``, the report and the command line, and its
prediction against the bytes rank 0 of a 2 x 2 gloo mesh really holds after
training steps under tandem's DDP and fully_shard over ``mesh["dp"]``."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import tandem
from tandem.planner.memory import estimate_memory
from tandem.planner.tensor_parallel import parse_mesh, tensor_parallel_shards
from tandem.testing import run_distributed
from tandem.testing.models import TinyLM
from tandem.tools.plan import main, plan, plan_report

D, HIDDEN, VOCAB = 10, 42, 33   # HIDDEN / tp = 21 rows: uneven over dp; VOCAB / tp: 17 and 16 rows


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up, self.down = nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(TinyLM):
    def __init__(self) -> None:
        super().__init__(VOCAB, D, [Block(), Block()])


def tp_plan() -> dict:
    """What the 2 x 2 runs give parallelize_module (and --tp-plan loads)."""
    return {"emb": RowwiseParallel(input_layouts=Replicate()),
            "blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}


def model() -> Net:
    torch.manual_seed(0)
    return Net()


def _sample(step: int = 0, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    idx = torch.randint(0, VOCAB, (4, 7), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ---------------------------------------------------------------------- the local shapes

def test_local_shapes_follow_torchs_styles_and_chunking() -> None:
    # By hand: Colwise Linear shards weight and bias on dim 0, Rowwise Linear the
    # weight on dim 1 and replicates the bias; Rowwise Embedding dim 0, Colwise
    # Embedding dim 1; chunks of ceil(n / tp) rows, tp rank 0's.
    net = Net()
    shards = {s.name: (s.dim, s.local_shape) for s in tensor_parallel_shards(net, tp_plan(), 4)}
    assert shards == {
        "emb.weight": (0, (9, D)),                                  # ceil(33 / 4)
        **{f"blocks.{i}.up.weight": (0, (11, D)) for i in (0, 1)},  # ceil(42 / 4)
        **{f"blocks.{i}.up.bias": (0, (11,)) for i in (0, 1)},
        **{f"blocks.{i}.down.weight": (1, (D, 11)) for i in (0, 1)},
        **{f"blocks.{i}.down.bias": (None, (D,)) for i in (0, 1)},
    }
    # strings name the same styles; a nested dict and "" are resolved as torch does
    strings = {"emb": "rowwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
    assert tensor_parallel_shards(net, strings, 4) == tensor_parallel_shards(net, tp_plan(), 4)
    nested: dict[str, Any] = {"blocks": {"0": {"": ColwiseParallel()}} | {"1.up": "colwise"}}
    with pytest.raises(ValueError, match="matches 'blocks.0', a Block: colwise parallelism shards only nn.Linear"):
        tensor_parallel_shards(net, nested, 2)
    nested = {"blocks": {"*": {"up": "colwise", "norm": SequenceParallel()}, "0.down": PrepareModuleInput()},
              "emb": ColwiseParallel()}
    got = {s.name: (s.key, s.style, s.dim, s.local_shape) for s in tensor_parallel_shards(net, nested, 3)}
    assert got == {
        **{f"blocks.{i}.up.{p}": ("blocks.*.up", "colwise", 0, (14, *s))
           for i in (0, 1) for p, s in (("weight", (D,)), ("bias", ()))},
        **{f"blocks.{i}.norm.{p}": ("blocks.*.norm", "sequence", None, (D,))
           for i in (0, 1) for p in ("weight", "bias")},
        "emb.weight": ("emb", "colwise", 1, (VOCAB, 4)),          # ceil(10 / 3)
    }


def test_a_bad_plan_names_the_key_and_the_fix() -> None:
    net = Net()
    with pytest.raises(ValueError, match="tp_plan key 'blocks.*.mlp' matches no module: 'mlp' matches no child "
                                         "of 'blocks.0' \\(Block, children: norm, up, down\\)"):
        tensor_parallel_shards(net, {"blocks.*.mlp": "colwise"}, 2)
    with pytest.raises(ValueError, match="tp_plan\\['head'\\] is 'columnwise': give ColwiseParallel"):
        tensor_parallel_shards(net, {"head": "columnwise"}, 2)
    with pytest.raises(ValueError, match="tensor_parallel=2 needs tp_plan"):
        plan_report(net, world_size=2, tensor_parallel=2)
    with pytest.raises(ValueError, match="tensor_parallel must be an int >= 1"):
        tensor_parallel_shards(net, {}, 0)
    with pytest.raises(ValueError, match="'blocks.0.up.weight' would be distributed twice"):
        tensor_parallel_shards(net, {"blocks.0.up": "colwise", "blocks.*.up": "rowwise"}, 2)
    with pytest.raises(ValueError, match="local_shapes names \\['up.weight'\\], not parameters of Net"):
        estimate_memory(net, 2, local_shapes={"up.weight": (1, D)})
    assert parse_mesh("dp=2,tp=4") == (2, 4) and parse_mesh("tp=4, dp=3") == (3, 4) and parse_mesh("dp=8") == (8, 1)
    for bad in ("dp=2,pp=2", "2x2", "dp=0,tp=2", "dp=2,dp=2", "tp=2"):
        with pytest.raises(ValueError, match="mesh"):
            parse_mesh(bad)


def test_the_report_is_per_rank_of_the_mesh_and_refuses_zero() -> None:
    net = Net()
    r = plan(net, world_size=2, tensor_parallel=2, tp_plan=tp_plan(), sample=_sample(), loss_fn=_loss)
    # by hand: emb 17 x 10, each up 21 x 10 + 21, each down 10 x 21 + 10, norms 2 x 10, head 33 x 10 + 33
    local = 17 * D + 2 * (21 * D + 21 + D * 21 + D + 2 * D) + VOCAB * D + VOCAB
    assert r.num_local == local and r.param_bytes == 4 * local and r.ranks == 4
    assert r.num_params == sum(p.numel() for p in net.parameters())
    assert r.strategies[0].estimate.params == 4 * local and r.strategies[0].estimate.optimizer == 8 * local
    assert [s.refused is not None for s in r.strategies] == [False, True, True, False]
    assert r.global_batch == 4 * 2   # tp peers share a batch: per-rank batch x dp
    text = r.describe()
    assert "on a 2 x 2 mesh (dp=2 x tp=2 = 4 ranks)" in text
    assert "blocks.*.up: weight    colwise   Shard(0)     42x10 -> 21x10  (x2)" in text
    assert "ZeRO-1               n/a  tandem's DDP does not shard tensor-parallel" in text
    assert "unsharded, in one process: an overestimate for the tensor-parallel layers" in text
    # the choice skips what tandem cannot run; without a plan, nothing changes
    ddp, fsdp = r.strategies[0].peak, r.strategies[3].peak
    tight = plan_report(net, world_size=2, tensor_parallel=2, tp_plan=tp_plan(), measurement=r.measurement,
                        device_memory=min(ddp, fsdp))
    assert tight.choice is not None and tight.choice.name == ("DDP" if ddp <= fsdp else "fully_shard")
    plain = plan_report(net, world_size=2)
    assert plain.num_local == plain.num_params and all(s.refused is None for s in plain.strategies)
    assert "tensor parallel" not in plain.describe() and "on 2 rank(s)" in plain.describe()


def test_command_line_with_a_mesh(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "test_plan_mesh:model", "--tp-plan", "test_plan_mesh:tp_plan", "--mesh", "dp=2,tp=2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Net on a 2 x 2 mesh (dp=2 x tp=2 = 4 ranks)" in out and "emb: weight" in out
    assert main([*argv[:-1], "dp=2,xp=2"]) == 2
    assert "mesh 'dp=2,xp=2' is not 'dp=N,tp=M'" in capsys.readouterr().err
    assert main(["--model", "test_plan_mesh:model", "--mesh", "dp=2,tp=2"]) == 2
    assert "tensor_parallel=2 needs tp_plan" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # one of --world-size and --mesh
        main(["--model", "test_plan_mesh:model", "--world-size", "4", "--mesh", "dp=2,tp=2"])


# ---------------------------------------------------------------------- measured on a 2 x 2 mesh

@dataclass
class Held:
    params: int
    grads: int
    optimizer: int
    buckets: object = None                   # DDP: the plan its reducer made at construction
    units: tuple[tuple[str, int], ...] = ()  # fully_shard: (name, shard elements) of each unit


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors: list[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        s = _local(t).untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _train(rank: int, mesh: DeviceMesh, wrapper: str, min_unit_bytes: int = 0) -> Held:
    net = parallelize_module(model(), mesh["tp"], tp_plan())
    buckets = None
    reducer = None
    wrapped: nn.Module
    if wrapper == "ddp":
        ddp = tandem.DistributedDataParallel(net, device_mesh=mesh["dp"])
        reducer = ddp.reducer
        assert reducer is not None
        buckets = reducer.plan
        wrapped = ddp
    else:
        blocks = net.get_submodule("blocks")
        assert isinstance(blocks, nn.ModuleList)
        for block in blocks:
            tandem.fully_shard(block, mesh=mesh["dp"], min_unit_bytes=min_unit_bytes)
        wrapped = tandem.fully_shard(net, mesh=mesh["dp"], min_unit_bytes=min_unit_bytes)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    dp = mesh["dp"].get_local_rank()
    for step in range(2):
        x, y = _sample(step, dp)
        opt.zero_grad(set_to_none=True)
        _loss(wrapped(x), y).backward()
        opt.step()
    seen: set[int] = set()
    params = _bytes(list(net.parameters()), seen)
    grads = _bytes([p.grad for p in net.parameters() if p.grad is not None], seen)
    units: tuple[tuple[str, int], ...] = ()
    if wrapper == "ddp":
        assert reducer is not None
        grads += _bytes([*reducer.buffer.flat.values(), *reducer.buffer.solo.values()], seen)
    else:
        found = []
        for m in net.modules():
            u = getattr(m, "_tandem_fsdp_unit", None)
            if u is not None and u not in found:
                found.append(u)
        units = tuple(("" if u.name == "<root>" else u.name, u.params.layout.shard_numel) for u in found)
    optimizer = _bytes([v for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"],
                       seen)
    return Held(params, grads, optimizer, buckets, units)


def _worker(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out: dict = {"ddp": _train(rank, mesh, "ddp"), "fully_shard": _train(rank, mesh, "fsdp"),
                 "fully_shard_merged": _train(rank, mesh, "fsdp", min_unit_bytes=2**18)}
    try:
        tandem.DistributedDataParallel(parallelize_module(model(), mesh["tp"], tp_plan()),
                                       device_mesh=mesh["dp"], zero_stage=1)
    except ValueError as e:
        out["zero"] = str(e)
    return out


@functools.cache
def _measured() -> list[dict]:
    return run_distributed(_worker, 4, timeout=180)


@pytest.mark.parametrize("case", ["ddp", "fully_shard", "fully_shard_merged"])
def test_predicted_memory_is_what_rank_0_of_the_mesh_holds(case: str) -> None:
    min_unit_bytes = 2**18 if case == "fully_shard_merged" else 0
    report = plan(model(), world_size=2, tensor_parallel=2, tp_plan=tp_plan(), min_unit_bytes=min_unit_bytes)
    predicted = report.strategies[0 if case == "ddp" else 3].estimate
    results = _measured()
    for rank, r in enumerate(results):
        got: Held = r[case]
        if case == "ddp" and rank % 2 == 0:   # ranks 0 and 2 are tp rank 0: its shards are planned
            assert got.buckets == predicted.buckets, (rank, "DDP planned other buckets than tandem plan")
        else:
            planned = tuple((u.name, u.layout.shard_numel) for u in predicted.units)
            assert [n for n, _ in got.units] == [n for n, _ in planned], rank
            if rank == 0:
                assert got.units == planned
        held = (got.params, got.grads, got.optimizer)
        want = (predicted.params, predicted.grads, predicted.optimizer)
        if rank == 0:   # tp rank 0 and dp rank 0: the largest shards, planned byte for byte
            assert held == want, (case, held, want)
        else:           # the others hold shorter chunks, or the same
            assert all(h <= w for h, w in zip(held, want)), (rank, case, held, want)


def test_zero_is_refused_at_run_time_as_the_plan_says() -> None:
    for rank, r in enumerate(_measured()):
        assert "zero_stage=1" in r["zero"] and f"rank {rank}" in r["zero"], r.get("zero")
