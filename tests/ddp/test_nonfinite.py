"""Bad numbers: ``DistributedDataParallel(check_finite=...)`` (Note [check_finite] in
tandem/ddp/finite.py), the Trainer's ``nonfinite`` option, and fp16's GradScaler
under sharded gradients (Note [agreed found-inf] in tandem/train/precision.py).

The bar: with a NaN or Inf injected on one rank only, every rank takes the same
decision (raises, naming the rank and the parameters, or skips the step), and
the replicas stay bitwise identical, equal to a run that never saw the bad step.

NaN/Inf enter through a tensor hook on one parameter (or through the input) on
the chosen ranks only, so the other ranks' own gradients stay finite. Each
world size runs its whole grid of cases in one spawned group (a module
fixture); the tests read their cases' outcomes from every rank.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tandem
from tandem import comm_hooks
from tandem.testing import RankFailure, as_dtensor, run_distributed, still_running
from tandem.train.config import Precision
from tandem.train.precision import ShardedGradients, scaler_for

TIMEOUT_S = 90.0
TINY_CAP_MB = 1e-6      # every parameter closes a bucket of its own
STEPS = 4
BAD_STEP = 2
NAMES = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]

CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
    "allreduce hook": {"hook": "allreduce"},
    "fp16 hook": {"hook": "fp16"},
    "zero1": {"zero_stage": 1},
    "zero2": {"zero_stage": 2},
    "accumulation": {"accumulate": 2},
}
# Configurations whose skip run calls optimizer.step() after the skipped step
# anyway: dropping the gradients must make that step a no-op by itself.
STEP_ANYWAY = {"gradient_as_bucket_view", "fp16 hook", "zero2", "accumulation"}


# ---------------------------------------------------------------- helpers

def _model() -> nn.Sequential:
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _batch(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(1000 * step + 10 * rank + micro))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([_full(p).detach().reshape(-1) for p in model.parameters()]).clone()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _Injector:
    """While ``active``, replaces element 0 of the gradient of parameter
    ``plan[rank][0]`` with ``plan[rank][1]`` on the ranks in ``plan``."""

    def __init__(self, model: nn.Module, rank: int, plan: dict[int, tuple[str, float]]) -> None:
        self.target = plan.get(rank)
        self.active = False
        for name, p in model.named_parameters():
            p.register_hook(functools.partial(self._hook, name))

    def _hook(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        if not self.active or self.target is None or self.target[0] != name:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = self.target[1]
        return grad


def _ranks_in_step(rank: int, world_size: int) -> bool:
    """A collective after an error path: right only if no rank left one pending."""
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t) == world_size * (world_size + 1) / 2


def _ddp(model: nn.Module, config: dict[str, Any], check_finite: Any = None,
         ) -> tuple[tandem.DistributedDataParallel, torch.optim.Optimizer]:
    """``check_finite=None``: the argument is not passed at all."""
    options = {k: v for k, v in config.items() if k not in ("hook", "accumulate")}
    if check_finite is not None:
        options["check_finite"] = check_finite
    ddp = tandem.DistributedDataParallel(model, bucket_cap_mb=TINY_CAP_MB, **options)
    hook = config.get("hook")
    if hook is not None:
        ddp.register_comm_hook(None, {"allreduce": comm_hooks.allreduce_hook,
                                      "fp16": comm_hooks.fp16_compress_hook}[hook])
    if config.get("zero_stage"):
        return ddp, tandem.ZeroOptimizer(ddp, torch.optim.Adam, lr=0.01)
    return ddp, torch.optim.Adam(model.parameters(), lr=0.01)


def _backward(ddp: tandem.DistributedDataParallel, rank: int, step: int, accumulate: int, injector: _Injector | None,
              scale_input: float = 1.0) -> None:
    """One (possibly accumulated) synchronised backward; the injector, when
    active at this step, acts on the first micro-batch only."""
    for micro in range(accumulate):
        if injector is not None:
            injector.active = micro == 0 and injector.active
        sync = micro == accumulate - 1
        with contextlib.nullcontext() if sync else ddp.no_sync():
            x = _batch(rank, step, micro) * (scale_input if micro == 0 else 1.0)
            (ddp(x).square().mean() / accumulate).backward()


def _train(rank: int, config: dict[str, Any], check_finite: Any, steps: list[int],
           plan: dict[int, tuple[str, float]], step_anyway: bool = False) -> dict[str, Any]:
    """Train on ``steps``, injecting ``plan`` at BAD_STEP; skip optimizer.step()
    when DDP found non-finite gradients (unless ``step_anyway``)."""
    model = _model()
    injector = _Injector(model, rank, plan)
    ddp, optimizer = _ddp(model, config, check_finite)
    counts: list[int] = []
    events: list[str] = []
    ddp.comm.observers.append(lambda e: events.append(e.op))
    found, after_each = [], []
    for step in steps:
        injector.active = step == BAD_STEP
        before = len(events)
        _backward(ddp, rank, step, config.get("accumulate", 1), injector)
        counts.append(len(events) - before)
        found.append(ddp.found_nonfinite)
        if step_anyway or not ddp.found_nonfinite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after_each.append(_flat(model))
    return {"found": found, "params": _flat(model), "after_each": after_each, "counts": counts,
            "steps": steps}


def _raise_case(rank: int, config: dict[str, Any], plan: dict[int, tuple[str, float]],
                scale_input: float = 1.0) -> dict[str, Any]:
    """Steps 0..BAD_STEP with check_finite='raise': the bad step raises; then one
    more step trains normally (after zero_grad), on every rank."""
    model = _model()
    injector = _Injector(model, rank, plan)
    ddp, optimizer = _ddp(model, config, "raise")
    message = None
    for step in range(BAD_STEP + 1):
        injector.active = step == BAD_STEP
        try:
            _backward(ddp, rank, step, config.get("accumulate", 1), injector,
                      scale_input if step == BAD_STEP else 1.0)
        except RuntimeError as e:
            message = str(e)
            break
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    in_step = _ranks_in_step(rank, dist.get_world_size())
    optimizer.zero_grad(set_to_none=True)
    injector.active = False
    _backward(ddp, rank, BAD_STEP + 1, 1, injector)
    optimizer.step()
    return {"message": message, "in_step": in_step, "recovered": not ddp.found_nonfinite,
            "params": _flat(model)}


def _torch_reference(rank: int, steps: list[int]) -> torch.Tensor:
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=TINY_CAP_MB)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in steps:
        ddp(_batch(rank, step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return _flat(model)


def _join_case(rank: int, world_size: int, hook: str | None) -> dict[str, Any]:
    """Uneven inputs (rank 0 has one batch fewer) with check_finite='skip' and a
    NaN on rank 1 while every rank still trains."""
    model = _model()
    injector = _Injector(model, rank, {1: ("2.weight", math.nan)})
    ddp, optimizer = _ddp(model, {"hook": hook} if hook else {}, "skip")
    reports = []
    with ddp.join():
        for step in range(STEPS - (rank == 0)):
            injector.active = step == 1
            _backward(ddp, rank, step, 1, injector)
            reports.append(ddp.nonfinite_report)
            if not ddp.found_nonfinite:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {"reports": reports, "params": _flat(model)}


def _bad_arguments(rank: int, world_size: int) -> dict[str, str]:
    messages = {}
    bad: list[tuple[str, Any]] = [("unknown mode", "sometimes"), ("a number", 1)]
    for name, value in bad:
        try:
            tandem.DistributedDataParallel(_model(), check_finite=value)
        except ValueError as e:
            messages[name] = str(e)
    try:  # ranks that disagree would issue different collectives: refused at construction
        tandem.DistributedDataParallel(_model(), check_finite="skip" if rank == 1 else False)
    except ValueError as e:
        messages["disagreeing ranks"] = str(e)
    return messages


# ---------------------------------------------------------------- the grid

def _grid(rank: int, world_size: int, base: str) -> dict[str, Any]:
    """Every case of this file but one, in one spawned group."""
    one = {1: ("2.weight", math.nan)}
    every_other = {r: (NAMES[r % len(NAMES)], math.inf if r % 2 else -math.nan) for r in range(1, world_size)}
    normal = [s for s in range(STEPS) if s != BAD_STEP]
    out: dict[str, Any] = {"raise": {}, "skip": {}, "reference": {}, "checked, finite": {},
                           "pid": os.getpid()}
    for name, config in CONFIGS.items():
        out["raise"][name] = _raise_case(rank, config, one)
        out["skip"][name] = _train(rank, config, "skip", list(range(STEPS)), one,
                                   step_anyway=name in STEP_ANYWAY)
        out["reference"][name] = _train(rank, config, False, normal, {})
        out["checked, finite"][name] = _train(rank, config, "skip", normal, {})
    out["no argument"] = _train(rank, {}, None, normal, {})
    out["raise, several ranks"] = _raise_case(rank, {}, every_other)
    out["raise, nan input"] = _raise_case(rank, {}, {}, scale_input=math.nan if rank == 1 else 1.0)
    out["raise, overflow in fp16 hook"] = _raise_case(rank, {"hook": "fp16"}, {1: ("2.weight", 1e6)})
    out["torch"] = _torch_reference(rank, normal)
    out["join"] = {hook: _join_case(rank, world_size, hook) for hook in (None, "allreduce")}
    out["bad arguments"] = _bad_arguments(rank, world_size)
    out["fp16"] = {kind: _fp16_sharded(rank, world_size, kind) for kind in ("zero1", "zero2", "fully_shard")}
    out["trainer"] = _trainer_grid(rank, world_size, base)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def grid(request, tmp_path_factory) -> list[dict[str, Any]]:
    base = str(tmp_path_factory.mktemp(f"grid{request.param}"))
    try:
        return run_distributed(_grid, request.param, args=(base,), timeout=TIMEOUT_S)
    except RankFailure as e:
        details = "\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(e.tracebacks.items()))
        pytest.fail(f"ranks {sorted(e.tracebacks)} failed:\n{details}", pytrace=False)


def test_no_rank_process_outlives_the_group(grid):
    assert still_running([out["pid"] for out in grid]) == []


def _identical(results: list[torch.Tensor]) -> bool:
    return all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_raise_every_rank_raises_naming_rank_1_and_the_parameter(grid, config):
    for rank, result in enumerate(r["raise"][config] for r in grid):
        message = result["message"]
        assert message is not None, f"rank {rank} did not raise"
        assert message.startswith(f"rank {rank}: DistributedDataParallel(check_finite='raise')")
        assert f"rank 1: non-finite gradient in parameters '2.weight' before reduction (step {BAD_STEP})" \
            in message
        assert "rank 0:" not in message.split(")", 1)[1] and "rank 2: non" not in message
        assert "check_finite='skip'" in message  # what to do instead
        assert result["in_step"] and result["recovered"]
    assert _identical([r["raise"][config]["params"] for r in grid])


def test_raise_names_every_offending_rank_and_each_ones_parameters(grid):
    world_size = len(grid)
    for r in grid:
        message = r["raise, several ranks"]["message"]
        for bad in range(1, world_size):
            assert f"rank {bad}: non-finite gradient in parameters '{NAMES[bad % len(NAMES)]}' " in message
        assert "rank 0: non-finite" not in message
    # A NaN input on rank 1 poisons all of rank 1's gradients.
    for r in grid:
        message = r["raise, nan input"]["message"]
        assert "rank 1: non-finite gradient in parameters " + ", ".join(repr(n) for n in NAMES) in message


def test_raise_reports_an_overflow_that_only_the_reduction_made(grid):
    # 1e6 is finite in fp32; fp16_compress_hook casts it (divided by the world size) to inf.
    for rank, r in enumerate(grid):
        message = r["raise, overflow in fp16 hook"]["message"]
        assert message.startswith(f"rank {rank}: ")
        assert "no rank's gradient was non-finite before reduction, but the reduction overflowed " \
               "in parameters '2.weight'" in message


@pytest.mark.parametrize("config", list(CONFIGS))
def test_skip_every_rank_skips_and_replicas_equal_a_run_without_the_bad_step(grid, config):
    # In the STEP_ANYWAY configurations optimizer.step() runs after the skip too.
    runs = [r["skip"][config] for r in grid]
    for run in runs:
        assert run["found"] == [s == BAD_STEP for s in range(STEPS)]
    for step in range(STEPS):
        assert _identical([run["after_each"][step] for run in runs]), step
    assert torch.equal(runs[0]["after_each"][BAD_STEP], runs[0]["after_each"][BAD_STEP - 1])
    assert torch.isfinite(runs[0]["params"]).all()
    # The skipped step left no trace (Adam's state included): bitwise the
    # parameters of a run that never saw that batch.
    for rank, r in enumerate(grid):
        assert torch.equal(r["skip"][config]["params"], r["reference"][config]["params"]), rank


def test_normal_steps_match_torch_ddp(grid):
    for r in grid:
        assert torch.allclose(r["reference"]["plain"]["params"], r["torch"], rtol=0, atol=1e-6)
        assert torch.allclose(r["skip"]["plain"]["params"], r["torch"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_check_finite_changes_no_result_and_adds_no_collective(grid, config):
    for r in grid:
        off = r["reference"][config]  # check_finite=False, the same steps
        checked = r["checked, finite"][config]
        assert torch.equal(checked["params"], off["params"])
        assert checked["found"] == [False] * (STEPS - 1)
        # The plain path decides on the reduced buckets; hooks and ZeRO widen the
        # flag all-reduce they issue anyway: the same number of collectives per step.
        assert checked["counts"] == off["counts"]
    for r in grid:  # check_finite=False is the default, bit for bit
        assert torch.equal(r["reference"]["plain"]["params"], r["no argument"]["params"])
        assert r["reference"]["plain"]["counts"] == r["no argument"]["counts"]


@pytest.mark.parametrize("hook", [None, "allreduce"])
def test_skip_under_join_agrees_and_names_the_parameters(grid, hook):
    for r in grid:
        reports = r["join"][hook]["reports"]
        assert [rep is not None for rep in reports] == [s == 1 for s in range(len(reports))]
        assert reports[1].before is None and reports[1].after == ("2.weight",)
        assert "'2.weight' after reduction" in reports[1].describe()
    assert _identical([r["join"][hook]["params"] for r in grid])


def test_bad_arguments_name_the_value(grid):
    for r in grid:
        messages = r["bad arguments"]
        assert "check_finite must be False, True, 'raise' or 'skip', got 'sometimes'" in messages["unknown mode"]
        assert "got 1" in messages["a number"]
        assert "option check_finite='skip' on ranks [1]" in messages["disagreeing ranks"]
        assert "option check_finite=None on ranks [0" in messages["disagreeing ranks"]


# ---------------------------------------------------------------- fp16 with sharded gradients

def _shard_per_layer(model: nn.Sequential) -> None:
    """A fully_shard unit per Linear (uneven rows), then the root."""
    for layer in model:
        if isinstance(layer, nn.Linear):
            tandem.fully_shard(layer, min_unit_bytes=0)
    tandem.fully_shard(model)


def _fp16_sharded(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    """fp16 steps with the Trainer's GradScaler for sharded gradients; at step 1,
    an Inf in rank 1's shard of the reduced gradients only. Without agreement
    rank 1 would skip alone, and under ZeRO its peers would wait forever in the
    parameter all-gathers of their step. Returns per step: skipped, the scale,
    the parameters."""
    model = _model()
    optimizer: torch.optim.Optimizer
    grad_shards: list[torch.Tensor] = []
    if kind == "fully_shard":
        _shard_per_layer(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        target: Any = optimizer
        ddp: nn.Module = model
    else:
        ddp = tandem.DistributedDataParallel(model, zero_stage=int(kind[-1]), bucket_cap_mb=TINY_CAP_MB)
        optimizer = tandem.ZeroOptimizer(ddp, torch.optim.SGD, lr=0.1)
        assert ddp.reducer is not None
        grad_shards = ddp.reducer.grad_shards
        target = ShardedGradients(optimizer, grad_shards)
    scaler = scaler_for(Precision.FP16, torch.device("cpu"), sharded=True)
    skipped, scales, params = [], [], []
    for step in range(4):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ddp(_batch(rank, step)).float().square().mean() * 1e-2  # no overflow of its own
        scaler.scale(loss).backward()
        if step == 1 and rank == 1:
            if kind == "fully_shard":
                as_dtensor(model.get_parameter("2.weight").grad).to_local().view(-1)[0] = math.inf
            else:
                grad_shards[2].view(-1)[0] = math.inf
        scale = scaler.get_scale()
        scaler.step(target)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        skipped.append(scaler.get_scale() < scale)
        scales.append(scaler.get_scale())
        params.append(_flat(model))
    return {"skipped": skipped, "scales": scales, "params": params}


@pytest.mark.parametrize("kind", ["zero1", "zero2", "fully_shard"])
def test_fp16_inf_in_one_ranks_shard_skips_the_step_on_every_rank(grid, kind):
    runs = [r["fp16"][kind] for r in grid]
    for run in runs:
        assert run["skipped"][1], "every rank skipped the step with the Inf"
        assert run["skipped"] == runs[0]["skipped"] and run["scales"] == runs[0]["scales"]
        assert torch.equal(run["params"][1], run["params"][0])  # nothing stepped
    for step in range(4):
        assert _identical([run["params"][step] for run in runs])
    assert torch.isfinite(runs[0]["params"][-1]).all()


# ---------------------------------------------------------------- the Trainer

class _InfIntoGrad(torch.autograd.Function):
    """Identity forward; backward puts Inf into element [0, 0] of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[0, 0] = math.inf
        return grad


