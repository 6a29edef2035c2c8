"""The quantized average (Note [a quantized average] in
tandem/quantized/average.py) on three gloo ranks, in one spawned group:
within its bound of the true mean and the same on every rank; with error
feedback, the sum over 300 calls equal to the sum of the true means less the
mean of the last residuals, and within one call's bound, where without it the
error grows with the calls; and the bytes handed to the collectives."""

from __future__ import annotations

import functools

import pytest
import torch

from tandem.testing import run_distributed

WORLD = 3
CALLS = 300


def _half_steps(x: torch.Tensor, bits: int, block: int, chunks: int = WORLD) -> torch.Tensor:
    """Half a quantization step per element, from the definition (absmax / qmax / 2 per block),
    the blocks starting afresh at each of the ``chunks`` chunks the average splits ``x`` into."""
    top = 127 if bits == 8 else 7
    chunk = -(-x.numel() // chunks)
    out = []
    for part in torch.cat([x, x.new_zeros(chunks * chunk - x.numel())]).split(chunk):
        padded = torch.cat([part, part.new_zeros((-chunk) % block)]).view(-1, block)
        out.append((padded.abs().amax(dim=1) / top / 2).repeat_interleave(block)[:chunk])
    return torch.cat(out)[: x.numel()]


def _cases(rank: int, world_size: int) -> dict:
    import tandem
    from tandem.comm.group import GroupComm
    from tandem.quantized.average import QuantizedAverage

    comm = GroupComm(None)
    out: dict = {}
    for bits in (8, 4):
        for n, block in ((1000, 64), (5, 2), (3 * 256, 256)):
            g = torch.Generator().manual_seed(1000 * bits + n)
            xs = [torch.randn(n, generator=g) * torch.logspace(-3, 2, n) for _ in range(world_size)]
            x = xs[rank].clone()
            ledger = tandem.comm.monitor.current_monitor().ledger
            before = ledger.bytes_issued
            QuantizedAverage(comm, bits, block).average_(x, tag="test")
            sent = ledger.bytes_issued - before
            mean = torch.stack(xs).mean(0)
            # First quantization: each rank's error, averaged; the second: half a step of the
            # average, whose magnitude is at most |mean| plus that first error.
            first = torch.stack([_half_steps(v, bits, block) for v in xs]).mean(0)
            bound = first + _half_steps(mean.abs() + first, bits, block)
            out[(bits, n, block)] = {"x": x, "ok": bool(((x - mean).abs() <= bound * 1.0001 + 1e-7).all()),
                                     "worst": float(((x - mean).abs() / bound.clamp_min(1e-30)).max()),
                                     "sent": sent}
        # Error feedback: a large entry and a small steady one the quantization rounds to zero.
        n, block = 512, 256
        average = QuantizedAverage(comm, bits, block)
        for feedback in (True, False):
            residual = torch.zeros(n) if feedback else None
            total, true_total = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
            g = torch.Generator().manual_seed(7)
            for _ in range(CALLS):
                grads = [torch.full((n,), 1e-3) + torch.randn(n, generator=g) * 1e-4 for _ in range(world_size)]
                for v in grads:
                    v[0], v[300] = 1.0, -1.0  # one large entry in each block
                x = grads[rank].clone()
                average.average_(x, residual, tag="feedback")
                total += x.double()
                true_total += torch.stack(grads).double().mean(0)
            residuals = comm.all_gather(residual if residual is not None else torch.zeros(n))
            out[(bits, "feedback", feedback)] = {
                "gap": total - true_total, "mean_residual": torch.stack(residuals).double().mean(0),
                "one_call": _half_steps(torch.full((n,), 1.0), bits, block, 1).double() * (1 + world_size)}
    return out


@functools.cache
def _results() -> list[dict]:
    return run_distributed(_cases, WORLD, timeout=180)


# ---------------------------------------------------------------------- by node

def _by_node(rank: int, world_size: int) -> dict:
    """Four ranks as two nodes of two (GROUP_RANK, as the launcher sets it)."""
    import os

    from tandem.comm.group import GroupComm
    from tandem.comm.monitor import current_monitor
    from tandem.comm.node_groups import NodeGroups
    from tandem.quantized.average import QuantizedAverage

    os.environ["GROUP_RANK"] = str(rank // 2)
    comm = GroupComm(None)
    nodes = NodeGroups.build(comm)
    assert nodes is not None
    out: dict = {"local": nodes.local.members, "cross": nodes.cross.members}
    n, block, bits = 1000, 64, 8
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, generator=g) * torch.logspace(-3, 2, n) for _ in range(world_size)]
    ledger = current_monitor().ledger
    entries = len(ledger.entries())
    x = xs[rank].clone()
    QuantizedAverage(comm, bits, block, nodes).average_(x, tag="by node")
    out["x"], out["mean"] = x, torch.stack(xs).mean(0)
    out["ops"] = [(e.op, e.group, e.nbytes) for e in ledger.entries()[entries:]]
    # Error feedback, as in the flat case: the sum of 300 results against the sum of the true means.
    average, residual = QuantizedAverage(comm, 4, 256, nodes), torch.zeros(512)
    total, true_total = torch.zeros(512, dtype=torch.float64), torch.zeros(512, dtype=torch.float64)
    for _ in range(CALLS):
        grads = [torch.full((512,), 1e-3) + torch.randn(512, generator=g) * 1e-4 for _ in range(world_size)]
        for v in grads:
            v[0], v[300] = 1.0, -1.0
        x = grads[rank].clone()
        average.average_(x, residual, tag="feedback")
        total += x.double()
        true_total += torch.stack(grads).double().mean(0)
    out["gap"], out["residuals"] = total - true_total, comm.all_gather(residual)
    return out


