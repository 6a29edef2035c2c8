"""tandem.Trainer against references: one process on the global batch (Note [equal
to one process] in trainer.py), an uninterrupted run (Note [exact resume] in
tandem/checkpoint/state.py), and a direct computation over the whole evaluation set."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import tandem
from tandem.testing import Case, run_cases

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
    fully_sharded = options.pop("fully_sharded", False)
    grad_sync: list[bool] = []  # a fully-sharded model's set_requires_gradient_sync calls
    model = make_model(dropout, init_seed)
    tandem.seed_everything(0, per_rank=True)
    optimizer: torch.optim.Optimizer
    if zero_stage:  # the user wraps; the Trainer takes the model as it is
        model = tandem.DistributedDataParallel(model, zero_stage=zero_stage, bucket_cap_mb=0.0005)
        optimizer = tandem.ZeroOptimizer(model, torch.optim.Adam, lr=0.05)
    elif fully_sharded:  # the user shards, as above: a unit per Linear (uneven rows), then the root
        for layer in model.children():
            if isinstance(layer, nn.Linear):
                tandem.fully_shard(layer, min_unit_bytes=0)
        tandem.fully_shard(model)
        model.set_requires_gradient_sync = spy(model.set_requires_gradient_sync, grad_sync)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
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
    return {"params": {k: full_tensor(v).clone() for k, v in module.state_dict().items()},
            "history": result.history, "evaluation": result.evaluation, "direct": direct,
            "steps": result.steps, "epochs": result.epochs_done,
            "grad_sync": grad_sync,
            "checkpoint": None if result.checkpoint is None else str(result.checkpoint),
            "plot": None if result.plot is None else str(result.plot)}


def spy(method, calls: list):
    """``method``, recording its first argument in ``calls``."""
    def record(value, *args, **kwargs):
        calls.append(value)
        return method(value, *args, **kwargs)
    return record


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A fully-sharded model's state holds DTensors; gathering them is a collective."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def max_param_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def train_losses(history: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in history if r["kind"] == "train"]


# Every spawned run of the module is a case of one spawned group per world size
# (tandem.testing.run_cases, in the fixture ``runs`` at the end), under the name
# the tests read it by; each keeps its own timeout and its own failure.
GLOBAL_BATCH_CASES = [(2, 4, 2), (3, 4, 1)]
GLOBAL_BATCH_COMMON = dict(epochs=2, log_every=2, max_grad_norm=0.5, plot=False)


def _global_batch_cases(base: str) -> dict[int, dict[str, Case]]:
    out: dict[int, dict[str, Case]] = {1: {}, 2: {}, 3: {}}
    for world_size, batch_size, grad_accum in GLOBAL_BATCH_CASES:
        name = f"global_batch_{world_size}_{batch_size}_{grad_accum}"
        out[world_size][name] = Case(train, timeout=120, args=(
            f"{base}/{name}/ranks", dict(GLOBAL_BATCH_COMMON, batch_size=batch_size, grad_accum=grad_accum)))
        out[1][name + "_one"] = Case(train, timeout=120, args=(
            f"{base}/{name}/one", dict(GLOBAL_BATCH_COMMON, batch_size=batch_size * grad_accum * world_size)))
    return out


@pytest.mark.parametrize("world_size, batch_size, grad_accum", GLOBAL_BATCH_CASES)
def test_ranks_train_like_one_process_on_the_global_batch(runs, world_size, batch_size, grad_accum):
    name = f"global_batch_{world_size}_{batch_size}_{grad_accum}"
    ours = runs[name]
    (one,) = runs[name + "_one"]
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


# Clipping goes through ZeroOptimizer.clip_grad_norm_, the full-format checkpoint
# through its consolidating state_dict() (sharded checkpoints: test_trainer_sharded.py).
ZERO_OPTIONS = dict(epochs=2, batch_size=8, max_grad_norm=0.5, checkpoint_every=5, plot=False,
                    checkpoint_format="full")


def _zero_cases(base: str) -> dict[str, Case]:
    # One plain DDP run is the reference of both stages (the same options, the same run).
    return {"zero_plain": Case(train, timeout=120, args=(f"{base}/zero_plain", dict(ZERO_OPTIONS))),
            **{f"zero_stage{stage}": Case(train, timeout=120, args=(
                f"{base}/zero_stage{stage}", dict(ZERO_OPTIONS, zero_stage=stage))) for stage in (1, 2)}}


@pytest.mark.parametrize("stage", [1, 2])
def test_a_zero_wrapped_model_trains_like_plain_ddp(runs, stage):
    zero = runs[f"zero_stage{stage}"]
    plain = runs["zero_plain"]
    for rank in range(2):
        assert max_param_diff(zero[rank]["params"], plain[rank]["params"]) <= 1e-6
    saved = torch.load(zero[0]["checkpoint"], weights_only=True)["optimizer"]
    reference = torch.load(plain[0]["checkpoint"], weights_only=True)["optimizer"]
    assert saved["state"].keys() == reference["state"].keys()
    for i, state in reference["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert (saved["state"][i][key] - state[key]).abs().max().item() <= 1e-6


def _fp16_zero_cases(base: str) -> dict[str, Case]:
    common = dict(epochs=1, batch_size=8, plot=False, zero_stage=1)
    return {"fp16_zero_half": Case(train, timeout=90, args=(f"{base}/fp16_zero_half",
                                                             dict(common, precision="fp16"))),
            "fp16_zero_full": Case(train, timeout=90, args=(f"{base}/fp16_zero_full", dict(common)))}


def test_fp16_with_a_zero_optimizer_trains_like_fp32_with_identical_replicas(runs):
    # The gradient scaler sees only this rank's gradient shards: its found-inf is
    # agreed across ranks (tests/ddp/test_nonfinite.py injects one), so ranks step together.
    half, full = runs["fp16_zero_half"], runs["fp16_zero_full"]
    assert max_param_diff(half[0]["params"], half[1]["params"]) == 0
    diff = max_param_diff(half[0]["params"], full[0]["params"])
    assert 0 < diff <= 5e-3  # measured 3.4e-4


# Dropout and a shuffled, padded sampler (95 samples on 2 ranks): the RNG
# streams and the mid-epoch data position must both be restored.
RESUME_OPTIONS = dict(epochs=3, batch_size=8, log_every=1, dropout=0.3)
RESUME_STEPS_PER_EPOCH = math.ceil(math.ceil(95 / 2) / 8)
RESUME_STOP = RESUME_STEPS_PER_EPOCH + 2  # in the middle of the second epoch


def _resume_cases(base: str) -> dict[str, Case]:
    parted = f"{base}/resume_parted"
    return {"resume_full": Case(train, timeout=120, args=(f"{base}/resume_full", dict(RESUME_OPTIONS), 0, 95)),
            "resume_first": Case(train, timeout=120, args=(
                parted, dict(RESUME_OPTIONS, max_steps=RESUME_STOP), 0, 95)),
            # The resumed run starts from a different initialisation: everything must come
            # from the checkpoint.
            "resume_second": Case(train, timeout=120, args=(parted, dict(RESUME_OPTIONS), 1, 95))}


def test_interrupted_and_resumed_run_ends_equal_to_an_uninterrupted_one(runs):
    full = runs["resume_full"]
    steps_per_epoch, stop = RESUME_STEPS_PER_EPOCH, RESUME_STOP
    parted = str(runs.base / "resume_parted")
    first = runs["resume_first"]
    assert first[0]["steps"] == stop and first[0]["epochs"] == 1
    assert Path(first[0]["checkpoint"]).name == f"step-{stop:08d}.pt"
    second = runs["resume_second"]
    assert second[0]["steps"] == full[0]["steps"] == 3 * steps_per_epoch
    for rank in range(2):
        assert max_param_diff(second[rank]["params"], full[rank]["params"]) <= 1e-6
    resumed, uninterrupted = train_losses(second[0]["history"]), train_losses(full[0]["history"])
    assert [s for s, _ in resumed] == [s for s, _ in uninterrupted]
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in uninterrupted], abs=1e-6)
    # metrics.jsonl holds the whole run's records, as one run would have written them.
    lines = [json.loads(line) for line in (Path(parted) / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in lines] == [(r["kind"], r["step"]) for r in full[0]["history"]]


# A fully-sharded model against one process on the global batch (2 ranks x 4 samples
# x 2 micro-batches, clipped), and a run stopped mid-way and resumed against both the
# uninterrupted run and one process resumed from the sharded run's checkpoint. All runs
# of one world size share one spawned group, to keep the suite fast.
SHARDED = dict(epochs=2, batch_size=4, grad_accum=2, max_grad_norm=0.5, log_every=1, plot=False)
SHARDED_STOP = 8  # 6 steps per epoch: in the middle of the second


def _sharded_runs(rank: int, world_size: int, base: str) -> dict:
    options = dict(SHARDED, fully_sharded=True)
    # The uninterrupted run writes the full format; the parted one the default, sharded.
    return {"full": train(rank, world_size, f"{base}/sharded", dict(options, checkpoint_format="full")),
            "first": train(rank, world_size, f"{base}/parted", dict(options, max_steps=SHARDED_STOP)),
            # From a different initialisation: everything must come from the checkpoint.
            "second": train(rank, world_size, f"{base}/parted", dict(options), init_seed=1)}


def _one_process_runs(rank: int, world_size: int, base: str, sharded_checkpoint: str) -> dict:
    options = dict(SHARDED, batch_size=16, grad_accum=1)
    resumed = Path(base) / "one-resumed" / "checkpoints"
    resumed.mkdir(parents=True)
    shutil.copytree(sharded_checkpoint, resumed / Path(sharded_checkpoint).name)
    return {"full": train(rank, world_size, f"{base}/one", dict(options)),
            "resumed": train(rank, world_size, str(resumed.parent), dict(options), init_seed=1)}


@pytest.fixture(scope="module")
def sharded_runs(runs) -> tuple[list[dict], dict]:
    sharded = runs["sharded"]
    (one,) = runs["sharded_one"]
    return sharded, one


def test_a_fully_sharded_model_trains_like_one_process_on_the_global_batch(sharded_runs):
    sharded, one = sharded_runs
    assert sharded[0]["full"]["steps"] == one["full"]["steps"] == 12
    # Accumulation: the first micro-batch of each step accumulates without communication.
    assert sharded[0]["full"]["grad_sync"] == [False, True] * 12
    for rank in range(2):
        assert max_param_diff(sharded[rank]["full"]["params"], one["full"]["params"]) <= 1e-6
        for name, value in sharded[rank]["full"]["direct"].items():
            assert sharded[rank]["full"]["evaluation"][name] == pytest.approx(value, abs=1e-6)
    # Losses and the global gradient norm (plain floats, clipping engaged) match step by step.
    ours, reference = train_records(sharded[0]["full"]["history"]), train_records(one["full"]["history"])
    assert [r["step"] for r in ours] == [r["step"] for r in reference]
    for key in ("loss", "grad_norm"):
        assert all(type(r[key]) is float for r in ours)
        assert [r[key] for r in ours] == pytest.approx([r[key] for r in reference], abs=1e-6)
    assert max(r["grad_norm"] for r in ours) > SHARDED["max_grad_norm"]
    # The checkpoint holds the full model and optimizer state in torch's own format,
    # which one process loads with plain load_state_dict.
    saved = torch.load(sharded[0]["full"]["checkpoint"], weights_only=True)
    expected = torch.load(one["full"]["checkpoint"], weights_only=True)
    assert max_param_diff(saved["model"], expected["model"]) <= 1e-6
    assert saved["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    for i, state in expected["optimizer"]["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert (saved["optimizer"]["state"][i][key] - state[key]).abs().max().item() <= 1e-6
    model = make_model(0.0)
    model.load_state_dict(saved["model"])
    torch.optim.Adam(model.parameters()).load_state_dict(saved["optimizer"])


def test_a_fully_sharded_run_resumes_exactly_at_any_world_size(sharded_runs):
    sharded, one = sharded_runs
    assert sharded[0]["first"]["steps"] == SHARDED_STOP and sharded[0]["first"]["epochs"] == 1
    assert Path(sharded[0]["first"]["checkpoint"]).name == f"step-{SHARDED_STOP:08d}"  # sharded, a directory
    for rank in range(2):
        assert max_param_diff(sharded[rank]["second"]["params"], sharded[rank]["full"]["params"]) <= 1e-6
    resumed = train_losses(sharded[0]["second"]["history"])
    uninterrupted = train_losses(sharded[0]["full"]["history"])
    assert [s for s, _ in resumed] == [s for s, _ in uninterrupted]
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in uninterrupted], abs=1e-6)
    # The same sharded checkpoint resumed by one process without fully_shard.
    assert one["resumed"]["steps"] == 12
    assert max_param_diff(one["resumed"]["params"], one["full"]["params"]) <= 1e-6


def _refusals(rank: int, world_size: int, output_dir: str) -> dict[str, str]:
    """What the Trainer says about a fully-sharded model it cannot train."""
    train_set, _ = datasets(8, 0)
    messages = {}
    for case in ("optimizer built before fully_shard",):
        model = make_model(0.0)
        early = torch.optim.Adam(model.parameters())
        tandem.fully_shard(model)
        optimizer = early if case.startswith("optimizer") else torch.optim.Adam(model.parameters())
        config = tandem.TrainerConfig(output_dir=output_dir)
        try:
            tandem.Trainer(model, optimizer, train_set, nn.functional.cross_entropy, config=config)
        except ValueError as e:
            messages[case] = str(e)
    return messages


def test_a_fully_sharded_model_is_refused_with_what_to_do_instead(runs):
    (messages,) = runs["refusals"]
    assert "parameter 0 (shape (16, 6))" in messages["optimizer built before fully_shard"]
    assert "after fully_shard" in messages["optimizer built before fully_shard"]


def test_checkpoints_are_kept_and_pruned(runs):
    out = runs.base / "kept"
    (result,) = runs["kept"]
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step-00000010.pt", "step-00000012.pt"]  # 6 steps per epoch
    state = torch.load(out / "checkpoints" / names[-1], weights_only=True)
    assert (state["step"], state["epoch"], state["consumed"]) == (12, 2, 0)
    assert max_param_diff(state["model"], result["params"]) == 0


MIXED_OPTIONS = dict(epochs=2, batch_size=8, plot=False)


def _mixed_cases(base: str) -> dict[str, Case]:
    # One fp32 run is the reference of both precisions (the same options, the same run).
    return {f"mixed_{precision}": Case(train, timeout=120, args=(
        f"{base}/mixed_{precision}", dict(MIXED_OPTIONS, **({} if precision == "fp32" else {"precision": precision}))))
        for precision in ("fp32", "bf16", "fp16")}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_close_to_fp32(runs, precision):
    low, full = runs[f"mixed_{precision}"], runs["mixed_fp32"]
    diff = max_param_diff(low[0]["params"], full[0]["params"])
    # Lower precision moved the result (autocast ran), but training still converged to
    # nearly the same place.
    assert 0 < diff < 0.05
    assert low[0]["evaluation"]["accuracy"] == pytest.approx(full[0]["evaluation"]["accuracy"], abs=0.06)
    state = torch.load(runs.base / f"mixed_{precision}" / "checkpoints" / "step-00000012.pt", weights_only=True)
    assert (state["scaler"] is not None) == (precision == "fp16")


def test_records_report_throughput_and_communication_share(runs):
    two = runs["records_two"]
    (one,) = runs["records_one"]
    params = list(make_model(0.0).parameters())
    bucket = 4 * sum(p.numel() for p in params) + 4  # fp32 gradients and DDP's 4-byte flag, one bucket
    records = train_records(two[0]["history"])
    for record in records:
        assert record["samples_per_s"] > 0 and 0 <= record["comm_wait_share"] < 1
    # What the steps handed to collectives, from the ledger: the bucket every step, and in the
    # first window (2 steps) the bucket order DDP broadcasts after its first step (an int64 a parameter).
    assert records[0]["comm_bytes_per_step"] == bucket + 8 * len(params) / 2, records[0]
    assert all(r["comm_bytes_per_step"] == bucket for r in records[1:]), records
    assert all(r["comm_wait_share"] is None for r in train_records(one["history"]))
    assert Path(two[0]["plot"]).stat().st_size > 0


def train_records(history: list[dict]) -> list[dict]:
    return [r for r in history if r["kind"] == "train"]


def _different_dirs(rank: int, world_size: int, base: str) -> dict:
    return train(rank, world_size, f"{base}/rank{rank}", dict(epochs=1, batch_size=8))


def test_ranks_that_see_different_checkpoints_fail_together(runs):
    with pytest.raises(Exception) as info:
        runs["different_dirs"]
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


def test_a_misspelt_ddp_option_is_named_when_the_config_is_made():
    with pytest.raises(ValueError, match="ddp_options has 'bucket_cap', which tandem.DistributedDataParallel "
                                         "does not take") as info:
        tandem.TrainerConfig(ddp_options={"bucket_cap": 1, "find_unused_parameters": True})
    assert "bucket_cap_mb" in str(info.value)  # the fix is in the message
    assert tandem.TrainerConfig(ddp_options={"bucket_cap_mb": 1}).ddp_options == {"bucket_cap_mb": 1}


def test_local_steps_in_an_elastic_job_need_syncs_of_the_whole_model():
    # Note [elastic local steps] in tandem/elastic/sync_points.py: a loss goes back to the last sync.
    with pytest.raises(ValueError, match="fragments=2, overlap=0, mix=0.0; or run without --elastic"):
        tandem.TrainerConfig(elastic=True, diloco=tandem.DiLoCoConfig(sync_every=4, fragments=2))
    with pytest.raises(ValueError, match="async_checkpoint=False"):
        tandem.TrainerConfig(async_checkpoint=True, diloco=tandem.DiLoCoConfig(sync_every=4))
    assert tandem.TrainerConfig(elastic=True, diloco=tandem.DiLoCoConfig(sync_every=4)).diloco is not None


def test_a_fresh_run_does_not_mix_with_an_earlier_runs_checkpoints(tmp_path):
    train(0, 1, str(tmp_path), dict(epochs=1, batch_size=32, plot=False))
    with pytest.raises(ValueError, match="resume=False, but .* holds checkpoints of an earlier run"):
        train(0, 1, str(tmp_path), dict(epochs=1, batch_size=32, resume=False))


# ---------------------------------------------------------------- the spawned groups
class Runs:
    """Every case's per-rank results by name, from the group of its world size;
    ``base`` is the folder their output directories are in."""

    def __init__(self, base: Path, groups: list) -> None:
        self.base, self._groups = base, groups

    def __getitem__(self, name: str) -> list:
        group = next(g for g in self._groups if name in g)
        return group[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    base = tmp_path_factory.mktemp("trainer")
    b = str(base)
    # Rank 0 alone sees an earlier run's checkpoint (the ranks' directories differ).
    (base / "different" / "rank0" / "checkpoints").mkdir(parents=True)
    torch.save({}, base / "different" / "rank0" / "checkpoints" / "step-00000003.pt")
    global_batch = _global_batch_cases(b)
    two = run_cases({
        **global_batch[2], **_zero_cases(b), **_fp16_zero_cases(b), **_resume_cases(b), **_mixed_cases(b),
        "records_two": Case(train, timeout=120, args=(f"{b}/records_two", dict(epochs=1, batch_size=8, log_every=2))),
        "different_dirs": Case(_different_dirs, timeout=60, args=(f"{b}/different",)),
        # All runs of the fully-sharded model in one case (as before the groups were shared).
        "sharded": Case(_sharded_runs, timeout=120, args=(f"{b}/sharded",)),
    }, 2)
    three = run_cases(global_batch[3], 3)
    try:  # the one-process resume reads the sharded run's checkpoint
        sharded_checkpoint = two["sharded"][0]["first"]["checkpoint"]
    except Exception:
        sharded_checkpoint = f"{b}/sharded/parted/checkpoints/step-{SHARDED_STOP:08d}"
    one = run_cases({
        **global_batch[1],
        "refusals": Case(_refusals, timeout=60, args=(f"{b}/refusals",)),
        "kept": Case(train, timeout=120, args=(
            f"{b}/kept", dict(epochs=2, batch_size=16, checkpoint_every=2, keep_checkpoints=2))),
        "records_one": Case(train, timeout=120, args=(f"{b}/records_one", dict(epochs=1, batch_size=8, log_every=2))),
        "sharded_one": Case(_one_process_runs, timeout=120, args=(f"{b}/sharded", sharded_checkpoint)),
    }, 1)
    return Runs(base, [one, two, three])
