"""TrainerConfig(tensorboard=True): every record of metrics.jsonl is also a
TensorBoard scalar at its step, written by rank 0 only, read back with
TensorBoard's own reader and compared with the JSONL record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from tandem.testing import run_distributed

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                        reason="TensorBoard's reader comes with the tensorboard package")


def _fit(rank: int, world_size: int, out: str) -> None:
    import tandem

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    config = tandem.TrainerConfig(batch_size=4, epochs=2, log_every=3, progress=False, plot=False,
                                  resume=False, output_dir=out, tensorboard=True)
    tandem.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), data, lambda o, y: ((o - y) ** 2).mean(),
                   eval_data=data, config=config).fit()


def test_every_record_is_a_tensorboard_scalar_at_its_step(tmp_path: Path) -> None:
    run_distributed(_fit, 2, args=(str(tmp_path),), timeout=120)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    runs = list((tmp_path / "tensorboard").iterdir())
    assert len(runs) == 1, runs  # one event file: rank 0's
    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/samples_per_s", "train/comm_wait_share", "eval/loss"} <= tags, tags
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(train) == 8 and len(evals) == 2  # 12 steps an epoch, a record every 3
    for tag, kind, key in (("train/loss", train, "loss"), ("train/lr", train, "lr"), ("eval/loss", evals, "loss")):
        written = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [step for step, _ in written] == [r["step"] for r in kind], tag
        for (_, value), record in zip(written, kind):
            assert value == pytest.approx(record[key], rel=1e-6), (tag, value, record)


def test_tensorboard_is_refused_where_its_writer_cannot_be_made(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from tandem.train.tensorboard import require_tensorboard

    real = builtins.__import__

    def without(name: str, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if name == "torch.utils.tensorboard":
            raise ImportError("No module named 'tensorboard'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)
    with pytest.raises(ImportError, match=r"needs the tensorboard package: pip install tensorboard"):
        require_tensorboard()
