"""tandem.prepare against references: a hand-written loop with tandem's DDP and
torch's DistributedSampler, one process training on the global batch, and torch's
DistributedSampler for the loaders' length and order.

Every check runs inside one spawned group of 2 ranks (``_rank_checks``), which
returns what each rank saw; the tests below compare. Errors that depend on all
ranks are caught on each rank and their messages returned, and the harness's
timeout turns a hang into a failure.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

import tandem
from tandem.testing import run_distributed
from tandem.data.loader import gather_for_metrics
from tandem.train.prepare import Strategy, no_sync, prepare, unwrap

WORLD = 2
SEED = 5           # the DataLoaders' generator seed, which prepare adopts
N_TRAIN = 48       # a multiple of WORLD * BATCH * ACCUMULATE: no padding in training
BATCH = 4
EPOCHS = 2
TOL = 1e-6
# (strategy, optimizer, micro-batches per step)
TRAIN_CASES = [("ddp", "sgd", 1), ("zero1", "adamw", 1), ("zero2", "sgd", 1), ("fsdp", "adamw", 1),
               ("ddp", "adamw", 2), ("fsdp", "sgd", 2)]


# ---------------------------------------------------------------------- models and data

def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))  # 8 and 3 rows: uneven shards


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    """Two param groups with different learning rates: prepare must keep both."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    if kind == "sgd":
        groups: list[dict[str, Any]] = [{"params": weights}, {"params": biases, "lr": 0.05}]
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    groups = [{"params": weights}, {"params": biases, "lr": 0.005}]
    return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)


def _train_set() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(N_TRAIN, 5, generator=g), torch.randn(N_TRAIN, 3, generator=g))


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _step_loop(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Any, accumulate: int,
               sync: Any) -> None:
    """The user's loop: ``accumulate`` micro-batches per step, all but the last under ``sync(False)``."""
    for i, (x, y) in enumerate(batches):
        with sync(enabled=(i + 1) % accumulate != 0):
            (nn.functional.mse_loss(model(x), y) / accumulate).backward()
        if (i + 1) % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()


# ---------------------------------------------------------------------- the three runs

def _prepared_run(strategy: str, kind: str, accumulate: int) -> dict[str, Any]:
    model = _model()
    optimizer = _optimizer(kind, model)
    loader = DataLoader(_train_set(), batch_size=BATCH, shuffle=True,
                        generator=torch.Generator().manual_seed(SEED))
    options: dict[str, Any] = {"bucket_cap_mb": 0.0002}  # several buckets on a tiny model
    units: tuple[type[nn.Module], ...] = ()
    if strategy == "fsdp":
        options, units = {"min_unit_bytes": 0}, (nn.Linear,)  # a unit per Linear, then the root
    wrapped, stepped, prepared = prepare(model, optimizer, loader, strategy=strategy,
                                         wrapper_kwargs=options, shard_units=units)
    for _ in range(EPOCHS):  # no set_epoch: each iteration is the next epoch
        _step_loop(wrapped, stepped, prepared, accumulate, lambda enabled: no_sync(wrapped, enabled))
    return {"params": _full_params(unwrap(wrapped)), "same_optimizer": stepped is optimizer,
            "optimizer": type(stepped).__name__, "wrapper": type(wrapped).__name__,
            "lrs": [g["lr"] for g in stepped.param_groups],
            "steps_own_params": {id(p) for g in stepped.param_groups for p in g["params"]}
            <= {id(p) for p in wrapped.parameters()}}


