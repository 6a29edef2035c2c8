"""One strategy vocabulary (Note [one strategy vocabulary] in
tandem/train/strategy.py): every spelling the tools take or print names one
strategy, and ``tandem check``, ``prepare`` and ``tandem plan`` make the same
fully_shard units of the same model, nested blocks included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem.testing import run_distributed
from tandem.train.strategy import Strategy


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))   # a ModuleList inside a block
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.inner:
            x = torch.tanh(layer(x))
        return self.out(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize("spelling,want", [
    ("ddp", Strategy.DDP), ("DDP", Strategy.DDP), ("zero1", Strategy.ZERO1), ("ZeRO-1", Strategy.ZERO1),
    ("ZeRO-2", Strategy.ZERO2), ("fsdp", Strategy.FULLY_SHARD), ("fully_shard", Strategy.FULLY_SHARD),
    (Strategy.ZERO2, Strategy.ZERO2)])
def test_every_spelling_names_one_strategy(spelling: str | Strategy, want: Strategy) -> None:
    assert Strategy.parse(spelling) is want
    assert Strategy.parse(want.label) is want and Strategy.parse(want.value) is want
    assert want.zero_stage == ["ddp", "zero1", "zero2", "fully_shard"].index(want.value)


def test_an_unknown_strategy_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"check: strategy='zero3' is not one of 'ddp', 'zero1', 'zero2', "
                                         r"'fully_shard', 'fsdp' \(= 'fully_shard'\)"):
        Strategy.parse("zero3", who="check")


def _units(model: nn.Module) -> list[str]:
    from tandem.fsdp import FSDPModule
    return sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule))


def _both(rank: int, world_size: int) -> dict[str, object]:
    import tandem
    from tandem.tools.check.api import _make_spec
    from tandem.tools.check.run import _wrap

    net = make_net()
    by_prepare, _ = tandem.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy="fsdp")
    spec = _make_spec(make_net, [(torch.randn(4, 4), torch.randn(4, 2))], strategies=["fsdp"], nproc=world_size,
                      steps=1, loss="mse", optimizer="sgd", lr=0.1, optimizer_kwargs=None, batch_size=None, seed=0,
                      rtol=None, atol=None)
    by_check, _ = _wrap("fsdp", make_net(), spec)
    out: dict[str, object] = {"prepare": _units(by_prepare), "check": _units(by_check)}
    for name in ("ddp", "zero1", "zero2"):  # the same wrapper and optimizer by both ways
        net = make_net()
        model, opt = tandem.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=name)
        checked, checked_opt = _wrap(name, make_net(), spec)
        out[name] = [(type(m).__name__, int(getattr(m, "zero_stage", 0)), type(o).__name__)
                     for m, o in ((model, opt), (checked, checked_opt))]
    return out


def test_check_prepare_and_plan_make_the_same_fully_shard_units() -> None:
    from tandem.tools.plan import default_fsdp_units

    for got in run_distributed(_both, 2, timeout=120):
        # Innermost first: each Linear of a block's ModuleList, then the block, then the root.
        want = sorted(["", "layers.0", "layers.1", "layers.0.inner.0", "layers.0.inner.1", "layers.1.inner.0",
                       "layers.1.inner.1"])
        assert got["prepare"] == got["check"] == want, got
        assert got["ddp"] == [("DistributedDataParallel", 0, "SGD")] * 2, got
        assert got["zero1"] == [("DistributedDataParallel", 1, "ZeroOptimizer")] * 2, got
        assert got["zero2"] == [("DistributedDataParallel", 2, "ZeroOptimizer")] * 2, got
    planned = default_fsdp_units(make_net())
    assert sorted(["", *planned]) == want
    assert planned.index("layers.0.inner.0") < planned.index("layers.0")   # a nested unit comes first
