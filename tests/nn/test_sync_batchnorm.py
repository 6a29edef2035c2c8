"""tandem.SyncBatchNorm on 2 and 4 ranks with different (and empty) per-rank
batches equals BatchNorm on the concatenated batch in one process.

Each rank builds the whole global batch from a seed, runs torch's BatchNorm on
all of it as the reference, and runs SyncBatchNorm on its own slice. It compares
its slice of the outputs and input gradients, the weight and bias gradients
summed over ranks (each rank holds its share, as with torch's SyncBatchNorm),
the running statistics, and eval-mode outputs. A grid of cases runs inside one
spawned group per world size.

A rank may hold no samples: it joins both collectives with zero sums, gets an
empty output, and zero weight and bias gradients. The ranks together must hold
at least 2 values per channel (one value has no variance, and torch's
BatchNorm refuses it too); with fewer, every rank raises ValueError.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tandem
from tandem.testing import grad_of, run_distributed

TOL = 1e-5
C = 3

# Layer -> (BatchNorm class, per-sample shape after the channel dim, channels_last)
LAYERS = {
    "1d": (nn.BatchNorm1d, (), False),
    "1d_seq": (nn.BatchNorm1d, (4,), False),
    "2d": (nn.BatchNorm2d, (3, 2), False),
    "2d_channels_last": (nn.BatchNorm2d, (3, 2), True),
    "3d": (nn.BatchNorm3d, (2, 2, 2), False),
}


@dataclass(frozen=True)
class Case:
    sizes: tuple[int, ...]               # samples per rank
    layer: str = "2d"
    bn: dict = field(default_factory=dict)
    steps: int = 3

    @property
    def name(self) -> str:
        return f"{self.layer}/sizes={self.sizes}/{self.bn}"


def _global_batch(case: Case, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (with a mean of their own in each channel) and output gradients."""
    _, tail, channels_last = LAYERS[case.layer]
    g = torch.Generator().manual_seed(1000 + step)
    shape = (sum(case.sizes), C, *tail)
    x = torch.randn(shape, generator=g) * 3 + torch.tensor([2.0, -1.0, 0.5]).view(1, C, *[1] * len(tail))
    dy = torch.randn(shape, generator=g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, dy


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    return 0.0 if a.numel() == 0 else (a.double() - b.double()).abs().max().item()


def _grad(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.grad


def _summed(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.clone()
    dist.all_reduce(t)
    return t


def _run_case(rank: int, case: Case) -> dict[str, float]:
    bn_cls = LAYERS[case.layer][0]
    torch.manual_seed(0)
    kwargs = dict(case.bn)
    ref = bn_cls(C, **{k: v for k, v in kwargs.items() if k != "bias"})
    if not kwargs.get("bias", True):
        ref.register_parameter("bias", None)   # torch < 2.5 has no ``bias`` argument
    if ref.weight is not None:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
    if ref.bias is not None:
        with torch.no_grad():
            ref.bias.uniform_(-1, 1)
    ours = tandem.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    assert isinstance(ours, tandem.SyncBatchNorm)
    events: list[tuple[str, str, int]] = []
    ours.comm.observers.append(lambda e: events.append((e.op, e.tag, e.numel)))
    lo, hi = sum(case.sizes[:rank]), sum(case.sizes[: rank + 1])
    worst: dict[str, float] = {}

    def record(key: str, value: float) -> None:
        worst[key] = max(worst.get(key, 0.0), value)

    for step in range(case.steps):
        x, dy = _global_batch(case, step)
        x_ref = x.clone().requires_grad_()
        x_ours = x[lo:hi].clone().requires_grad_()
        for m in (ref, ours):
            m.zero_grad(set_to_none=True)
        y_ref = ref(x_ref)
        y_ours = ours(x_ours)
        (y_ref * dy).sum().backward()
        (y_ours * dy[lo:hi]).sum().backward()
        record("output", _diff(y_ref[lo:hi], y_ours))
        record("input grad", _diff(grad_of(x_ref)[lo:hi], x_ours.grad))
        record("weight grad", _diff(_grad(ref.weight), _summed(_grad(ours.weight))))
        record("bias grad", _diff(_grad(ref.bias), _summed(_grad(ours.bias))))
        if ours.bias is not None:
            # Each rank's bias gradient is its own share, as with torch's SyncBatchNorm.
            dims = [0, *range(2, x.dim())]
            record("local bias grad", _diff(dy[lo:hi].sum(dims), ours.bias.grad))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            record(name, _diff(getattr(ref, name), getattr(ours, name)))
    expected = [("all_reduce", "sync_batchnorm forward", 2 * C + 1),
                ("all_reduce", "sync_batchnorm backward", 2 * C)] * case.steps
    record("collectives", 0.0 if events == expected else float("inf"))
    events.clear()
    ref.eval()
    ours.eval()
    x, _ = _global_batch(case, case.steps)
    with torch.no_grad():
        # Without running statistics, eval normalises with the batch's own, and
        # like torch's SyncBatchNorm does not synchronise (ranks may evaluate
        # different numbers of batches, or only rank 0 may evaluate).
        expected = ref(x)[lo:hi] if ref.track_running_stats else ref(x[lo:hi])
        record("eval output", _diff(expected, ours(x[lo:hi])))
    record("eval collectives", float(len(events)))
    return worst


def _too_few_values(rank: int, sizes: tuple[int, ...]) -> str:
    """Every rank must raise, and the group must still work afterwards."""
    ours = tandem.SyncBatchNorm(C)
    try:
        ours(torch.randn(sizes[rank], C))
    except ValueError as e:
        message = str(e)
    else:
        message = "no error"
    t = torch.ones(1)
    dist.all_reduce(t)
    return f"{message} | group alive: {int(t.item())}"


def _large_mean(rank: int, sizes: tuple[int, ...]) -> dict[str, float]:
    """Data with a mean of 1000 and a spread of 3: the variance must not come from
    float32 sums of squares (see Note [sums, not means] in tandem/nn/functional.py).
    Returns the running variance's error against float64 BatchNorm, for tandem and
    for the textbook float32 E[x^2] - E[x]^2 (which shows the data are hard enough)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(sum(sizes), C, 8, generator=g) * 3 + 1000
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    ref = nn.BatchNorm1d(C, momentum=1.0).double()    # running_var := the batch's unbiased variance
    ref(x.double())
    ours = tandem.SyncBatchNorm(C, momentum=1.0)
    ours(x[lo:hi])
    n = x.numel() // C
    mean_sq = (x * x).sum((0, 2)) / n
    textbook = (mean_sq - (x.sum((0, 2)) / n) ** 2) * (n / (n - 1))
    assert ours.running_var is not None and ref.running_var is not None
    return {"tandem": (ours.running_var.double() - ref.running_var).abs().max().item(),
            "textbook": (textbook.double() - ref.running_var).abs().max().item()}


def _ddp_training(rank: int, world_size: int, sizes: tuple[int, ...]) -> float:
    """A converted conv net under tandem's DDP trains like BatchNorm on the global batch.

    DDP averages gradients over ranks, so each rank's loss is scaled by the world
    size to make the sum of the losses (the global loss) what is differentiated.
    """
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(2, C, 3, padding=1), nn.BatchNorm2d(C), nn.ReLU(),
                          nn.Flatten(), nn.Linear(C * 16, 2), nn.BatchNorm1d(2))
    model = tandem.DistributedDataParallel(
        tandem.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(plain)))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (plain, model)]
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, target = torch.randn(sum(sizes), 2, 4, 4, generator=g), torch.randn(sum(sizes), 2, generator=g)
        for opt in opts:
            opt.zero_grad()
        ((plain(x) - target) ** 2).sum().backward()
        (((model(x[lo:hi]) - target[lo:hi]) ** 2).sum() * world_size).backward()
        for opt in opts:
            opt.step()
    state, ref_state = model.module.state_dict(), plain.state_dict()
    assert state.keys() == ref_state.keys()
    return max(_diff(ref_state[k].double(), state[k].double()) for k in state)


def _run_all(rank: int, world_size: int, cases: list[Case], too_few: list[tuple[int, ...]],
             ddp_sizes: tuple[int, ...]) -> dict:
    return {"cases": [_run_case(rank, c) for c in cases],
            "too_few": [_too_few_values(rank, s) for s in too_few],
            "large_mean": _large_mean(rank, cases[0].sizes),
            "ddp": _ddp_training(rank, world_size, ddp_sizes)}


def _check(world_size: int, cases: list[Case], too_few: list[tuple[int, ...]],
           ddp_sizes: tuple[int, ...]) -> None:
    results = run_distributed(_run_all, world_size, args=(cases, too_few, ddp_sizes), timeout=240)
    failures = []
    for rank, result in enumerate(results):
        for case, worst in zip(cases, result["cases"]):
            failures += [f"{case.name} rank {rank}: {key} differs by {d:.3g}"
                         for key, d in worst.items() if not d <= TOL]
        for sizes, message in zip(too_few, result["too_few"]):
            if "more than 1 value per channel" not in message or "group alive: " \
                    f"{world_size}" not in message:
                failures.append(f"sizes {sizes} rank {rank}: {message}")
        large = result["large_mean"]
        if not (large["tandem"] <= TOL / 10 and large["textbook"] > 100 * TOL):
            failures.append(f"mean 1000 rank {rank}: running_var errors {large}")
        if not result["ddp"] <= TOL:
            failures.append(f"DDP training rank {rank}: parameters differ by {result['ddp']:.3g}")
    assert not failures, "\n".join(failures)


def _grid(sizes: list[tuple[int, ...]]) -> list[Case]:
    cases = [Case(s, layer) for s in sizes for layer in LAYERS]
    s = sizes[0]
    cases += [
        Case(s, bn=dict(momentum=None), steps=4),       # cumulative average
        Case(s, bn=dict(momentum=0.5)),
        Case(s, bn=dict(affine=False)),
        Case(s, bn=dict(track_running_stats=False)),
        Case(s, bn=dict(eps=1e-2)),
        Case(s, bn=dict(bias=False)),
    ]
    return cases


def test_two_ranks() -> None:
    _check(2, _grid([(5, 2), (4, 0), (1, 1)]), too_few=[(1, 0), (0, 0)], ddp_sizes=(3, 0))


def test_four_ranks() -> None:
    _check(4, _grid([(3, 1, 0, 6), (2, 2, 2, 2), (0, 0, 1, 1)]), too_few=[(0, 1, 0, 0)],
           ddp_sizes=(2, 0, 3, 1))


# One process: conversion, and no process group.

class Block(nn.Module):
    """A ResNet basic block."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout, momentum=None)
        self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.blocks = nn.Sequential(Block(4, 4, 1), Block(4, 8, 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8, 6), nn.BatchNorm1d(6, affine=False),
                                  nn.Linear(6, 2), nn.BatchNorm1d(2, track_running_stats=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.blocks(self.stem(x))))


def _trained_resnet() -> ResNetLike:
    torch.manual_seed(0)
    model = ResNetLike()
    model(torch.randn(4, 3, 8, 8)).sum().backward()   # non-default running statistics
    model.get_parameter("blocks.0.bn1.weight").requires_grad_(False)
    model.get_submodule("blocks.1.shortcut").eval()
    return model


_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _bn_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, _BATCHNORMS)}


def test_convert_round_trips_a_resnet_state_dict() -> None:
    model = _trained_resnet()
    original_layers = _bn_layers(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    converted = tandem.SyncBatchNorm.convert_sync_batchnorm(model)
    assert converted is model
    layers = _bn_layers(converted)
    assert layers.keys() == original_layers.keys() and len(layers) == 9
    for name, layer in layers.items():
        old = original_layers[name]
        assert type(layer) is tandem.SyncBatchNorm, name
        assert layer.weight is old.weight and layer.bias is old.bias, name
        assert layer.running_mean is old.running_mean and layer.running_var is old.running_var, name
        assert layer.num_batches_tracked is old.num_batches_tracked, name
        assert (layer.momentum, layer.eps, layer.affine, layer.track_running_stats, layer.training) == \
               (old.momentum, old.eps, old.affine, old.track_running_stats, old.training), name
        assert layer.process_group is None
    assert not converted.get_parameter("blocks.0.bn1.weight").requires_grad
    assert not converted.get_submodule("blocks.1.shortcut.1").training
    # The state_dict is unchanged, and loads both ways.
    new_state = converted.state_dict()
    assert list(new_state) == list(state)
    assert all(torch.equal(state[k], new_state[k]) for k in state)
    fresh_plain, fresh_sync = ResNetLike(), tandem.SyncBatchNorm.convert_sync_batchnorm(ResNetLike())
    fresh_plain.load_state_dict(new_state)
    fresh_sync.load_state_dict(state)
    x = torch.randn(2, 3, 8, 8)
    for m in (fresh_plain, fresh_sync, converted):
        m.eval()
    assert torch.equal(fresh_plain(x), converted(x)) and torch.equal(fresh_sync(x), converted(x))


def test_convert_matches_torch_and_converts_torchs_sync_batchnorm() -> None:
    theirs = nn.SyncBatchNorm.convert_sync_batchnorm(_trained_resnet())
    ours = tandem.SyncBatchNorm.convert_sync_batchnorm(_trained_resnet())
    assert list(_bn_layers(theirs)) == list(_bn_layers(ours))
    state, their_state = ours.state_dict(), theirs.state_dict()
    assert list(state) == list(their_state) and all(torch.equal(state[k], their_state[k]) for k in state)
    again = tandem.SyncBatchNorm.convert_sync_batchnorm(theirs, process_group="group")  # type: ignore[arg-type]
    assert all(type(m) is tandem.SyncBatchNorm and m.process_group == "group"
               for m in _bn_layers(again).values())
    single = nn.BatchNorm3d(2, eps=1e-3)
    assert type(tandem.SyncBatchNorm.convert_sync_batchnorm(single)) is tandem.SyncBatchNorm
    with pytest.raises(ValueError, match=r"'0\.1\.' is a lazy batch norm"):
        tandem.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Sequential(nn.ReLU(), nn.LazyBatchNorm1d())))