class _Poison(nn.Module):
    """On rank ``rank``, at the ``at``-th training forward, makes the gradient of
    the previous layer's output row 0 infinite: the gradients of ``0.weight``
    row 0 and ``0.bias`` element 0, which lie in the first rank's shard."""

    def __init__(self, rank: int, poisoned_rank: int, at: int) -> None:
        super().__init__()
        self.poisoned = rank == poisoned_rank
        self.at = at
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        self.calls += 1
        return _InfIntoGrad.apply(x) if self.poisoned and self.calls == self.at else x


def _trainer_run(rank: int, world_size: int, output_dir: str, options: dict[str, Any],
                 kind: str = "ddp", at: int = 3) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, :3] * 2).argmax(1))
    tandem.seed_everything(0)
    net = nn.Sequential(nn.Linear(4, 8), _Poison(rank, 1, at), nn.Tanh(), nn.Linear(8, 3))
    model: nn.Module = net
    if kind.startswith("zero"):
        model = tandem.DistributedDataParallel(net, zero_stage=int(kind[-1]), bucket_cap_mb=TINY_CAP_MB)
        optimizer: Any = tandem.ZeroOptimizer(model, torch.optim.SGD, lr=0.1)
    else:
        if kind == "fully_shard":
            _shard_per_layer(net)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = tandem.TrainerConfig(output_dir=output_dir, batch_size=8, log_every=1, plot=False,
                                  progress=False, shuffle=False, **options)
    trainer = tandem.Trainer(model, optimizer, data, nn.functional.cross_entropy, config=config)
    result = trainer.fit()
    module = getattr(trainer.model, "module", trainer.model)
    return {"skipped": [r["skipped_steps"] for r in result.history if r["kind"] == "train"],
            "params": _flat(module), "steps": result.steps,
            "scale": None if trainer.scaler is None else trainer.scaler.get_scale()}