def _hand_written_ddp(kind: str, accumulate: int) -> dict[str, torch.Tensor]:
    model = _model()
    ddp = tandem.DistributedDataParallel(model)
    optimizer = _optimizer(kind, model)
    data = _train_set()
    sampler: TorchDistributedSampler[tuple[torch.Tensor, ...]] = TorchDistributedSampler(data, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        _step_loop(ddp, optimizer, loader, accumulate,
                   lambda enabled: ddp.no_sync() if enabled else contextlib.nullcontext())
    return _full_params(model)


def _one_process(kind: str, accumulate: int) -> dict[str, torch.Tensor]:
    """One process on the global batch: step i of R ranks with batch B consumes
    positions [iRB, (i+1)RB) of the epoch's order (torch's DistributedSampler's
    randperm seeded with seed + epoch)."""
    model = _model()
    optimizer = _optimizer(kind, model)
    x, y = _train_set().tensors
    global_batch = WORLD * BATCH * accumulate
    for epoch in range(EPOCHS):
        order = torch.randperm(N_TRAIN, generator=torch.Generator().manual_seed(SEED + epoch))
        for start in range(0, N_TRAIN, global_batch):
            idx = order[start:start + global_batch]
            nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
            optimizer.step()
            optimizer.zero_grad()
    return _full_params(model)


# ---------------------------------------------------------------------- loaders and metrics

def _loader_checks(rank: int) -> list[dict[str, Any]]:
    """Length and per-epoch order of prepared loaders against torch's sampler."""
    cases = [(n, drop_last, shuffle) for n in (10, 11) for drop_last in (False, True) for shuffle in (True, False)]
    originals = [DataLoader(TensorDataset(torch.arange(n)), batch_size=3, shuffle=shuffle, drop_last=drop_last,
                            generator=torch.Generator().manual_seed(SEED)) for n, drop_last, shuffle in cases]
    out = prepare(_model(), None, *originals)
    results = []
    for (n, drop_last, shuffle), original, prepared in zip(cases, originals, out[2:]):
        sampler: TorchDistributedSampler[Any] = TorchDistributedSampler(
            original.dataset, num_replicas=WORLD, rank=rank, shuffle=shuffle, seed=SEED)
        reference = DataLoader(original.dataset, batch_size=3, sampler=sampler, drop_last=drop_last)
        expected, got = [], []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            expected.append([b[0].tolist() for b in reference])
            got.append([b[0].tolist() for b in prepared])
        prepared.set_epoch(1)  # explicit: the next iteration is epoch 1 again, then 2
        again = [[b[0].tolist() for b in prepared] for _ in range(2)]
        results.append({"case": (n, drop_last, shuffle), "len": len(prepared), "expected_len": len(reference),
                        "expected": expected, "got": got, "again": again,
                        "type": type(prepared).__name__, "batch_size": prepared.batch_size})
    return results


def _gather_checks(rank: int) -> dict[str, Any]:
    """gather_for_metrics over 11 samples on 2 ranks: per batch and per epoch."""
    n = 11
    data = TensorDataset(torch.arange(n), torch.arange(n, dtype=torch.float64) * 10)
    _, _, plain, shuffled = prepare(_model(), None, DataLoader(data, batch_size=4),
                                    DataLoader(data, batch_size=4, shuffle=True,
                                               generator=torch.Generator().manual_seed(SEED)))
    per_batch, local = [], []
    for index, value in plain:
        gathered = gather_for_metrics((index, value), plain)
        per_batch.append(gathered)
        local.append(index)
    whole = gather_for_metrics({"index": torch.cat(local)}, plain)
    assert isinstance(whole, dict)
    epochs = []
    for _ in range(2):
        seen = torch.cat([index for index, _ in shuffled])
        gathered_epoch = gather_for_metrics(seen, shuffled)
        assert isinstance(gathered_epoch, torch.Tensor)
        epochs.append(gathered_epoch.tolist())
    errors = []
    try:
        gather_for_metrics(torch.zeros(7), plain)  # more rows than the loader yielded
    except ValueError as e:
        errors.append(str(e))
    return {"per_batch_index": torch.cat([g[0] for g in per_batch]).tolist(),
            "per_batch_value": torch.cat([g[1] for g in per_batch]).tolist(),
            "batch_rows": [len(g[0]) for g in per_batch],
            "whole": whole["index"].tolist(), "epochs": epochs, "errors": errors}


def _error_checks(rank: int) -> dict[str, str]:
    messages = {}
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2, shuffle=True,
                        generator=torch.Generator().manual_seed(rank))  # a seed that differs by rank
    try:
        prepare(_model(), None, loader)
    except ValueError as e:
        messages["seed"] = str(e)
    model = _model()
    stepped = _optimizer("adamw", model)
    model(torch.zeros(1, 5)).sum().backward()
    stepped.step()
    try:
        prepare(model, stepped, strategy="zero1")
    except ValueError as e:
        messages["stepped"] = str(e)
    try:
        prepare(_model(), _optimizer("sgd", _model()))  # an optimizer over another model
    except ValueError as e:
        messages["foreign"] = str(e)
    return messages


