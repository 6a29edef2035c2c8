"""The int8 / int4 gradient hook (tandem/comm_hooks/quantized.py) on three gloo
ranks, in one spawned group, on tandem's DDP and on torch's.

Identities that can fail: with a loss whose gradient does not depend on the
parameters, SGD's parameters after T steps give the sum of the averaged
gradients applied; with error feedback that sum equals the true one less the
mean of the ranks' last residuals, within one step's error, while without it
the entries below half a step are lost at every step. Then training: a noisy
regression ends within 1% of DDP's loss without a hook; and the bytes."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from tandem.comm.group import CollectiveEvent
from tandem.testing import run_distributed

WORLD = 3
STEPS = 60
LR = 0.5


class _Linear(nn.Module):
    """loss = sum(w * x): the gradient is the batch, whatever w is."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))
        self.v = nn.Parameter(torch.zeros(3, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x[:, : self.w.numel()]).sum() + (self.v.view(-1) * x[:, -21:]).sum()


def _batch(step: int, rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.full((1, n + 21), 1e-3) + torch.randn(1, n + 21, generator=g) * 1e-4
    x[0, 0], x[0, 5] = 0.1, -0.1  # large entries: the rest is below half a step at int4 (0.0071)
    return x


def _sums(rank: int, world_size: int, wrapper: str, bits: int, feedback: bool) -> dict:
    import tandem
    from tandem import comm_hooks

    n = 700
    torch.manual_seed(0)
    model = _Linear(n)
    ddp = (tandem.DistributedDataParallel(model, bucket_cap_mb=0.001) if wrapper == "tandem"
           else TorchDDP(model, bucket_cap_mb=0.001))
    state = comm_hooks.QuantizedState(bits, block=64, error_feedback=feedback)
    ddp.register_comm_hook(state, comm_hooks.quantized_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    true_sum = torch.zeros(n + 21, dtype=torch.float64)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        ddp(_batch(step, rank, n)).backward()
        opt.step()
        true_sum += torch.cat([_batch(step, r, n) for r in range(world_size)]).double().mean(0)
    applied = -torch.cat([model.w.detach(), model.v.detach().view(-1)]).double() / LR
    residual = torch.zeros(n + 21)
    if feedback:
        w, v = state.residual(model.w), state.residual(model.v)
        assert w is not None and v is not None  # kept since the first step
        residual = torch.cat([w, v])
    return {"gap": applied - true_sum, "residual": residual}


def _event_bytes(e: CollectiveEvent) -> int:
    assert e.dtype is not None  # a collective of tensors
    return e.numel * e.dtype.itemsize


def _loss(rank: int, hook: str | None, steps: int = 200) -> tuple[float, list[tuple[int, float]]]:
    import tandem
    from tandem import comm_hooks

    g = torch.Generator().manual_seed(123)
    w1, w2 = torch.randn(16, 32, generator=g) / 4, torch.randn(32, 8, generator=g) / 2
    x = torch.randn(1024, 16, generator=g)
    y = torch.tanh(x @ w1) @ w2 + 0.1 * torch.randn(1024, 8, generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    ddp = tandem.DistributedDataParallel(model, bucket_cap_mb=0.01)
    if hook is not None:
        ddp.register_comm_hook(comm_hooks.QuantizedState(int(hook)), comm_hooks.quantized_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    sent = []
    on_wire: list[float] = []  # what this rank sends, by the bandwidth-optimal algorithms
    ddp.comm.observers.append(lambda e: on_wire.append(
        sent_bytes(e.op, _event_bytes(e), ddp.comm.size)) if e.tag.startswith(("hook", "bucket")) else None)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (32,), generator=g)
        opt.zero_grad(set_to_none=True)
        on_wire.clear()
        nn.functional.mse_loss(ddp(x[idx]), y[idx]).backward()
        assert ddp.comm_stats is not None
        sent.append((ddp.comm_stats.bytes, sum(on_wire)))
        opt.step()
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item(), sent


# What a rank sends for a collective of ``payload`` bytes in a group of ``size``, by the
# bandwidth-optimal algorithms (ring all-reduce: reduce-scatter then all-gather;
# pairwise all-to-all; ring all-gather of this rank's input; a broadcast's payload, on average).
_SENT = {"all_reduce": lambda w: 2 * (w - 1) / w, "all_to_all": lambda w: (w - 1) / w,
         "reduce_scatter": lambda w: (w - 1) / w, "all_gather_into": lambda w: w - 1.0, "broadcast": lambda w: 1.0}


def sent_bytes(op: str, payload: int, size: int) -> float:
    return payload * _SENT[op](size)


def _all(rank: int, world_size: int) -> dict:
    out: dict = {}
    for wrapper, bits, feedback in (("tandem", 8, True), ("tandem", 4, True), ("tandem", 4, False),
                                    ("torch", 4, True)):
        out[(wrapper, bits, feedback)] = _sums(rank, world_size, wrapper, bits, feedback)
    for hook in (None, "8", "4"):
        out[("loss", hook)] = _loss(rank, hook)
    out["numel"] = 16 * 64 + 64 + 64 * 64 + 64 + 64 * 8 + 8
    return out


@functools.cache
def _results() -> list[dict]:
    return run_distributed(_all, WORLD, timeout=240)


@pytest.mark.parametrize("wrapper,bits", [("tandem", 8), ("tandem", 4), ("torch", 4)])
def test_error_feedback_applies_every_gradient_over_the_steps(wrapper: str, bits: int) -> None:
    results = _results()
    mean_residual = torch.stack([r[(wrapper, bits, True)]["residual"] for r in results]).double().mean(0)
    # Half a step of a block holding the entry of 0.1, per rank's error plus the chunk owner's (x3).
    one_step = (0.1 / (127 if bits == 8 else 7) / 2) * (1 + WORLD)
    for r in results:
        gap = r[(wrapper, bits, True)]["gap"]
        torch.testing.assert_close(gap, -mean_residual, rtol=0, atol=1e-4)
        assert gap.abs().max() <= one_step, gap.abs().max()


def test_without_error_feedback_small_gradients_are_lost_at_every_step() -> None:
    for r in _results():
        lost, kept = r[("tandem", 4, False)]["gap"], r[("tandem", 4, True)]["gap"]
        # The entries in the large one's block of 64 (whether the bucket holds w or v first),
        # 1e-3 a step, round to zero in int4.
        assert lost[6:40].abs().min() > 0.8 * STEPS * 1e-3 > kept[6:40].abs().max()


def test_training_ends_within_1_percent_of_no_hook_with_a_quarter_of_the_bytes() -> None:
    results = _results()
    plain, plain_bytes = results[0][("loss", None)]
    for r in results:
        assert r[("loss", "8")][0] == results[0][("loss", "8")][0]  # the same model on every rank
    int8, int8_bytes = results[0][("loss", "8")]
    int4, _ = results[0][("loss", "4")]
    assert int8 <= 1.01 * plain, (int8, plain)
    assert int4 <= 1.05 * plain, (int4, plain)
    fp32 = 4 * results[0]["numel"]
    (plain_payload, plain_wire), (int8_payload, int8_wire) = plain_bytes[-1], int8_bytes[-1]
    assert fp32 <= plain_payload <= fp32 + 16  # DDP's buffers, with a flag
    # Handed to the collectives: n bytes to the all-to-all and n/3 to the all-gather, against 4n.
    assert fp32 / int8_payload >= 2.9, (fp32, int8_payload)
    # Sent: 2 (W-1)/W n against 2 (W-1)/W 4n, the scales aside.
    assert plain_wire / int8_wire >= 3.5, (plain_wire, int8_wire)