def _trainer_grid(rank: int, world_size: int, base: str) -> dict[str, Any]:
    return {"skip": _trainer_run(rank, world_size, f"{base}/skip", dict(nonfinite="skip")),
            "fp16 zero2": _trainer_run(rank, world_size, f"{base}/zero2",
                                       dict(nonfinite="skip", precision="fp16"), kind="zero2"),
            "fp16 zero1 clipped": _trainer_run(rank, world_size, f"{base}/zero1",
                                               dict(nonfinite="skip", precision="fp16", max_grad_norm=1.0),
                                               kind="zero1"),
            "fp16 fully_shard": _trainer_run(rank, world_size, f"{base}/fsdp",
                                             dict(nonfinite="skip", precision="fp16"), kind="fully_shard"),
            "fp16 without poison": _trainer_run(rank, world_size, f"{base}/clean",
                                                dict(nonfinite="skip", precision="fp16"), kind="zero2",
                                                at=0)}


def test_trainer_skip_skips_on_every_rank_and_counts_it(grid):
    runs = [r["trainer"]["skip"] for r in grid]
    steps = math.ceil(64 / (8 * len(grid)))
    for run in runs:
        assert run["skipped"] == [int(s == 2) for s in range(steps)]  # the third forward
        assert run["steps"] == steps
    assert _identical([run["params"] for run in runs])
    assert torch.isfinite(runs[0]["params"]).all()