def _rank_checks(rank: int, world_size: int) -> dict[str, Any]:
    train = {}
    for strategy, kind, accumulate in TRAIN_CASES:
        train[(strategy, kind, accumulate)] = {"prepared": _prepared_run(strategy, kind, accumulate),
                                               "ddp": _hand_written_ddp(kind, accumulate),
                                               "one": _one_process(kind, accumulate)}
    return {"train": train, "loaders": _loader_checks(rank), "gather": _gather_checks(rank),
            "errors": _error_checks(rank)}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_rank_checks, WORLD, timeout=120)


# ---------------------------------------------------------------------- tests

def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("case", TRAIN_CASES, ids=lambda c: "-".join(map(str, c)))
def test_prepare_trains_like_hand_written_ddp_and_one_process(ranks: list[dict[str, Any]], case: tuple) -> None:
    strategy, kind, _ = case
    for rank, result in enumerate(ranks):
        run = result["train"][case]
        prepared = run["prepared"]
        assert _max_diff(prepared["params"], run["ddp"]) <= TOL, (rank, case)
        assert _max_diff(prepared["params"], run["one"]) <= TOL, (rank, case)
        # The run moved the parameters: equality is not that of two untouched models.
        assert _max_diff(prepared["params"], _full_params(_model())) > 1e-3
        assert prepared["lrs"] == ([0.1, 0.05] if kind == "sgd" else [0.01, 0.005])
        assert prepared["same_optimizer"] == (strategy == "ddp")
        expected = {"ddp": "SGD" if kind == "sgd" else "AdamW", "fsdp": "SGD" if kind == "sgd" else "AdamW",
                    "zero1": "ZeroOptimizer", "zero2": "ZeroOptimizer"}[strategy]
        assert prepared["optimizer"] == expected
        assert prepared["wrapper"] == ("FSDPSequential" if strategy == "fsdp" else "DistributedDataParallel")
        assert prepared["steps_own_params"]


def test_loader_len_and_reshuffle_match_distributed_sampler(ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ranks):
        for check in result["loaders"]:
            case = (rank, check["case"])
            assert check["type"] == "DistributedLoader" and check["batch_size"] == 3
            assert check["len"] == check["expected_len"] == len(check["got"][0]), case
            assert check["got"] == check["expected"], case
            assert check["again"] == check["expected"][1:], case
            _, _, shuffle = check["case"]
            orders: list[list[int]] = [sum(epoch, []) for epoch in check["got"]]
            assert (orders[0] != orders[1]) == shuffle, case  # reshuffled each epoch, only when shuffling


def test_gather_for_metrics_counts_each_sample_once(ranks: list[dict[str, Any]]) -> None:
    n = 11
    for result in ranks:
        gather = result["gather"]
        assert gather["per_batch_index"] == list(range(n))  # batch by batch, padding dropped at the end
        assert gather["per_batch_value"] == [10.0 * i for i in range(n)]
        assert gather["batch_rows"] == [8, 3]
        assert gather["whole"] == list(range(n))             # the whole epoch at once
        for epoch, order in enumerate(gather["epochs"]):     # shuffled: the epoch's permutation, each once
            assert order == torch.randperm(n, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        assert len(gather["errors"]) == 1 and "values hold 7 rows" in gather["errors"][0]


def test_errors_name_the_value_and_the_fix(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        messages = result["errors"]
        assert "rank 0" in messages["seed"] and "rank 1" in messages["seed"] and "seed" in messages["seed"]
        assert "already holds state" in messages["stepped"] and "zero1" in messages["stepped"]
        assert "not a parameter of the model" in messages["foreign"]


def test_bad_strategy_names_it_and_the_choices() -> None:
    with pytest.raises(ValueError) as info:
        prepare(_model(), None, strategy="zero3")
    message = str(info.value)
    assert "'zero3'" in message
    for choice in ("'ddp'", "'zero1'", "'zero2'", "'fully_shard'", "'fsdp'"):
        assert choice in message
    assert Strategy.parse("FSDP") is Strategy.FULLY_SHARD


@pytest.mark.skipif(dist.is_available() and dist.is_initialized(), reason="needs a process without a group")
def test_prepare_without_a_process_group_says_to_call_init() -> None:
    with pytest.raises(RuntimeError, match=r"tandem\.init\(\)"):
        prepare(_model(), None)
