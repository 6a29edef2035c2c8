"""``tandem plan`` (tandem/tools/plan/): the pure report, the measured
activations, the command line, and the memory it predicts for DDP, ZeRO-1 and
ZeRO-2 against the bytes two gloo ranks really hold after training steps."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tandem
from tandem.ddp.plan import ParamInfo
from tandem.ddp.reducer import GradReducer
from tandem.planner.memory import MemoryEstimate, ddp_bucket_plan, estimate_memory
from tandem.testing import run_distributed
from tandem.testing.models import make_model
from tandem.tools.plan import main, measure, parse_bytes, plan, plan_report

MiB = 2**20


def _small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


# ---------------------------------------------------------------------- measuring

def test_activations_are_the_distinct_storages_saved_for_backward() -> None:
    # Counted by hand: the first Linear saves its input x (5 x 8 floats; it needs no
    # weight, x needs no gradient), Tanh saves its output (5 x 16), which is also
    # the second Linear's saved input; weights are parameters, not activations.
    model = _small()
    m = measure(model, torch.randn(5, 8))
    assert m.activation_bytes == 4 * (5 * 8 + 5 * 16)
    assert m.batch_size == 5 and m.unused == () and not m.opaque
    assert all(p.grad is None for p in model.parameters())  # autograd.grad: .grad untouched
    doubled = measure(model, (torch.randn(10, 8), torch.randn(10, 4)), loss_fn=F.mse_loss)
    # + mse_loss's saved output and target (10 x 4 each)
    assert doubled.activation_bytes == 4 * (10 * 8 + 10 * 16) + 2 * 4 * 10 * 4
    assert doubled.batch_size == 10


def test_unused_parameters_and_broadcast_buffers_are_warned_about() -> None:
    model = make_model("never_used", 0)
    report = plan(model, world_size=2, sample=torch.randn(4, 8))
    assert report.measurement is not None and report.measurement.unused == ("unused.weight", "unused.bias")
    assert any("find_unused_parameters=True" in w and "unused.weight" in w for w in report.warnings)

    bn = make_model("batchnorm", 0)
    before = bn.get_buffer("bn.running_mean").clone()
    report = plan(bn, world_size=2, sample=torch.randn(6, 8))
    assert torch.equal(bn.get_buffer("bn.running_mean"), before)   # restored after the measured forward
    assert [n for n, _ in report.buffers] == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    assert any("broadcast_buffers=False" in w for w in report.warnings)
    quiet = plan(bn, world_size=2, sample=torch.randn(6, 8), broadcast_buffers=False)
    assert not any("broadcast" in w for w in quiet.warnings)


def test_tiny_fully_shard_units_are_warned_about() -> None:
    model = make_model("wide", 0)   # layers.0, layers.1: 6 KiB and 100 KiB, under 256 KiB
    report = plan(model, world_size=3, sample=torch.randn(2, 8))
    assert report.fsdp_units == ("layers.0", "layers.1")
    assert any("2 of the 2 unit(s)" in w and "min_unit_bytes" in w for w in report.warnings)
    kept = plan(model, world_size=3, sample=torch.randn(2, 8), min_unit_bytes=0)
    assert not any("min_unit_bytes (" in w for w in kept.warnings)
    assert [u.name for u in kept.strategies[3].estimate.units] == ["", "layers.0", "layers.1"]
    wide = plan(model, world_size=8)   # the head has 4 rows: some of 8 ranks hold none
    assert any("2 parameter(s) have fewer rows than the 8 ranks (head.weight, head.bias)" in w
               for w in wide.warnings)


# ---------------------------------------------------------------------- the report

def test_batch_arithmetic_and_the_strategy_that_fits() -> None:
    model = _small()
    report = plan(model, world_size=4, sample=torch.randn(6, 8), grad_accum=3, optimizer="sgd")
    assert report.measurement is not None and report.global_batch == 6 * 3 * 4
    assert report.optimizer_bytes_per_param == 0
    activations = report.measurement.activation_bytes
    peaks = [(s.name, s.peak) for s in report.strategies]
    assert [n for n, _ in peaks] == ["DDP", "ZeRO-1", "ZeRO-2", "fully_shard"]
    assert all(s.peak == s.estimate.steady + max(s.estimate.gathered, s.estimate.reducing + activations)
               for s in report.strategies[:3])
    ddp = peaks[0][1]
    for device in (ddp, ddp - 1, min(p for _, p in peaks), min(p for _, p in peaks) - 1):
        r = plan_report(model, world_size=4, measurement=report.measurement, optimizer="sgd",
                        device_memory=device)
        first_fit = next((n for n, p in peaks if p <= device), None)   # the order is the preference
        assert device != ddp or first_fit == "DDP"   # the boundary fits
        assert (None if r.choice is None else r.choice.name) == first_fit, (device, peaks)
        if r.choice is not None:
            assert f"margin {_fmt(device - r.choice.peak)}" in r.describe()
    r = plan_report(model, world_size=4, device_memory="1KiB")
    assert r.choice is None and "nothing" in r.describe()


def _fmt(n: int) -> str:
    from tandem.tools.plan.report import _size
    return _size(n)


def test_sizes_and_optimizers_parse_or_name_the_fix() -> None:
    assert parse_bytes("16GiB") == 16 * 2**30 and parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("512M") == 512 * MiB and parse_bytes("1e9") == 10**9 and parse_bytes("100") == 100
    with pytest.raises(ValueError, match="'16 bananas' is not a size"):
        parse_bytes("16 bananas")
    with pytest.raises(ValueError, match="optimizer 'lbfgs' is not one of"):
        plan(_small(), world_size=2, optimizer="lbfgs")
    assert plan(_small(), world_size=2, optimizer=12).optimizer_bytes_per_param == 12
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        plan(_small(), world_size=0)


def test_command_line_on_the_digits_example(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "tandem.examples.plan_digits:model", "--sample", "tandem.examples.plan_digits:sample",
            "--loss", "tandem.examples.plan_digits:loss", "--world-size", "2", "--device-memory", "16GiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "32 per rank x 1 accumulation step(s) x 2 rank(s) = global batch 64" in out
    assert "fits in 16.0 GiB: DDP" in out and "DDP buckets  8 params in 1 buckets" in out
    assert main([*argv[:-1], "1KiB"]) == 1
    assert "fits in 1.0 KiB: nothing" in capsys.readouterr().out
    assert main(["--model", "tandem.examples.plan_digits:nope", "--world-size", "2"]) == 2
    assert "has no attribute 'nope'" in capsys.readouterr().err


def test_mixed_precision_and_offload_are_planned(capsys: pytest.CaptureFixture[str]) -> None:
    model, sample = _small(), torch.randn(5, 8)
    fp32 = plan(model, world_size=2, sample=sample)
    bf16 = plan(model, world_size=2, sample=sample, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # the sample measured as fully_shard computes: in bf16, on a copy (the model stays fp32)
    assert bf16.measurement is not None and fp32.measurement is not None
    assert bf16.measurement.activation_bytes * 2 == fp32.measurement.activation_bytes
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert bf16.strategies[3].estimate.gathered < fp32.strategies[3].estimate.gathered
    offloaded = plan(model, world_size=2, param_dtype=torch.bfloat16, cpu_offload=True)
    e = offloaded.strategies[3].estimate
    assert e.params == e.grads == e.optimizer == 0 and e.host > 0
    argv = ["--model", "tandem.examples.plan_digits:model", "--world-size", "2"]
    assert main([*argv, "--param-dtype", "bf16", "--reduce-dtype", "fp32", "--cpu-offload"]) == 0
    assert "fully_shard: CPUOffloadPolicy:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*argv, "--param-dtype", "int8"])


def test_the_tandem_command_dispatches_to_plan(capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.launch.cli import main as tandem_main
    assert tandem_main(["plan", "--model", "tandem.examples.plan_digits:model", "--world-size", "3"]) == 0
    assert "tandem plan: DigitNet on 3 rank(s)" in capsys.readouterr().out


def test_stage0_counts_the_flat_buffer_and_solo_param_grads() -> None:
    model = _Big()
    s0, s1, s2, _ = estimate_memory(model, 2, optimizer_bytes_per_param=8)
    elems = [p.numel() for p in model.parameters()]
    solo = 1100 * 1024   # the first weight: >= 4 MiB, a bucket of its own, reduced on param.grad
    rest = sum(elems) - solo
    # the flat buffer: the other parameters, one flag element, padding to 2 (per bucket)
    plan_ = ddp_bucket_plan([ParamInfo(n, p.numel(), p.dtype, p.device) for n, p in model.named_parameters()], 2)
    assert [b.solo for b in plan_.buckets].count(True) == 1
    assert sum(b.padded_numel for b in plan_.buckets if not b.solo) in (rest + 1, rest + 2, rest + 3)
    flat = 4 * sum(b.padded_numel for b in plan_.buckets if not b.solo)
    # param.grad is a view of the flat buffer (Note [gradients born in their bucket]),
    # except the solo parameter's, which is reduced on a .grad of its own
    assert s0.params == 4 * sum(elems) and s0.grads == flat + 4 * solo
    # backward's fresh gradients (after zero_grad(set_to_none=True)) beside the buffer
    assert s0.optimizer == 8 * sum(elems) and s0.reducing == flat
    one = estimate_memory(model, 1)[0]
    assert one.grads == 4 * sum(elems)   # a world of one builds no reducer


# ---------------------------------------------------------------------- measured on 2 ranks

class _Big(nn.Module):
    """One weight of 4.3 MiB (a solo bucket under DDP), and small ones."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(1100, 1024)
        self.mid = nn.Linear(1024, 37)
        self.out = nn.Linear(37, 8)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