@pytest.mark.parametrize("case", ["fp16 zero2", "fp16 zero1 clipped", "fp16 fully_shard"])
def test_trainer_fp16_with_sharded_gradients_skips_together(grid, case):
    runs = [r["trainer"][case] for r in grid]
    clean = grid[0]["trainer"]["fp16 without poison"]["skipped"]
    for run in runs:
        assert run["skipped"] == runs[0]["skipped"] and run["scale"] == runs[0]["scale"]
        # The poisoned step is skipped, whatever the scaler skipped before it.
        assert run["skipped"][:2] == clean[:2] and run["skipped"][2] == 1
    assert _identical([run["params"] for run in runs])
    assert torch.isfinite(runs[0]["params"]).all()


def _trainer_raises(rank: int, world_size: int, output_dir: str) -> None:
    _trainer_run(rank, world_size, output_dir, dict(nonfinite="raise"))


def test_trainer_raise_fails_every_rank_naming_rank_1(tmp_path):
    with pytest.raises(RankFailure) as info:
        run_distributed(_trainer_raises, 2, timeout=TIMEOUT_S, args=(str(tmp_path),))
    assert sorted(info.value.tracebacks) == [0, 1]
    for text in info.value.tracebacks.values():
        assert "rank 1: non-finite gradient in parameters '0.weight', '0.bias' before reduction (step 2)" in text


