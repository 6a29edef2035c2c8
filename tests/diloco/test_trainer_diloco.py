"""DiLoCo in the Trainer (TrainerConfig.diloco) on two gloo ranks, in one
spawned group: with H=1, an outer SGD at lr 1 and a plain SGD it is the
Trainer's DDP; Streaming DiLoCo stopped at step 6 (a sync in flight) and
resumed from its per-rank checkpoint ends where the uninterrupted run does,
on every rank (the ranks differ from each other); another world size is
refused at resume."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from tandem.testing import run_distributed


def _fit(rank: int, out: str, diloco: dict | None, inner: str, max_steps: int | None = None) -> list[torch.Tensor]:
    import tandem

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    opt = (torch.optim.SGD(model.parameters(), lr=0.1) if inner == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-2))
    config = tandem.TrainerConfig(
        batch_size=4, epochs=1, log_every=4, progress=False, plot=False, output_dir=out, max_steps=max_steps,
        diloco=None if diloco is None else tandem.DiLoCoConfig(**diloco), straggler_every=None)
    tandem.Trainer(model, opt, data, nn.functional.mse_loss, config=config).fit()
    return [p.detach().clone() for p in model.parameters()]


STREAMING = dict(sync_every=4, fragments=2, overlap=1, mix=0.5)


def _all(rank: int, world_size: int, tmp: str) -> dict:
    out: dict[str, Any] = {"ddp": _fit(rank, f"{tmp}/ddp", None, "sgd"),
           "h1": _fit(rank, f"{tmp}/h1", dict(sync_every=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False), "sgd"),
           "whole": _fit(rank, f"{tmp}/whole", STREAMING, "adamw")}
    _fit(rank, f"{tmp}/parted", STREAMING, "adamw", max_steps=6)
    out["parted"] = _fit(rank, f"{tmp}/parted", STREAMING, "adamw")
    out["files"] = sorted(p.name for p in (Path(tmp) / "parted" / "checkpoints").glob("step-00000006/*"))
    return out


def _other_world(rank: int, world_size: int, tmp: str) -> str:
    try:
        _fit(rank, f"{tmp}/parted", STREAMING, "adamw")
    except ValueError as e:
        return str(e)
    return "resumed"


@functools.cache
def _results(tmp: str) -> list[dict]:
    return run_distributed(_all, 2, args=(tmp,), timeout=240)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    tmp = str(tmp_path_factory.mktemp("trainer_diloco"))
    return tmp, _results(tmp)


def test_h1_is_the_trainers_ddp(results) -> None:
    for r in results[1]:
        for a, b in zip(r["h1"], r["ddp"]):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


def test_a_run_resumed_from_its_per_rank_checkpoint_ends_where_the_uninterrupted_one_does(results) -> None:
    runs = results[1]
    for r in runs:
        for a, b in zip(r["parted"], r["whole"]):
            assert torch.equal(a, b)
    assert not torch.equal(runs[0]["whole"][0], runs[1]["whole"][0])  # the ranks differ: per rank it is
    assert runs[0]["files"] == ["COMMITTED.json", "rank-0-of-2.pt", "rank-1-of-2.pt", "trainer.pt"]


def test_another_world_size_is_refused_at_resume(results) -> None:
    tmp, _ = results
    said = run_distributed(_other_world, 3, args=(tmp,), timeout=120)
    for rank, message in enumerate(said):
        assert message.startswith(f"rank {rank}: ") and "was saved by 2 ranks" in message and "not 3" in message
