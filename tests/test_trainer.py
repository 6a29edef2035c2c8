"""tandem.Trainer against references: one process on the global batch (Note [equal
to one process] in trainer.py), an uninterrupted run (Note [exact resume] in
state.py), and a direct computation over the whole evaluation set."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import tandem
from tandem.testing import run_distributed

NUM_FEATURES, NUM_CLASSES = 6, 3


def datasets(n_train: int, n_eval: int) -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n_train + n_eval, NUM_FEATURES, generator=g)
    y = (x[:, :NUM_CLASSES] * 2 + 0.3 * torch.randn(len(x), NUM_CLASSES, generator=g)).argmax(1)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def make_model(dropout: float, init_seed: int = 0) -> nn.Module:
    tandem.seed_everything(init_seed)
    return nn.Sequential(nn.Linear(NUM_FEATURES, 16), nn.Tanh(), nn.Dropout(dropout),
                         nn.Linear(16, NUM_CLASSES))


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return (logits.argmax(1) == labels).float().mean().item()


def train(rank: int, world_size: int, output_dir: str, options: dict, init_seed: int = 0,
          n_train: int = 96, n_eval: int = 37) -> dict:
    """Build everything from scratch and fit; return what the tests compare."""
    dropout = options.pop("dropout", 0.0)
    zero_stage = options.pop("zero_stage", 0)
    model = make_model(dropout, init_seed)
    tandem.seed_everything(0, per_rank=True)
    if zero_stage:  # the user wraps; the Trainer takes the model as it is
        model = tandem.DistributedDataParallel(model, zero_stage=zero_stage, bucket_cap_mb=0.0005)
        optimizer = tandem.ZeroOptimizer(model, torch.optim.Adam, lr=0.05)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    train_set, eval_set = datasets(n_train, n_eval)
    config = tandem.TrainerConfig(output_dir=output_dir, **options)
    trainer = tandem.Trainer(model, optimizer, train_set, nn.functional.cross_entropy,
                             eval_data=eval_set, metrics={"accuracy": accuracy},
                             scheduler=scheduler, config=config)
    result = trainer.fit()
    module = getattr(trainer.model, "module", trainer.model)
    with torch.no_grad():  # the reference evaluation: every sample once, in one process
        x, y = eval_set.tensors
        module.eval()
        logits = module(x)
        direct = {"loss": nn.functional.cross_entropy(logits, y).item(), "accuracy": accuracy(logits, y)}
    return {"params": {k: v.clone() for k, v in module.state_dict().items()},
            "history": result.history, "evaluation": result.evaluation, "direct": direct,
            "steps": result.steps, "epochs": result.epochs_done,
            "checkpoint": None if result.checkpoint is None else str(result.checkpoint),
            "plot": None if result.plot is None else str(result.plot)}


def max_param_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def train_losses(history: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in history if r["kind"] == "train"]


@pytest.mark.parametrize("world_size, batch_size, grad_accum", [(2, 4, 2), (3, 4, 1)])
def test_ranks_train_like_one_process_on_the_global_batch(tmp_path, world_size, batch_size, grad_accum):
    common = dict(epochs=2, log_every=2, max_grad_norm=0.5, plot=False)
    ours = run_distributed(train, world_size, timeout=120, args=(
        str(tmp_path / "ranks"), dict(common, batch_size=batch_size, grad_accum=grad_accum)))
    (one,) = run_distributed(train, 1, timeout=120, args=(
        str(tmp_path / "one"), dict(common, batch_size=batch_size * grad_accum * world_size)))
    global_batch = batch_size * grad_accum * world_size
    assert one["steps"] == ours[0]["steps"] == 2 * math.ceil(96 / global_batch)
    for rank in range(world_size):
        assert max_param_diff(ours[rank]["params"], one["params"]) <= 1e-6
    # The recorded training loss is the mean over the global batch, reduced across ranks.
    for (step_a, loss_a), (step_b, loss_b) in zip(train_losses(ours[0]["history"]),
                                                  train_losses(one["history"]), strict=True):
        assert step_a == step_b and loss_a == pytest.approx(loss_b, abs=1e-6)
    # Evaluation over 37 samples (padded to a multiple of the world) counts each once.
    for rank in range(world_size):
        for name, value in ours[rank]["direct"].items():
            assert ours[rank]["evaluation"][name] == pytest.approx(value, abs=1e-6)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_zero_wrapped_model_trains_like_plain_ddp(tmp_path, stage):
    # Clipping goes through ZeroOptimizer.clip_grad_norm_, the checkpoint through its
    # consolidating state_dict(), which the resume test below relies on too.
    options = dict(epochs=2, batch_size=8, max_grad_norm=0.5, checkpoint_every=5, plot=False)
    zero = run_distributed(train, 2, timeout=120, args=(str(tmp_path / "zero"),
                                                         dict(options, zero_stage=stage)))
    plain = run_distributed(train, 2, timeout=120, args=(str(tmp_path / "plain"), dict(options)))
    for rank in range(2):
        assert max_param_diff(zero[rank]["params"], plain[rank]["params"]) <= 1e-6
    saved = torch.load(zero[0]["checkpoint"], weights_only=True)["optimizer"]
    reference = torch.load(plain[0]["checkpoint"], weights_only=True)["optimizer"]
    assert saved["state"].keys() == reference["state"].keys()
    for i, state in reference["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert (saved["state"][i][key] - state[key]).abs().max().item() <= 1e-6


def test_fp16_with_a_zero_optimizer_is_refused(tmp_path):
    with pytest.raises(Exception, match="precision='bf16'"):
        run_distributed(train, 2, timeout=60, args=(str(tmp_path), dict(precision="fp16", zero_stage=1)))


def test_interrupted_and_resumed_run_ends_equal_to_an_uninterrupted_one(tmp_path):
    # Dropout and a shuffled, padded sampler (95 samples on 2 ranks): the RNG
    # streams and the mid-epoch data position must both be restored.
    options = dict(epochs=3, batch_size=8, log_every=1, dropout=0.3)
    full = run_distributed(train, 2, timeout=120, args=(str(tmp_path / "full"), dict(options), 0, 95))
    steps_per_epoch = math.ceil(math.ceil(95 / 2) / 8)
    stop = steps_per_epoch + 2  # in the middle of the second epoch
    parted = str(tmp_path / "parted")
    first = run_distributed(train, 2, timeout=120, args=(parted, dict(options, max_steps=stop), 0, 95))
    assert first[0]["steps"] == stop and first[0]["epochs"] == 1
    assert Path(first[0]["checkpoint"]).name == f"step-{stop:08d}.pt"
    # The resumed run starts from a different initialisation: everything must come
    # from the checkpoint.
    second = run_distributed(train, 2, timeout=120, args=(parted, dict(options), 1, 95))
    assert second[0]["steps"] == full[0]["steps"] == 3 * steps_per_epoch
    for rank in range(2):
        assert max_param_diff(second[rank]["params"], full[rank]["params"]) <= 1e-6
    resumed, uninterrupted = train_losses(second[0]["history"]), train_losses(full[0]["history"])
    assert [s for s, _ in resumed] == [s for s, _ in uninterrupted]
    assert [l for _, l in resumed] == pytest.approx([l for _, l in uninterrupted], abs=1e-6)
    # metrics.jsonl holds the whole run's records, as one run would have written them.
    lines = [json.loads(l) for l in (Path(parted) / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in lines] == [(r["kind"], r["step"]) for r in full[0]["history"]]


def test_checkpoints_are_kept_and_pruned(tmp_path):
    out = tmp_path / "run"
    (result,) = run_distributed(train, 1, timeout=120, args=(
        str(out), dict(epochs=2, batch_size=16, checkpoint_every=2, keep_checkpoints=2)))
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step-00000010.pt", "step-00000012.pt"]  # 6 steps per epoch
    state = torch.load(out / "checkpoints" / names[-1], weights_only=True)
    assert (state["step"], state["epoch"], state["consumed"]) == (12, 2, 0)
    assert max_param_diff(state["model"], result["params"]) == 0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_close_to_fp32(tmp_path, precision):
    options = dict(epochs=2, batch_size=8, plot=False)
    low = run_distributed(train, 2, timeout=120, args=(str(tmp_path / precision),
                                                        dict(options, precision=precision)))
    full = run_distributed(train, 2, timeout=120, args=(str(tmp_path / "fp32"), dict(options)))
    diff = max_param_diff(low[0]["params"], full[0]["params"])
    # Lower precision moved the result (autocast ran), but training still converged to
    # nearly the same place.
    assert 0 < diff < 0.05
    assert low[0]["evaluation"]["accuracy"] == pytest.approx(full[0]["evaluation"]["accuracy"], abs=0.06)
    state = torch.load(tmp_path / precision / "checkpoints" / "step-00000012.pt", weights_only=True)
    assert (state["scaler"] is not None) == (precision == "fp16")


def test_records_report_throughput_and_communication_share(tmp_path):
    two = run_distributed(train, 2, timeout=120, args=(str(tmp_path / "two"),
                                                        dict(epochs=1, batch_size=8, log_every=2)))
    (one,) = run_distributed(train, 1, timeout=120, args=(str(tmp_path / "one"),
                                                          dict(epochs=1, batch_size=8, log_every=2)))
    for record in train_records(two[0]["history"]):
        assert record["samples_per_s"] > 0 and 0 <= record["comm_wait_share"] < 1
    assert all(r["comm_wait_share"] is None for r in train_records(one["history"]))
    assert Path(two[0]["plot"]).stat().st_size > 0


def train_records(history: list[dict]) -> list[dict]:
    return [r for r in history if r["kind"] == "train"]


def _different_dirs(rank: int, world_size: int, base: str) -> str:
    return train(rank, world_size, f"{base}/rank{rank}", dict(epochs=1, batch_size=8))


def test_ranks_that_see_different_checkpoints_fail_together(tmp_path):
    (tmp_path / "rank0" / "checkpoints").mkdir(parents=True)
    torch.save({}, tmp_path / "rank0" / "checkpoints" / "step-00000003.pt")
    with pytest.raises(Exception) as info:
        run_distributed(_different_dirs, 2, timeout=60, args=(str(tmp_path),))
    tracebacks = info.value.tracebacks
    assert sorted(tracebacks) == [0, 1]  # both ranks raised, neither hung
    assert all("ranks see different latest checkpoints" in t for t in tracebacks.values())


def test_without_matplotlib_there_is_no_plot_and_one_line_says_so(tmp_path, monkeypatch, capsys):
    import builtins
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    result = train(0, 1, str(tmp_path), dict(epochs=1, batch_size=32))
    assert result["plot"] is None and not (tmp_path / "loss.png").exists()
    assert capsys.readouterr().out.count("matplotlib is not installed") == 1


@pytest.mark.parametrize("field, value", [("epochs", 0), ("batch_size", -1), ("grad_accum", 1.5),
                                          ("precision", "fp8"), ("max_grad_norm", 0.0),
                                          ("checkpoint_every", -2), ("max_steps", 0)])
def test_bad_config_names_the_field_and_value(field, value):
    with pytest.raises(ValueError, match=field) as info:
        tandem.TrainerConfig(**{field: value})
    assert repr(value) in str(info.value)


def test_a_fresh_run_does_not_mix_with_an_earlier_runs_checkpoints(tmp_path):
    train(0, 1, str(tmp_path), dict(epochs=1, batch_size=32, plot=False))
    with pytest.raises(ValueError, match="resume=False, but .* holds checkpoints of an earlier run"):
        train(0, 1, str(tmp_path), dict(epochs=1, batch_size=32, resume=False))