def test_without_a_process_group_it_is_batchnorm() -> None:
    """No process group: exactly BatchNorm, and torch's SyncBatchNorm, in training and eval."""
    assert not dist.is_initialized()
    torch.manual_seed(0)
    ref, theirs = nn.BatchNorm2d(C, momentum=None), nn.SyncBatchNorm(C, momentum=None)
    ours = tandem.SyncBatchNorm(C, momentum=None)
    for _ in range(3):
        x = torch.randn(4, C, 3, 3) * 2 + 1
        outs = [m(x) for m in (ref, theirs, ours)]
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert all(torch.equal(ref.state_dict()[k], ours.state_dict()[k]) for k in ref.state_dict())
    for m in (ref, theirs, ours):
        m.eval()
    x = torch.randn(4, C, 3, 3)
    assert torch.equal(ref(x), ours(x)) and torch.equal(theirs(x), ours(x))
    with pytest.raises(ValueError, match="expected an \\(N, C, \\*\\) input"):
        ours(torch.randn(C))
    with pytest.raises(ValueError, match="got an input with 4 channels"):
        ours(torch.randn(2, 4))


def test_bias_false() -> None:
    layer = tandem.SyncBatchNorm(C, bias=False)
    assert layer.bias is None and layer.weight is not None
    assert list(layer.state_dict()) == ["weight", "running_mean", "running_var", "num_batches_tracked"]
