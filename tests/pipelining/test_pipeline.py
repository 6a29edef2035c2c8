"""DP x PP: a model in two pipeline stages (torch's ``torch.distributed.pipelining``,
GPipe and 1F1B), each stage data-parallel over two replicas through tandem's DDP
or fully_shard, on a 2 x 2 ("pp", "dp") mesh of gloo ranks, trains exactly as one
process does on the global batch; and the example prints that under ``tandem run``.

The single-process reference is computed here, in the test process, from the
example's model and data functions: unsplit model, whole global batch, one
``loss.backward()`` per step."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tandem.examples import pipeline as ex
from tandem.testing import run_distributed

TOL = 1e-5
STEPS = 4
MICROBATCHES, MICROBATCH_SIZE, REPLICAS = 4, 2, 2
GLOBAL_BATCH = REPLICAS * MICROBATCHES * MICROBATCH_SIZE
OPTIMIZERS = {"adam": (ex.make_optimizer, 1e-2),
              # SGD's update is proportional to the gradient: a wrong scale (1/n
              # micro-batches, 1/replicas) shows here where Adam would hide it.
              "sgd": (lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9), 0.1)}
CASES = [("gpipe", "ddp", "adam"), ("1f1b", "ddp", "adam"), ("gpipe", "ddp", "sgd"),
         ("gpipe", "fully_shard", "adam"), ("1f1b", "fully_shard", "sgd")]


def _train_cases(rank: int, world_size: int, cases: list[tuple[str, str, str]]) -> list[dict]:
    mesh = ex.make_mesh(num_stages=2)
    out = []
    for schedule, data_parallel, opt in cases:
        make_opt, lr = OPTIMIZERS[opt]
        result = ex.train_pipeline(mesh, schedule=schedule, data_parallel=data_parallel, steps=STEPS,
                                   num_microbatches=MICROBATCHES, microbatch_size=MICROBATCH_SIZE,
                                   lr=lr, optimizer=make_opt)
        out.append({"stage": mesh.get_local_rank("pp"), "losses": result.losses, "params": result.params,
                    "synced_backwards": result.synced_backwards})
    return out


@pytest.fixture(scope="module")
def pipeline_runs() -> list[list[dict]]:
    """Every case on the same 4 ranks (one spawn): per rank, per case."""
    return run_distributed(_train_cases, 4, args=(CASES,), timeout=120)


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(c) for c in CASES])
def test_pipeline_with_data_parallel_stages_equals_one_process(pipeline_runs, case):
    schedule, data_parallel, opt = CASES[case]
    make_opt, lr = OPTIMIZERS[opt]
    ref = ex.single_process_training(steps=STEPS, global_batch=GLOBAL_BATCH, lr=lr, optimizer=make_opt)
    seen: set[str] = set()
    for rank, per_case in enumerate(pipeline_runs):
        got = per_case[case]
        assert got["stage"] == rank // REPLICAS, "mesh ('pp', 'dp'): ranks 0, 1 are stage 0"
        for name, p in got["params"].items():
            diff = (p - ref.params[name]).abs().max().item()
            assert diff <= TOL, f"rank {rank} ({schedule}, {data_parallel}, {opt}): '{name}' off by {diff:.3g}"
        seen |= set(got["params"])
        if got["stage"] == 1:  # the last stage reports the global batch's loss
            assert got["losses"] == pytest.approx(ref.losses, abs=TOL), (rank, got["losses"], ref.losses)
        else:
            assert got["losses"] == []
        if data_parallel == "ddp":  # the micro-batches' gradients reduced once per step
            assert got["synced_backwards"] == STEPS, (rank, got["synced_backwards"])
    assert seen == set(ref.params), "the stages hold every parameter of the model between them"
    # The update moved the parameters: a pipeline that trained nothing would not pass.
    start = ex.build_model()
    assert max((ref.params[n] - p).abs().max().item() for n, p in start.named_parameters()) > 100 * TOL


def test_stages_split_the_model_by_its_own_names():
    stages = ex.split_stages(ex.build_model(num_layers=5), 3)
    names = [[n for n, _ in s.named_parameters()] for s in stages]
    assert names == [["0.weight", "0.bias", "2.weight", "2.bias"], ["4.weight", "4.bias", "6.weight", "6.bias"],
                     ["8.weight", "8.bias"]]
    with pytest.raises(ValueError, match="num_stages=6"):
        ex.split_stages(ex.build_model(num_layers=5), 6)


def test_example_under_tandem_run_prints_the_single_process_loss():
    steps = 6
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, "-m", "tandem", "run", "--nproc-per-node", "4", "-m", "tandem.examples.pipeline",
         "--schedule", "1f1b", "--steps", str(steps), "--reference"],
        capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    printed = re.findall(r"\[rank 2\] final loss ([\d.]+)", proc.stdout)
    own_reference = re.findall(r"\[rank 2\] reference final loss ([\d.]+)", proc.stdout)
    assert len(printed) == 1 and len(own_reference) == 1, proc.stdout
    ref = ex.single_process_training(steps=steps, global_batch=2 * 4 * 4)  # the example's defaults
    assert abs(float(printed[0]) - ref.losses[-1]) <= TOL, (printed, ref.losses[-1])
    assert printed == own_reference
    diffs = re.findall(r"\[rank (\d)\] stage \d: max abs parameter difference from single-process "
                       r"training ([\d.e+-]+)", proc.stdout)
    assert sorted(int(r) for r, _ in diffs) == [0, 1, 2, 3], proc.stdout
    assert all(float(d) <= TOL for _, d in diffs), diffs
