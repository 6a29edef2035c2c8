"""``tandem check``: the pure comparison on constructed snapshots, and end to end
on the models of tests/tools/_check_models.py (a correct MLP under DDP, ZeRO-1/2 and
fully_shard; BatchNorm without and with SyncBatchNorm; dropout seeded per rank
or not; the user's own sharding, right and wrong), through the Python API and
the command line.

The end-to-end cases run in subprocesses with a timeout (tandem.spawn has none),
the API cases in one: ``python tests/tools/test_check.py`` prints their reports as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.tools.check import (
    CheckReport,
    RankRecord,
    ReferenceRun,
    Tolerance,
    build_report,
    compare_snapshots,
    default_tolerance,
    shard_batch,
)

HERE = Path(__file__).resolve().parent
TOL = Tolerance(rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- the pure comparison

def _snaps(*steps: dict[str, list[float]]) -> list[dict[str, torch.Tensor]]:
    return [{k: torch.tensor(v) for k, v in s.items()} for s in steps]


def test_first_divergence_is_the_earliest_step_then_the_parameter_furthest_out():
    ref = _snaps({"a": [1.0, 2.0], "b": [0.0], "bn.running_mean": [0.0]},
                 {"a": [1.0, 2.0], "b": [0.0], "bn.running_mean": [0.0]},
                 {"a": [1.0, 2.0], "b": [0.0], "bn.running_mean": [0.0]},
                 {"a": [1.0, 2.0], "b": [0.0], "bn.running_mean": [0.0]})
    got = _snaps({"a": [1.0, 2.0], "b": [0.0], "bn.running_mean": [0.0]},
                 {"a": [1.0, 2.0 + 1e-6], "b": [1e-6], "bn.running_mean": [0.0]},        # within tolerance
                 {"a": [1.0, 2.0 + 1e-3], "b": [3e-4], "bn.running_mean": [5.0]},        # a: 33x out, b: 30x
                 {"a": [9.0, 2.0], "b": [9.0], "bn.running_mean": [9.0]})
    c = compare_snapshots(ref, got, TOL, buffers=["bn.running_mean"])
    assert c.names == ("a", "b", "bn.running_mean")
    first = c.first_divergence
    assert first is not None and (first.step, first.name, first.is_buffer) == (2, "a", False)
    assert first.max_abs_diff == pytest.approx(1e-3, rel=1e-3)
    assert c.max_abs_diff[1][1] == pytest.approx(1e-6)
    assert [row[2] for row in c.max_abs_diff] == [0.0, 0.0, 5.0, 9.0]


def test_ties_go_to_model_order_and_buffers_only_when_no_parameter_diverges():
    ref = _snaps({"w": [0.0], "v": [0.0], "buf": [0.0]}, {"w": [0.0], "v": [0.0], "buf": [0.0]})
    both = compare_snapshots(ref, _snaps({"w": [0.0], "v": [0.0], "buf": [0.0]},
                                         {"w": [1.0], "v": [1.0], "buf": [0.0]}), TOL, buffers=["buf"])
    assert both.first_divergence is not None and both.first_divergence.name == "w"
    only_buffer = compare_snapshots(ref, _snaps({"w": [0.0], "v": [0.0], "buf": [0.0]},
                                                {"w": [0.0], "v": [0.0], "buf": [1.0]}), TOL, buffers=["buf"])
    first = only_buffer.first_divergence
    assert first is not None and (first.step, first.name, first.is_buffer) == (1, "buf", True)


def test_the_tolerance_is_torch_isclose_elementwise():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1000, generator=g) * 10
    got = ref + torch.randn(1000, generator=g) * 1e-4
    for rtol, atol in [(1e-5, 1e-5), (1e-4, 1e-4), (1e-5, 1e-3), (0.0, 1e-3), (1e-3, 0.0)]:
        c = compare_snapshots([{"p": ref}], [{"p": got}], Tolerance(rtol, atol))
        expected = bool(torch.isclose(got.double(), ref.double(), rtol=rtol, atol=atol).all())
        assert (c.first_divergence is None) == expected, (rtol, atol)
    assert compare_snapshots([{"p": ref}], [{"p": ref.clone()}], Tolerance(0.0, 0.0)).first_divergence is None


def test_a_missing_tensor_another_shape_or_nan_diverges():
    ref = _snaps({"a": [1.0], "b": [1.0, 2.0], "c": [1.0]})
    got = [{"b": torch.tensor([1.0]), "c": torch.tensor([float("nan")]), "extra": torch.tensor([0.0])}]
    c = compare_snapshots(ref, got, TOL)
    assert c.names == ("a", "b", "c", "extra")
    assert c.max_abs_diff[0][0] == float("inf") and c.max_abs_diff[0][1] == float("inf")
    assert all(e > 1 for e in c.excess[0])
    assert c.first_divergence is not None and c.first_divergence.name == "a"
    with pytest.raises(ValueError, match="2 snapshots"):
        compare_snapshots(ref * 2, got, TOL)


def test_default_tolerance_follows_the_least_precise_parameter():
    assert (default_tolerance([torch.float32]).rtol, default_tolerance([torch.float32]).atol) == (1e-5, 1e-5)
    assert default_tolerance([torch.float32]).source == "float32 default"
    assert default_tolerance([torch.float64, torch.bfloat16]).rtol == 2e-2
    assert default_tolerance([torch.float64]).rtol == 1e-10
    with pytest.raises(ValueError, match="atol=-1"):
        Tolerance(1e-5, -1)


def _reference(**kw) -> ReferenceRun:
    keys = kw.pop("keys", ((b"a", b"b", b"c", b"d"),))
    fields = dict(snapshots=({"w": torch.zeros(2)}, {"w": torch.ones(2)}), buffers=(), losses=(1.0,),
                  sample_keys=keys, outputs=(), param_dtypes=(torch.float32,), random_layers=(),
                  draws_random=False, draws_random_without_dropout=False)
    fields.update(kw)
    return ReferenceRun(**fields)


def _rank(rank: int, keys, rng=b"same", snaps=()) -> RankRecord:
    return RankRecord(rank=rank, losses=(1.0,), sample_keys=(keys,), rng_state=rng, snapshots=snaps)


def test_report_flags_shards_that_are_not_a_split_of_the_global_batch():
    snaps = ({"w": torch.zeros(2)}, {"w": torch.ones(2)})
    ok = build_report(_reference(), [_rank(0, (b"c", b"a"), snaps=snaps), _rank(1, (b"d", b"b"))], strategy="ddp",
                      ranks_shard_data=True)
    assert ok.equal and ok.verdict == "equal within tolerance over 1 steps"
    dup = build_report(_reference(), [_rank(0, (b"a", b"b"), snaps=snaps), _rank(1, (b"a", b"b"))],
                       strategy="ddp", ranks_shard_data=True)
    assert not dup.equal and dup.first_divergence is None
    assert dup.verdict.startswith("DIVERGES: step 1: the ranks' batches are not a split")
    assert "2 of its 4 samples are on no rank" in dup.verdict
    uneven = build_report(_reference(), [_rank(0, (b"a",), snaps=snaps), _rank(1, (b"b", b"c", b"d"))],
                          strategy="ddp", ranks_shard_data=True)
    assert "the ranks hold 1, 3 samples" in uneven.verdict


def test_report_flags_dropout_drawn_alike_on_every_rank():
    snaps = ({"w": torch.zeros(2)}, {"w": torch.ones(2)})
    ref = _reference(random_layers=("drop (p=0.5)",), draws_random=True)
    alike = build_report(ref, [_rank(0, (b"a", b"b"), snaps=snaps), _rank(1, (b"c", b"d"))], strategy="ddp")
    assert not alike.equal
    assert "every rank draws the same dropout masks (drop (p=0.5))" in alike.verdict
    assert "seed_everything(seed, per_rank=True)" in alike.verdict
    apart = build_report(ref, [_rank(0, (b"a", b"b"), b"x", snaps), _rank(1, (b"c", b"d"), b"y")], strategy="ddp")
    assert apart.equal and "dropout off for the comparison" in apart.describe()


def test_report_judges_parameters_not_buffers_nor_rounding_noise_under_adaptive_optimizers():
    zero = {"w": torch.zeros(2), "pre_bn.bias": torch.zeros(2), "bn.running_mean": torch.zeros(2)}
    moved = {"w": torch.ones(2), "pre_bn.bias": torch.ones(2), "bn.running_mean": torch.ones(2)}
    after = {"w": torch.ones(2), "pre_bn.bias": torch.ones(2) + 2e-3, "bn.running_mean": torch.ones(2) + 1e-3}
    grads = ({"w": 0.5, "pre_bn.bias": 3e-9},)
    ranks = [_rank(0, (b"a", b"b"), snaps=(zero, after)), _rank(1, (b"c", b"d"))]
    adam = build_report(_reference(snapshots=(zero, moved), buffers=("bn.running_mean",), grad_max=grads,
                                   adaptive=True), ranks, strategy="ddp")
    assert adam.equal, adam.describe()
    assert adam.comparison.excess[1][1] > 1  # compared and shown ...
    assert "not judged: pre_bn.bias (max |diff| 0.002): the one-process gradient is rounding noise" in adam.describe()
    assert "bn.running_mean" in adam.describe() and "(buffer, not judged)" in adam.describe()
    sgd = build_report(_reference(snapshots=(zero, moved), buffers=("bn.running_mean",), grad_max=grads,
                                  adaptive=False), ranks, strategy="ddp")
    assert sgd.first_divergence is not None and sgd.first_divergence.name == "pre_bn.bias"
    # A gradient that is small but real (above rtol x the largest) is judged under Adam too.
    real = build_report(_reference(snapshots=(zero, moved), grad_max=({"w": 0.5, "pre_bn.bias": 1e-4},),
                                   adaptive=True), ranks, strategy="ddp")
    assert real.first_divergence is not None and real.first_divergence.name == "pre_bn.bias"


def test_the_likely_cause_is_the_first_module_whose_output_differs_in_global_sample_order():
    fc, bn = torch.arange(8.0).reshape(4, 2), torch.arange(8.0).reshape(4, 2) * 10
    ref = _reference(outputs=(("fc", fc), ("bn", bn), ("", bn)), module_types={"fc": "Linear", "bn": "BatchNorm1d"})
    diverged = ({"w": torch.zeros(2)}, {"w": torch.full((2,), 3.0)})
    # Strided shards: rank 0 holds samples a, c (rows 0, 2), rank 1 b, d; fc equal once put back in order.
    r0 = RankRecord(rank=0, losses=(1.0,), sample_keys=((b"a", b"c"),), rng_state=b"0", snapshots=diverged,
                    outputs=(("fc", fc[[0, 2]]), ("bn", bn[[0, 2]] + 1)))
    r1 = RankRecord(rank=1, losses=(1.0,), sample_keys=((b"b", b"d"),), rng_state=b"1",
                    outputs=(("fc", fc[[1, 3]]), ("bn", bn[[1, 3]] + 1)))
    report = build_report(ref, [r0, r1], strategy="ddp")
    assert report.cause is not None and report.cause.startswith(
        "the first module whose output differs in step 1's forward is 'bn' (BatchNorm1d): it normalises")
    same = [RankRecord(rank=r, losses=(1.0,), sample_keys=(keys,), rng_state=bytes([r]),
                       snapshots=diverged if r == 0 else (), outputs=(("fc", fc[rows]), ("bn", bn[rows])))
            for r, (keys, rows) in enumerate([((b"a", b"c"), [0, 2]), ((b"b", b"d"), [1, 3])])]
    assert build_report(ref, same, strategy="ddp").cause is None  # no module differs: no guess


def test_shard_batch_slices_every_tensor_and_refuses_uneven_batches():
    x, y = torch.arange(12.0).reshape(6, 2), torch.arange(6)
    parts = [shard_batch((x, y), r, 3) for r in range(3)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
    with pytest.raises(ValueError, match="has 6 samples, which 4 ranks cannot share"):
        shard_batch((x, y), 0, 4)


def test_a_dataset_gives_consecutive_global_batches_and_a_rank_aware_factory_shards_itself():
    from torch.utils.data import TensorDataset

    from tandem.tools.check import _Batches

    x, y = torch.arange(10.0).reshape(5, 2), torch.arange(5)
    batches = _Batches(TensorDataset(x, y), 4)
    assert not batches.per_rank
    bx, by = batches.global_batch(1)                      # samples 4, 0, 1, 2: wrapped around
    assert by.tolist() == [4, 0, 1, 2] and torch.equal(bx, x[[4, 0, 1, 2]])
    assert batches.rank_batch(1, 1, 2)[1].tolist() == [1, 2]
    with pytest.raises(ValueError, match="needs a global batch_size"):
        _Batches(TensorDataset(x, y), None)
    own = _Batches("_check_models:strided_shards", None)
    assert own.per_rank and not _Batches("_check_models:regression", None).per_rank
    assert torch.equal(own.rank_batch(0, 1, 3)[0], own.global_batch(0)[0][1::3])


def test_what_cannot_reach_the_ranks_is_refused_before_starting_them():
    from tandem.tools.check import check

    with pytest.raises(ValueError, match="model .* cannot be sent to the ranks"):
        check(lambda: torch.nn.Linear(2, 2), "_check_models:regression")
    with pytest.raises(ValueError, match="strategy zero3 is not one of ddp, zero1, zero2, fsdp"):
        check("_check_models:mlp", "_check_models:regression", strategy="zero3")
    with pytest.raises(ValueError, match="has 12 samples, which 5 ranks cannot share equally"):
        check("_check_models:mlp", "_check_models:regression", nproc=5)


# ---------------------------------------------------------------------- end to end

def _api_cases() -> dict[str, dict]:
    """Run in a subprocess (``__main__`` below), all cases on one launch of 2 ranks
    (``check_strategies`` launches once per call): each report as plain data."""
    from tandem.tools.check import _check_specs, _make_spec

    def plain(r: CheckReport) -> dict:
        first = r.first_divergence
        return {"equal": r.equal, "verdict": r.verdict, "problems": list(r.problems), "cause": r.cause,
                "first": None if first is None else [first.step, first.name], "text": r.describe(),
                "losses": [list(pair) for pair in r.losses],
                "max_diff": max(d for row in r.comparison.max_abs_diff for d in row)}

    def spec(model: str, data: str, strategies=("ddp",), steps=3, **kw):
        args: dict[str, Any] = dict(nproc=2, loss="auto", optimizer="sgd", lr=0.1, optimizer_kwargs=None,
                                    batch_size=None, seed=0, rtol=None, atol=None)
        args.update(kw)
        return _make_spec(f"_check_models:{model}", f"_check_models:{data}", strategies=strategies, steps=steps,
                          **args)

    from tandem.fsdp import MixedPrecisionPolicy

    mlp, bn, dropout, same, bf16 = _check_specs([
        spec("blocks", "regression", ("ddp", "zero1", "zero2", "fsdp"), steps=4),
        spec("batchnorm", "regression"),
        spec("dropout_per_rank", "strided_shards", optimizer="adam", lr=1e-3),
        spec("mlp", "same_shard_everywhere", steps=2),
        spec("blocks_bf16", "regression", ("fsdp",), steps=2, mp_policy=MixedPrecisionPolicy(
            reduce_dtype=torch.float32)),
    ], nproc=2)
    out: dict[str, Any] = {f"mlp-{s}": plain(r) for s, r in mlp.items()}
    out["plain torch losses"] = _plain_torch_losses(steps=4)
    out["batchnorm"] = plain(bn["ddp"])
    out["dropout-per-rank-own-shards"] = plain(dropout["ddp"])
    out["same-shard-everywhere"] = plain(same["ddp"])
    out["bf16-model-fp32-reduce"] = plain(bf16["fsdp"])
    out["bf16-model-fp32-reduce"]["precision"] = [[f.level.name, f.issue.name, f.unit] for f in bf16["fsdp"].precision]
    return out


def _plain_torch_losses(steps: int) -> list[float]:
    """One process, written out without the tool: the reference the tool must reproduce."""
    import _check_models as m

    import tandem

    tandem.seed_everything(0)
    model = m.blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = m.regression(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def api_cases() -> dict[str, dict]:
    proc = subprocess.run([sys.executable, str(Path(__file__))], capture_output=True, text=True, timeout=150,
                          cwd=HERE)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_a_correct_model_trains_the_same_under_every_strategy(api_cases, strategy):
    case = api_cases[f"mlp-{strategy}"]
    assert case["equal"], case["text"]
    assert case["max_diff"] <= 1e-6
    # The one-process side is plain torch training, and the ranks' global loss equals it.
    assert [one for one, _ in case["losses"]] == api_cases["plain torch losses"]
    assert [many for _, many in case["losses"]] == pytest.approx(api_cases["plain torch losses"], abs=1e-6)
    assert "verdict: equal within tolerance over 4 steps" in case["text"]
    assert "tolerance: |distributed - single| <= 1e-05 + 1e-05 * |single| (float32 default)" in case["text"]
    assert "precision" not in case["text"]  # float32 throughout: fully_shard's precision audit finds nothing


def test_fsdp_lists_the_precision_audit_of_a_model_cast_to_bf16_before_sharding(api_cases):
    case = api_cases["bf16-model-fp32-reduce"]
    # The tiny layers' units merged into the root's: one unit, whose fp32-reduced gradients land in bf16.
    assert case["precision"] == [["WARNING", "REDUCED_THEN_ROUNDED", "BlocksBF16"]], case["text"]
    assert ("precision warning: fully_shard unit 'BlocksBF16' (parameters 'layers.0.weight', 'layers.0.bias', "
            "'layers.1.weight', ... (6 in all)): gradients are reduced in float32, then rounded to bfloat16"
            in case["text"])
    assert "Fix: keep the model in float32" in case["text"]
    assert "mp_policy(reduce_dtype=float32)" in case["text"]
    # The audit is not the verdict: the ranks train what one bf16 process does, within bf16's tolerance.
    assert case["equal"], case["text"]
    assert "(bfloat16 default)" in case["text"]  # the model's dtype; the policy's fp32 loosens nothing


def test_a_policy_that_computes_below_the_parameters_loosens_the_default_tolerance():
    from tandem.fsdp import MixedPrecisionPolicy
    from tandem.tools.check.api import _mixed_precision_tolerance

    bf16 = _mixed_precision_tolerance([torch.float32], MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                            reduce_dtype=torch.float32))
    assert (bf16.rtol, bf16.atol, bf16.source) == (2e-2, 2e-2, "bfloat16 default, from mp_policy")
    assert _mixed_precision_tolerance([torch.float32], MixedPrecisionPolicy()) == default_tolerance([torch.float32])


def test_batchnorm_without_syncbatchnorm_diverges_and_is_named(api_cases):
    case = api_cases["batchnorm"]
    assert not case["equal"]
    assert case["first"][0] == 1  # the first step already
    assert case["verdict"].startswith("DIVERGES: first at step 1 in parameter ")
    assert "'bn' (BatchNorm1d)" in case["cause"] and "convert_sync_batchnorm" in case["cause"]
    assert "likely cause: the first module whose output differs in step 1's forward is 'bn'" in case["text"]


def test_dropout_seeded_per_rank_and_a_right_user_sharding_pass(api_cases):
    case = api_cases["dropout-per-rank-own-shards"]
    assert case["equal"], case["text"]
    assert ("note: dropout off for the comparison (one process cannot draw the ranks' masks): drop (p=0.5)"
            in case["text"])


def test_a_data_factory_giving_every_rank_the_same_shard_diverges(api_cases):
    case = api_cases["same-shard-everywhere"]
    assert not case["equal"] and case["first"][0] == 1
    assert any("not a split of the global batch data(0): 6 of its 12 samples are on no rank" in p
               for p in case["problems"]), case["text"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "tandem", "check", *args], capture_output=True, text=True,
                          timeout=90, cwd=HERE, env=env)


def test_cli_syncbatchnorm_passes_with_exit_0_on_3_ranks_under_adamw():
    proc = _cli("--model", "_check_models:batchnorm_synced", "--data", "_check_models:regression",
                "--nproc", "3", "--steps", "3", "--strategy", "ddp,zero2,fsdp", "--optimizer", "adamw", "--lr", "0.01")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("verdict: equal within tolerance over 3 steps") == 3
    # fc.bias sits right before the batch norm: Adam moves it by noise, reported and not judged.
    assert proc.stdout.count("note: not judged: fc.bias") == 3
    assert "3 ranks (zero2)" in proc.stdout and "3 ranks (fsdp)" in proc.stdout


def test_cli_dropout_drawn_alike_on_every_rank_exits_1():
    proc = _cli("--model", "_check_models:dropout_same_seed", "--data", "_check_models:regression",
                "--steps", "2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "verdict: DIVERGES: every rank draws the same dropout masks (drop (p=0.5))" in proc.stdout


def test_cli_usage_errors_exit_2():
    from tandem.tools.check import main

    assert main(["--model", "_check_models:mlp"]) == 2                       # no --data
    assert main(["--model", "nowhere:mlp", "--data", "_check_models:regression"]) == 2
    assert main(["--model", "_check_models:mlp", "--data", "_check_models:regression",
                 "--strategy", "zero3"]) == 2
    assert main(["--model", "_check_models:mlp", "--data", "_check_models:regression", "--nproc", "5"]) == 2
    assert main(["--model", "_check_models:mlp", "--data", "_check_models:regression",
                 "--reduce-dtype", "fp32"]) == 2                              # a policy, and strategy ddp
    assert main(["--model", "_check_models:mlp", "--data", "_check_models:regression", "--strategy", "fsdp",
                 "--param-dtype", "int8"]) == 2


if __name__ == "__main__":
    print(json.dumps(_api_cases()))