MODELS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "big": (_Big, 1100), "encoder": (functools.partial(make_model, "encoder", 0), 8)}


@dataclass
class Held:
    predicted: MemoryEstimate
    construction_plan_equal: bool
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    reducing: int = 0      # sampled during backward: the flat buffer and param.grad beyond the steady ones
    solo: int = 0
    notes: list[str] = field(default_factory=list)


def _storages(tensors: list[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _run(rank: int, world_size: int, name: str, stage: int) -> Held:
    build, features = MODELS[name]
    torch.manual_seed(0)
    model = build()
    predicted = estimate_memory(model, world_size, optimizer_bytes_per_param=8)[stage]
    reducers: list[GradReducer] = []

    def sample(_: torch.Tensor) -> None:
        # registered before DDP's hooks: the gradient has just landed, not yet copied or freed
        buffer = reducers[0].buffer
        buffers = buffer.held_bytes
        # under ZeRO param.grad is born in its bucket (Note [zero buckets]): counted once
        seen = {t.untyped_storage().data_ptr() for t in (*buffer.flat.values(), *buffer.solo.values())}
        grads = _storages([p.grad for p in model.parameters() if p.grad is not None], seen)
        steady_grads = 0 if stage else sum(p.numel() * p.element_size() for p in model.parameters())
        held.reducing = max(held.reducing, buffers + max(0, grads - steady_grads))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(sample)
    ddp = tandem.DistributedDataParallel(model, zero_stage=stage)
    reducer = ddp.reducer
    assert reducer is not None
    reducers.append(reducer)
    held = Held(predicted, reducer.plan == predicted.buckets, solo=sum(b.solo for b in reducer.plan.buckets))
    if stage:
        opt: torch.optim.Optimizer = tandem.ZeroOptimizer(ddp, torch.optim.AdamW, lr=1e-3)
        state = opt.optim.state   # type: ignore[attr-defined]
        masters = [p for g in opt.optim.param_groups for p in g["params"]]   # type: ignore[attr-defined]
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        state, masters = opt.state, []

    for step in range(3):   # stage 0 re-plans its buckets at the second forward
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, features, generator=gen), torch.randn(4, 4 if name == "encoder" else 8, generator=gen)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(ddp(x), y).backward()
        opt.step()

    seen: set[int] = set()
    held.params = _storages(list(model.parameters()), seen)
    held.grads = _storages([p.grad for p in model.parameters() if p.grad is not None], seen)
    held.grads += _storages([t for t in reducer.buffer.flat.values()], seen)
    held.grads += _storages(list(reducer.buffer.solo.values()), seen)
    held.grads += _storages(list(reducer.grad_shards), seen)
    held.optimizer = _storages([*masters, *(v for s in state.values() for k, v in s.items()
                                            if torch.is_tensor(v) and k != "step")], seen)
    return held


def _grid(rank: int, world_size: int) -> dict[tuple[str, int], Held]:
    return {(name, stage): _run(rank, world_size, name, stage) for name in MODELS for stage in (0, 1, 2)}


@functools.cache
def _measured() -> list[dict[tuple[str, int], Held]]:
    return run_distributed(_grid, 2, timeout=120)


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_predicted_memory_is_what_ddp_and_zero_hold(name: str, stage: int) -> None:
    for rank, results in enumerate(_measured()):
        got = results[(name, stage)]
        p = got.predicted
        assert got.construction_plan_equal, (rank, "DDP planned other buckets than ddp_bucket_plan")
        assert got.solo == (1 if (name, stage) == ("big", 0) else 0)
        measured = got.params + got.grads + got.optimizer
        assert abs(measured - p.steady) <= 0.10 * measured, (rank, measured, p.steady)   # the bar
        assert got.params == p.params and got.grads == p.grads, (rank, got, p)
        # rank 0 owns the most elements of each bucket; the last rank may own fewer (padding)
        assert got.optimizer == p.optimizer if rank == 0 else got.optimizer <= p.optimizer, (rank, got, p)
        # backward's transient: DDP's flat buffer (restored at forward); under ZeRO the
        # buckets' own memory, into which the gradients are accumulated (Note [zero
        # buckets] in tandem/ddp/reduction.py), plus at most autograd's new gradient
        # of one parameter before it is added in
        flat = 0 if p.buckets is None else sum(4 * n for n in p.buckets.buffer_numel.values())
        if stage:
            largest = max(4 * q.numel() for q in MODELS[name][0]().parameters())
            assert got.reducing == flat and p.reducing == flat + largest, (rank, got.reducing, p.reducing)


def test_hsdp_rows_memory_and_traffic(capsys: pytest.CaptureFixture[str]) -> None:
    model = make_model("wide", 0)
    report = plan(model, world_size=8, hsdp=2, min_unit_bytes=0)
    names = [s.name for s in report.strategies]
    assert names == ["DDP", "ZeRO-1", "ZeRO-2", "fully_shard", "HSDP 2x4"]
    hsdp, fsdp4 = report.strategies[4].estimate, estimate_memory(model, 4, fsdp=_spec(report))[3]
    assert (hsdp.params, hsdp.grads, hsdp.optimizer) == (fsdp4.params, fsdp4.grads, fsdp4.optimizer)
    traffic = dict(report.traffic)
    # the same gathers and reduce-scatters as fully_shard over 4 ranks, plus an
    # all-reduce of every reduced shard (and its flags) over the 2 replicas
    flat = sum(4 * (u.layout.shard_numel + len(u.layout.params)) for u in fsdp4.units if any(u.trainable))
    assert traffic["HSDP 2x4"].all_reduce == 2 * (2 - 1) * flat // 2 and traffic["fully_shard"].all_reduce == 0
    assert traffic["HSDP 2x4"].reduce_scatter == 3 * flat
    # the first that fits, HSDP preferred to fully_shard
    peaks = {s.name: s.peak for s in report.strategies}
    order = ["DDP", "ZeRO-1", "ZeRO-2", "HSDP 2x4", "fully_shard"]
    for device in [*peaks.values(), min(peaks.values()) - 1]:
        r = plan_report(model, world_size=8, hsdp=2, min_unit_bytes=0, device_memory=device)
        first = next((n for n in order if peaks[n] <= device), None)
        assert (None if r.choice is None else r.choice.name) == first, (device, peaks)
    with pytest.raises(ValueError, match="hsdp=3 must be a number of replicas that divides world_size=8"):
        plan(model, world_size=8, hsdp=3)
    argv = ["--model", "tandem.examples.plan_digits:model", "--world-size", "8", "--hsdp", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "HSDP 2x4" in out and "traffic per rank per step" in out and "across the 2 replicas" in out
    assert main([*argv[:-1], "3"]) == 2


def _spec(report):  # the FullyShardSpec plan_report used
    from tandem.planner.memory import FullyShardSpec
    return FullyShardSpec(units=report.fsdp_units, min_unit_bytes=0)


def test_bytes_between_nodes_follow_the_layout_of_the_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    """``--nodes``: a collective over the world crosses the nodes at ``nodes``
    edges of its ring, gloo's reduce-scatter as the all-reduce it runs; HSDP
    with one replica per node sends only its all-reduce across (measured in
    tests/launch/test_cluster_train.py)."""
    model = make_model("wide", 0)
    report = plan(model, world_size=8, hsdp=2, nodes=2, min_unit_bytes=0)
    traffic = dict(report.traffic)
    assert report.between_nodes("DDP") == 2 * traffic["DDP"].all_reduce
    zero = traffic["ZeRO-1/2"]
    assert zero.reduce_scatter == zero.all_gather > 0
    assert report.between_nodes("ZeRO-1/2") == 2 * (2 * zero.reduce_scatter + zero.all_gather)
    assert report.between_nodes("ZeRO-1/2", backend="nccl") == 2 * (zero.reduce_scatter + zero.all_gather)
    fs = traffic["fully_shard"]
    assert report.between_nodes("fully_shard") == 2 * (fs.all_gather + 2 * fs.reduce_scatter)
    assert report.between_nodes("HSDP 2x4") == 8 * traffic["HSDP 2x4"].all_reduce
    assert plan(model, world_size=8, hsdp=2, nodes=4, min_unit_bytes=0).between_nodes("HSDP 2x4") is None
    assert plan(model, world_size=8).between_nodes("DDP") == 0          # one node: nothing crosses
    with pytest.raises(ValueError, match="nodes=3 must be a number of nodes that divides world_size=8"):
        plan(model, world_size=8, nodes=3)
    assert main(["--model", "tandem.examples.plan_digits:model", "--world-size", "4", "--nodes", "2"]) == 0
    assert "between nodes" in capsys.readouterr().out
