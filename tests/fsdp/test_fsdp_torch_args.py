"""What torch's FSDP2 takes, in tandem.fully_shard: ``shard_placement_fn``
(expert weights sharded on dim 1 and -1), a list of modules as one unit
(``fully_shard([norm, head])``, the head also called per chunk of a chunked
loss outside the model's forward), and 0-dimensional parameters, which torch
refuses and tandem refuses the same way.

One spawned group of 2 gloo ranks runs every case with tandem and with torch's
fully_shard; each is compared with the other and with one process training on
the global batch. A distributed checkpoint of dim-1-sharded parameters saved
by tandem loads into tandem without the placement function (dim 0) and into
torch's fully_shard with it, and training continues equal.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from test_fsdp import fully_shard_of
from tandem.fsdp import fully_shard
from tandem.testing import as_dtensor, raised_by, run_distributed

WORLD, V, D, E, H, BATCH, SEQ = 2, 19, 8, 3, 6, 8, 5
TOL = 1e-5


class Experts(nn.Module):
    """E experts of a gated MLP, their weights stacked as 3-D parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, E)
        self.w_in = nn.Parameter(torch.randn(E, D, H) * 0.3)    # Shard(1): 8 rows on dim 1
        self.w_out = nn.Parameter(torch.randn(E, H, D) * 0.3)   # Shard(-1): dim 2

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights = self.gate(h).softmax(-1)                                    # (b, t, E)
        hidden = F.gelu(torch.einsum("btd,edh->bteh", h, self.w_in))
        return h + torch.einsum("bteh,ehd,bte->btd", hidden, self.w_out, weights)


class Net(nn.Module):
    def __init__(self, chunked: bool = False) -> None:
        super().__init__()
        self.chunked = chunked
        self.embed = nn.Embedding(V, D)
        self.experts = Experts()
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.experts(self.embed(tokens)))
        return h if self.chunked else self.head(h)


