"""fully_shard's state in and out, and the methods that steer it by hand.

- a torch.distributed.checkpoint saved on 2 ranks resumes on 3 and continues
  exactly as one uninterrupted process would;
- a full state dict written by single-process training loads straight into a
  sharded model (memory-mapped: each rank reads its own rows);
- reshard_after_forward=2 on 4 ranks (backward gathers over pairs of ranks);
- unshard/reshard, explicit prefetch lists, set_reshard_after_backward;
- bad arguments raise, naming the value.

The spawned runs are cases of one group per world size (tandem.testing.run_cases,
the module fixture ``runs``); each test reads its own.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_fsdp import Block, Case, Net, distributed, local_training, max_diff, shard, tandem_units, train_step
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tandem.fsdp import fully_shard, load_full_state_dict
from tandem.fsdp.unit_state import ShardState
from tandem.testing import Case as Run
from tandem.testing import as_fsdp, raised_by, run_cases, run_distributed, sharded_unit

TOL = 1e-5
STEPS = 4  # two on 2 ranks, two on 3


def _save_after_two_steps(rank: int, world_size: int, path: str) -> list[float]:
    case = Case(steps=STEPS)
    torch.manual_seed(0)
    model = Net()
    shard(model, case)
    opt = _adamw(model)
    losses = [train_step(model, opt, case, rank, world_size, step) for step in range(2)]
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return losses


def _resume_and_finish(rank: int, world_size: int, path: str) -> tuple[list[float], dict]:
    case = Case(steps=STEPS)
    torch.manual_seed(123)  # another init: everything must come from the checkpoint
    model = Net()
    shard(model, case)
    opt = _adamw(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    # Block.alt and Block.unused never get a gradient here, so AdamW saved no state
    # for them, while the template made by get_state_dict has some: load partially.
    dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = [train_step(model, opt, case, rank, world_size, step) for step in range(2, STEPS)]
    return losses, {k: v.full_tensor() for k, v in model.state_dict().items()}


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    from test_fsdp import _optimizer
    return _optimizer(model, Case())


def test_dcp_checkpoint_saved_on_2_ranks_resumes_on_3(runs) -> None:
    first = runs[2]["save"][0]
    rest, params = runs[3]["resume"][0]
    # The uninterrupted reference: one process on the global batch. Its batch
    # split does not matter (the mean over equal parts is the global mean).
    losses, ref = local_training(Case(steps=STEPS), world_size=6)
    assert max(abs(a - b) for a, b in zip(first + rest, losses)) <= TOL, (first + rest, losses)
    assert max_diff(params, ref) <= TOL


def _load_full(rank: int, world_size: int, path: str) -> tuple[dict, list[float], dict]:
    torch.manual_seed(5)
    model = Net()
    shard(model, Case())
    missing = load_full_state_dict(model, path)
    assert not missing.missing_keys and not missing.unexpected_keys
    loaded = {k: v.full_tensor() for k, v in model.state_dict().items()}
    # The large-model path: built on the meta device, sharded, given memory, loaded.
    with torch.device("meta"):
        model = Net()
    shard(model, Case())
    model.to_empty(device="cpu")
    load_full_state_dict(model, path)
    opt = _adamw(model)
    losses = [train_step(model, opt, Case(), rank, world_size, step) for step in range(2)]
    return loaded, losses, {k: v.full_tensor() for k, v in model.state_dict().items()}


def _full_model() -> Net:
    torch.manual_seed(0)
    return Net()


def test_full_state_dict_loads_into_a_sharded_model_also_built_on_meta(runs) -> None:
    model = _full_model()  # saved by the fixture, as single-process training's checkpoint
    loaded, losses, params = runs[3]["load_full"][0]
    assert max_diff(loaded, model.state_dict()) == 0.0
    ref_losses, ref = local_training(Case(steps=2), world_size=3)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL
    assert max_diff(params, ref) <= TOL


def _grouped_reshard(rank: int, world_size: int) -> tuple:
    out = distributed(rank, world_size, Case(reshard=2, steps=3))
    return out.losses, out.params, out.events


def test_reshard_after_forward_to_a_group_of_two_of_four_ranks(runs) -> None:
    losses, params, events = runs[4]["grouped"][0]
    ref_losses, ref = local_training(Case(steps=3), world_size=4)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL
    assert max_diff(params, ref) <= TOL
    # Per unit (root included: reshard=2 everywhere) a gather over all 4 ranks in
    # forward, of a 1/4 shard, and one over a pair in backward, of a 1/2 slice.
    gathers = [numel for op, _, numel in events if op == "all_gather_into"]
    assert len(gathers) == 8, gathers
    assert sorted(gathers[4:]) == sorted(2 * n for n in gathers[:4]), gathers


def _explicit_control(rank: int, world_size: int) -> dict:
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = Net()
    shard(model, Case())
    block = model.layers[0]
    assert isinstance(block, Block)
    sharded = as_fsdp(block)
    found: dict = {}
    sharded.unshard()
    found["unsharded_is_plain"] = not isinstance(block.fc1.weight, DTensor) and block.fc1.weight.shape == (60, 20)
    sharded.reshard()
    found["resharded_is_dtensor"] = isinstance(block.fc1.weight, DTensor)
    handle = sharded.unshard(async_op=True)
    assert handle is not None
    handle.wait()
    found["async_unshard"] = sharded_unit(block).state is ShardState.UNSHARDED
    sharded.reshard()
    # Explicit forward prefetch: layers.0 starts the gathers of layers.1 and layers.2.
    sharded.set_modules_to_forward_prefetch([as_fsdp(model.layers[1]), as_fsdp(model.layers[2])])
    states: list = []
    block.fc1.register_forward_pre_hook(
        lambda *_: states.append([u.state.name for u in tandem_units(model)]))
    # Keep parameters between the micro-batches of an accumulation: the second
    # forward needs no gather; the synchronising backward reshards all the same.
    as_fsdp(model).set_reshard_after_backward(False)
    opt = _adamw(model)
    case = Case(steps=2, micro=2)
    found["losses"] = [train_step(model, opt, case, rank, world_size, step) for step in range(2)]
    found["after_step"] = [u.state.name for u in tandem_units(model)]
    found["prefetched"] = states[0][2:]      # layers.1 and layers.2 when layers.0 starts
    found["second_micro_batch"] = states[1]  # every unit, kept from the first micro-batch
    found["state_dict_keys"] = sorted(model.state_dict())
    found["errors"] = _errors(model, world_size)
    found["all_used"] = _all_used_accumulation(rank, world_size)
    return found


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _mlp_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + micro)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _all_used_accumulation(rank: int, world_size: int) -> tuple[dict, list]:
    """Every parameter used: a unit completes both by its gradients and by its
    inputs' gradient in one backward (Note [unit completion]); with accumulation."""
    model = _mlp()
    for i in (0, 2, 4):
        fully_shard(model[i], min_unit_bytes=0)
    fully_shard(model, min_unit_bytes=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n = 8 // world_size
    states = []
    for step in range(3):
        for m in range(2):
            as_fsdp(model).set_requires_gradient_sync(m == 1)
            x, y = _mlp_batch(step, m)
            (nn.functional.mse_loss(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]) / 2).backward()
            states += [u.reduce_state.name for u in tandem_units(model)]
        opt.step()
        opt.zero_grad()
    return {k: v.full_tensor() for k, v in model.state_dict().items()}, states