@functools.cache
def _by_node_results() -> list[dict]:
    return run_distributed(_by_node, 4, timeout=180)


def test_by_node_the_groups_are_each_node_and_each_position_across_nodes() -> None:
    from tandem.comm.node_groups import plan_node_groups

    assert [(r["local"], r["cross"]) for r in _by_node_results()] == [
        ([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]), ([2, 3], [1, 3])]
    assert plan_node_groups(["b", "a", "b", "a"]) == ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
    assert plan_node_groups(["a", "a"]) is None  # one node
    assert plan_node_groups(["a", "b", "c"]) is None  # one rank a node
    assert plan_node_groups(["a", "a", "b"]) is None  # nodes of different sizes


def test_by_node_only_a_ranks_share_crosses_nodes_and_the_average_holds() -> None:
    results = _by_node_results()
    for r in results:
        assert torch.equal(r["x"], results[0]["x"])
        # fp32 inside the node, a bound of int8 across: well within 1% of the largest value.
        assert (r["x"] - r["mean"]).abs().max() <= r["mean"].abs().max() / 127, (r["x"] - r["mean"]).abs().max()
        ops = r["ops"]
        # Inside the node: the fp32 sum and gather; across: int8 of this rank's 500 values.
        assert [op for op, _, _ in ops] == ["reduce_scatter", "all_to_all", "all_gather_into", "all_gather_into"]
        assert ops[0][2] == 4 * 1000 and ops[3][2] == 4 * 500
        assert ops[1][2] == 2 * (250 + 4 * 4) and ops[2][2] == 250 + 4 * 4  # 250 values a rank, blocks of 64


def test_by_node_error_feedback_loses_nothing() -> None:
    results = _by_node_results()
    mean_residual = torch.stack(results[0]["residuals"]).double().mean(0)  # every rank's, from all ranks
    for r in results:
        torch.testing.assert_close(r["gap"], -mean_residual, rtol=0, atol=1e-4)
        # One call's error: half a step of int4 of a block holding 1.0, (1 + 2 nodes) times, as flat.
        assert r["gap"].abs().max() <= (1.0 / 7 / 2) * 3


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,block", [(1000, 64), (5, 2), (3 * 256, 256)])
def test_the_average_is_within_its_bound_and_the_same_on_every_rank(bits: int, n: int, block: int) -> None:
    results = [r[(bits, n, block)] for r in _results()]
    for r in results:
        assert r["ok"], r["worst"]
        assert torch.equal(r["x"], results[0]["x"])


@pytest.mark.parametrize("bits", [8, 4])
def test_error_feedback_loses_nothing_over_calls(bits: int) -> None:
    for r in _results():
        fed, lost = r[(bits, "feedback", True)], r[(bits, "feedback", False)]
        # The sum of what was applied is the sum of the true averages, less the mean of the last
        # residuals (exactly, up to float rounding over 300 sums) ...
        torch.testing.assert_close(fed["gap"], -fed["mean_residual"], rtol=0, atol=1e-4)
        # ... which one call's error bounds, however many calls were made ...
        assert (fed["gap"].abs() <= fed["one_call"]).all(), fed["gap"].abs().max()
        # ... while without feedback the small entries are lost at every call: 300 x 1e-3 each.
        assert lost["gap"][1:300].abs().min() > 0.5 * CALLS * 1e-3 > fed["gap"].abs().max()


def test_the_payload_is_a_quarter_of_fp32s_at_int8_and_an_eighth_at_int4() -> None:
    for r in _results():
        n = 3 * 256
        # Values and a 4-byte scale a block, once to the all-to-all and a rank's chunk to the all-gather.
        assert r[(8, n, 256)]["sent"] == (n + 3 * 4) + (256 + 4)
        assert r[(4, n, 256)]["sent"] == (n // 2 + 3 * 4) + (128 + 4)