def test_trainer_one_process_checks_its_own_gradients(tmp_path):
    result = _trainer_run(0, 1, str(tmp_path / "skip"), dict(nonfinite="skip"), at=0)
    assert result["skipped"] == [0] * 8
    with pytest.raises(RuntimeError, match="Trainer.nonfinite='raise'.: .*'0.weight', '0.bias'"):
        _one_process_poisoned(str(tmp_path / "raise"))


def _one_process_poisoned(output_dir: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, x[:, :3].argmax(1))
    model = nn.Sequential(nn.Linear(4, 8), _Poison(0, 0, 2), nn.Tanh(), nn.Linear(8, 3))
    config = tandem.TrainerConfig(output_dir=output_dir, batch_size=8, plot=False, progress=False,
                                  nonfinite="raise")
    tandem.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                   nn.functional.cross_entropy, config=config).fit()


@pytest.mark.parametrize("options, expected", [
    (dict(nonfinite="sometimes"), "nonfinite must be False, True, 'raise' or 'skip', got 'sometimes'"),
    (dict(nonfinite="raise", precision="fp16"), "nonfinite='raise' does not go with precision='fp16'"),
    (dict(precision="fp16", ddp_options={"check_finite": "skip"}), "use nonfinite='skip' instead"),
    (dict(nonfinite="skip", ddp_options={"check_finite": "raise"}), "set one of them"),
])
def test_trainer_config_refuses_bad_nonfinite_options(options, expected):
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        tandem.TrainerConfig(**options)