def _dim1(param: nn.Parameter) -> object:
    from torch.distributed.tensor import Shard
    return Shard(1) if param.dim() == 2 else None


def _errors(model: nn.Module, world_size: int) -> dict:
    return raised_by({
        "twice": lambda: fully_shard(model),
        "bad_reshard": lambda: fully_shard(nn.Linear(2, 2), reshard_after_forward=world_size + 1),
        "placement": lambda: fully_shard(nn.Linear(3, 2), shard_placement_fn=_dim1),  # 3 columns, 2 ranks
        "mixed_dtypes": lambda: fully_shard(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())),
        "not_a_module": lambda: fully_shard("linear"),  # type: ignore[type-var]
    })


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("fsdp_state")
    torch.save(_full_model().state_dict(), tmp / "model.pt")
    ckpt = str(tmp / "ckpt")
    # The checkpoint is saved by the 2-rank group before the 3-rank group resumes it.
    return {2: run_cases({"save": Run(_save_after_two_steps, args=(ckpt,), timeout=120),
                          "control": Run(_explicit_control, timeout=120)}, 2),
            3: run_cases({"resume": Run(_resume_and_finish, args=(ckpt,), timeout=120),
                          "load_full": Run(_load_full, args=(str(tmp / "model.pt"),), timeout=120)}, 3),
            4: run_cases({"grouped": Run(_grouped_reshard, timeout=120)}, 4)}