def _loss(model: Net, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    if not model.chunked:
        return F.cross_entropy(out.reshape(-1, V), target.reshape(-1))
    # A chunked loss: the head runs per chunk of the sequence, outside model.forward.
    parts = [F.cross_entropy(model.head(h).reshape(-1, V), y.reshape(-1), reduction="sum")
             for h, y in zip(out.chunk(2, dim=1), target.chunk(2, dim=1))]
    return torch.stack(parts).sum() / target.numel()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randint(0, V, (BATCH, SEQ), generator=g), torch.randint(0, V, (BATCH, SEQ), generator=g)


def _placement(p: nn.Parameter) -> Any:
    from torch.distributed.tensor import Shard
    if p.dim() == 3:
        return Shard(1) if p.shape[1] == D else Shard(-1)
    return None


@dataclass(frozen=True)
class Case:
    impl: str = "tandem"
    placement: bool = False       # shard_placement_fn=_placement on the experts
    group: bool = False           # fully_shard([norm, head]) as one unit
    chunked: bool = False         # the head runs per chunk, outside the model's forward


CASES = {
    "placement": Case(placement=True),
    "group": Case(group=True),
    "group_chunked": Case(group=True, chunked=True),
    "all": Case(placement=True, group=True, chunked=True),
}


def _shard(model: Net, case: Case) -> None:
    shard = fully_shard_of(case.impl, min_unit_bytes=0)
    shard(model.experts, shard_placement_fn=_placement if case.placement else None)
    if case.group:
        shard([model.norm, model.head])
    shard(model)


def _build(case: Case, seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net(case.chunked)
    if case.impl != "local":
        _shard(model, case)
    return model, torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def _step(model: Net, opt: torch.optim.Optimizer, rank: int, world: int, step: int) -> float:
    tokens, target = _batch(step)
    n = BATCH // world
    loss = _loss(model, tokens[rank * n:(rank + 1) * n], target[rank * n:(rank + 1) * n])
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach()
    if world > 1:
        dist.all_reduce(total)
    return total.item() / world


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _train(rank: int, case: Case, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor], dict[str, str], int]:
    """Losses, full parameters, placements, and how often the unit of
    [norm, head] was gathered in the second step (tandem with a group)."""
    model, opt = _build(case)
    gathers: list[str] = []
    group = getattr(model.norm, "_tandem_fsdp_unit", None) if case.group else None
    losses = []
    for step in range(steps):
        if step == 1 and group is not None:
            group.comm.observers.append(lambda e: gathers.append(e.tag) if e.op == "all_gather_into" else None)
        losses.append(_step(model, opt, rank, WORLD, step))
        if step == 1 and group is not None:
            group.comm.observers.clear()
    placements = {n: str(tuple(as_dtensor(p).placements)) for n, p in model.named_parameters()}
    return losses, _full(model), placements, gathers.count(f"unit {group.name}") if group is not None else 0


def _checkpoint(rank: int, path: str) -> dict[str, tuple[list[float], dict[str, torch.Tensor], str]]:
    """Two steps with tandem (dim-1 shards) saved with DCP, then one more step
    after loading into tandem without the placement function and into torch."""
    saver = Case(placement=True)
    model, opt = _build(saver)
    for step in range(2):
        _step(model, opt, rank, WORLD, step)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    dist.barrier()
    out = {}
    for name, case in {"tandem_dim0": Case(), "torch_dim1": Case(impl="torch", placement=True)}.items():
        model, opt = _build(case, seed=7)   # another init: everything comes from the checkpoint
        model_sd, optim_sd = get_state_dict(model, opt)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loss = _step(model, opt, rank, WORLD, 2)
        out[name] = ([loss], _full(model), str(tuple(as_dtensor(model.experts.w_in).placements)))
    return out


def _full_load(rank: int) -> float:
    """A full (single-process) state dict loaded into a model with dim-1 shards
    and a group unit: the largest difference to the source."""
    from tandem.fsdp import load_full_state_dict
    torch.manual_seed(3)
    source = Net().state_dict()
    model, _ = _build(Case(placement=True, group=True))
    result = load_full_state_dict(model, source)
    assert not result.missing_keys and not result.unexpected_keys, result
    return _max_diff(_full(model), source)


def _scalar_refusals(rank: int) -> dict[str, tuple[str, str]]:
    from torch.distributed.fsdp import fully_shard as torch_shard
    out = {}
    for impl, shard in (("tandem", fully_shard), ("torch", torch_shard)):
        model = nn.Linear(4, 4)
        model.temperature = nn.Parameter(torch.tensor(0.07))
        try:
            shard(model)
            out[impl] = ("", "accepted")
        except Exception as e:  # noqa: BLE001 - the test inspects the type and message
            out[impl] = (type(e).__name__, str(e))
    return out


def _refusals(rank: int) -> dict[str, tuple[str, str] | None]:
    from torch.distributed.tensor import Shard

    calls = {
        "uneven_dim1": lambda: fully_shard(nn.Linear(3, 5), shard_placement_fn=lambda p: Shard(1) if p.dim() == 2
                                           else None),  # 3 columns over 2 ranks
        "dim_out_of_range": lambda: fully_shard(nn.Linear(2, 2), shard_placement_fn=lambda p: Shard(2)),
        "not_a_shard": lambda: fully_shard(nn.Linear(2, 2), shard_placement_fn=lambda p: "dim 1"),
        "not_modules": lambda: fully_shard([nn.Linear(2, 2), "head"]),  # type: ignore[type-var]
        "group_as_root": lambda: _group_root(),
        "dp_mesh_dims": lambda: fully_shard(nn.Linear(2, 2), dp_mesh_dims=("dp",)),
    }
    return raised_by(calls)


def _group_root() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    group: list[nn.Module] = [a, b]
    fully_shard(group)
    b(a(torch.randn(1, 2)))


def _worker(rank: int, world_size: int, path: str) -> dict:
    out: dict = {"cases": {}}
    for name, case in CASES.items():
        out["cases"][name] = _train(rank, case)
        out["cases"]["torch_" + name] = _train(rank, Case(impl="torch", placement=case.placement,
                                                          group=case.group, chunked=case.chunked))
    out["checkpoint"] = _checkpoint(rank, path)
    out["full_load"] = _full_load(rank)
    out["scalar"] = _scalar_refusals(rank)
    out["refusals"] = _refusals(rank)
    return out


@functools.cache
def _results() -> list[dict]:
    path = tempfile.mkdtemp(prefix="tandem-fsdp-args-")
    try:
        return run_distributed(_worker, WORLD, args=(f"{path}/ckpt",), timeout=240)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@functools.cache
def _local(chunked: bool, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the global batch (the mean of the ranks' mean losses)."""
    model, opt = _build(Case(impl="local", chunked=chunked))
    losses = []
    for step in range(steps):
        tokens, target = _batch(step)
        n = BATCH // WORLD
        loss = torch.stack([_loss(model, tokens[r * n:(r + 1) * n], target[r * n:(r + 1) * n])
                            for r in range(WORLD)]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, _full(model)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("name", list(CASES))
def test_equal_to_torchs_fully_shard_and_to_one_process(name: str) -> None:
    local_losses, local = _local(CASES[name].chunked)
    for rank, r in enumerate(_results()):
        losses, params, placements, _ = r["cases"][name]
        t_losses, t_params, t_placements, _ = r["cases"]["torch_" + name]
        assert max(abs(a - b) for a, b in zip(losses, t_losses)) <= TOL, (rank, losses, t_losses)
        assert _max_diff(params, t_params) <= TOL, rank
        assert max(abs(a - b) for a, b in zip(losses, local_losses)) <= TOL, (rank, losses, local_losses)
        assert _max_diff(params, local) <= TOL, rank
        assert placements == t_placements, (rank, placements, t_placements)


def test_the_placement_function_shards_expert_weights_on_dim_1_and_minus_1() -> None:
    _, _, placements, _ = _results()[0]["cases"]["placement"]
    assert placements["experts.w_in"] == "(Shard(dim=1),)"
    assert placements["experts.w_out"] == "(Shard(dim=2),)"
    assert placements["experts.gate.weight"] == "(Shard(dim=0),)"


def test_a_dcp_checkpoint_of_dim1_shards_loads_into_dim0_tandem_and_into_torch() -> None:
    losses, ref = _local(False)
    for rank, r in enumerate(_results()):
        for name, (loss, params, _) in r["checkpoint"].items():
            assert abs(loss[0] - losses[2]) <= TOL, (rank, name, loss, losses)
            assert _max_diff(params, ref) <= TOL, (rank, name)
        assert r["checkpoint"]["tandem_dim0"][2] == "(Shard(dim=0),)"
        assert r["checkpoint"]["torch_dim1"][2] == "(Shard(dim=1),)"


def test_a_scalar_parameter_is_refused_as_torch_refuses_it() -> None:
    for rank, r in enumerate(_results()):
        ours, theirs = r["scalar"]["tandem"], r["scalar"]["torch"]
        assert theirs[0] == "ValueError" and "scalar" in theirs[1], theirs   # torch's own verdict
        assert ours[0] == theirs[0], (ours, theirs)
        assert f"rank {rank}" in ours[1] and "'temperature'" in ours[1] and "reshape(1)" in ours[1]


def test_what_is_still_refused_names_the_value_and_the_fix() -> None:
    for r in _results():
        e = r["refusals"]
        assert e["uneven_dim1"][0] == "ValueError" and "'weight'" in e["uneven_dim1"][1]
        assert "3 rows on dim 1" in e["uneven_dim1"][1] and "Shard(0) or None" in e["uneven_dim1"][1]
        assert e["dim_out_of_range"][0] == "ValueError" and "0 <= d < 2" in e["dim_out_of_range"][1]
        assert e["not_a_shard"][0] == "TypeError" and "'dim 1'" in e["not_a_shard"][1]
        assert e["not_modules"][0] == "TypeError" and "a list holding a str" in e["not_modules"][1]
        assert e["group_as_root"][0] == "RuntimeError" and "cannot be the root" in e["group_as_root"][1]
        assert e["dp_mesh_dims"][0] == "NotImplementedError" and "dp_mesh_dims=('dp',)" in e["dp_mesh_dims"][1]
        assert "mesh=mesh['dp']" in e["dp_mesh_dims"][1]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_layout_of_other_dims_is_torch_chunk_along_them(world: int) -> None:
    from tandem.fsdp import plan_unit
    shapes, dims = [(3, 8, 4), (5,), (2, 4), (6, 2, 8)], [1, 0, 1, 2]
    layouts = [plan_unit(shapes, world, r, dims) for r in range(world)]
    assert len({lay.shard_numel for lay in layouts}) == 1
    for k, (shape, d) in enumerate(zip(shapes, dims)):
        p = torch.arange(float(torch.Size(shape).numel())).view(shape)
        chunks = list(torch.chunk(p, world, dim=d)) + [p.narrow(d, 0, 0)] * world
        rows = [p.narrow(d, lay.params[k].row_start, lay.params[k].local_rows) for lay in layouts]
        for r, lay in enumerate(layouts):
            assert lay.params[k].local_shape == tuple(chunks[r].shape) and torch.equal(rows[r], chunks[r])
        assert torch.equal(torch.cat(rows, dim=d), p)
    with pytest.raises(ValueError, match="3 rows on dim 1, not a multiple of the 2 ranks"):
        plan_unit([(4, 3)], 2, 0, [1])


@pytest.mark.parametrize("name", ["group", "group_chunked"])
def test_a_group_is_gathered_once_for_its_modules(name: str) -> None:
    # In one step: once in forward for norm and head together (resharded after
    # the head, or at the end of the root's forward and once more for the
    # chunked head calls, which keep it until backward), once in backward; a
    # unit per module would gather three times.
    for rank, r in enumerate(_results()):
        assert r["cases"][name][3] == 2, (rank, r["cases"][name][3])


def test_a_full_state_dict_loads_into_dim1_shards_and_a_group() -> None:
    assert [r["full_load"] for r in _results()] == [0.0] * WORLD