@pytest.fixture
def control(runs) -> dict:
    return runs[2]["control"][0]


def test_unshard_reshard_and_explicit_prefetch(control) -> None:
    found = control
    assert found["unsharded_is_plain"] and found["resharded_is_dtensor"] and found["async_unshard"]
    assert all(s in ("GATHERING", "UNSHARDED") for s in found["prefetched"]), found["prefetched"]


def test_reshard_after_backward_false_keeps_units_gathered_while_accumulating(control) -> None:
    found = control
    assert set(found["second_micro_batch"]) == {"UNSHARDED"}, found["second_micro_batch"]
    assert set(found["after_step"]) == {"SHARDED"}
    ref, _ = local_training(Case(steps=2, micro=2), world_size=2)
    assert max(abs(a - b) for a, b in zip(found["losses"], ref)) <= TOL
    assert found["state_dict_keys"] == sorted(Net().state_dict())


def test_units_whose_parameters_are_all_used_complete_once_per_backward(control) -> None:
    params, states = control["all_used"]
    assert set(states) == {"IDLE"}, states  # nothing left queued after any backward
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        for m in range(2):
            x, y = _mlp_batch(step, m)
            (nn.functional.mse_loss(model(x), y) / 2).backward()
        opt.step()
        opt.zero_grad()
    assert max_diff(params, model.state_dict()) <= TOL


def test_bad_arguments_raise_with_the_value(control) -> None:
    errors = control["errors"]
    assert errors["twice"][0] == "ValueError" and "already applied" in errors["twice"][1]
    assert errors["bad_reshard"][0] == "ValueError" and "reshard_after_forward=3" in errors["bad_reshard"][1]
    assert errors["placement"][0] == "ValueError" and "3 rows on dim 1" in errors["placement"][1]
    assert errors["mixed_dtypes"][0] == "ValueError" and "torch.float64" in errors["mixed_dtypes"][1]
    assert errors["not_a_module"][0] == "TypeError"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_world_of_one_matches_torch_and_records_peak_memory() -> None:
    results = run_distributed(_cuda_peak, 1, backend="nccl", timeout=180)[0]
    assert results["tandem"]["max_diff_to_torch"] <= TOL
    print(results)


def _cuda_peak(rank: int, world_size: int) -> dict:
    torch.cuda.set_device(0)
    out: dict = {}
    params = {}
    for impl in ("torch", "tandem"):
        torch.manual_seed(0)
        model = Net(depth=6).cuda()
        torch.cuda.reset_peak_memory_stats()
        shard(model, Case(impl=impl))
        opt = torch.optim.AdamW(model.parameters(), lr=0.02)
        case = Case()
        for step in range(3):
            train_step(model, opt, case, rank, world_size, step)
        params[impl] = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
        out[impl] = {"max_memory_allocated": torch.cuda.max_memory_allocated()}
    out["tandem"]["max_diff_to_torch"] = max_diff(params["tandem"], params["torch"])
    return out
