"""``tandem plan --activation-checkpointing`` (Note [checkpointed activations]
in tandem/tools/activations.py): the activations it predicts with and without
checkpointing every block, against the peak bytes one process really holds in
a forward and backward (the profiler's allocation events, less the parameters'
gradients, which backward allocates and keeps), with torch's
``checkpoint_wrapper`` on each block; each block's share; the command line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from tandem.testing.memory import PeakMemory
from tandem.testing.models import GPT
from tandem.tools.activations import BlockActivations, checkpointed_bytes
from tandem.tools.plan import main, measure, plan

VOCAB, DIM, DEPTH = 64, 64, 4
BLOCKS = [f"blocks.{i}" for i in range(DEPTH)]


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, DIM, DEPTH)


def sample(batch: int = 8, seq: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (batch, seq), generator=g), torch.randint(0, VOCAB, (batch, seq), generator=g)


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _measured_peak(checkpointed: bool, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """The most bytes one forward and backward hold beyond the model, less the
    parameters' gradients (kept after backward, not activations)."""
    net = model()
    if checkpointed:
        for i, block in enumerate(net.blocks):
            net.blocks[i] = checkpoint_wrapper(block)
    grads = sum(p.numel() * p.element_size() for p in net.parameters())
    loss(net(batch[0]), batch[1]).backward()  # warm up: lazily built state is not the step's
    net.zero_grad(set_to_none=True)
    with PeakMemory() as mem:
        loss(net(batch[0]), batch[1]).backward()
    assert mem.end == grads  # everything else was freed: the accounting is closed
    return mem.peak - grads


@pytest.mark.parametrize("shape", [(8, 64), (4, 128)])
def test_predicted_activations_are_close_to_the_measured_peak(shape: tuple[int, int]) -> None:
    batch = sample(*shape)
    m = measure(model(), batch, loss_fn=loss, blocks=BLOCKS)
    without, with_ = _measured_peak(False, batch), _measured_peak(True, batch)
    # Within 15% both ways; the measured peak adds the gradients in flight.
    assert 0.85 * without <= m.activation_bytes <= 1.15 * without, (m.activation_bytes, without)
    assert 0.85 * with_ <= m.checkpointed_bytes <= 1.15 * with_, (m.checkpointed_bytes, with_)
    # The saving is real and predicted: checkpointing holds a third or less here.
    assert with_ < without / 2 and m.checkpointed_bytes < m.activation_bytes / 2


def test_each_block_is_measured_and_the_rest_is_outside() -> None:
    m = measure(model(), sample(), loss_fn=loss, blocks=BLOCKS)
    assert [b.name for b in m.blocks] == BLOCKS
    assert len({(b.saved, b.inputs) for b in m.blocks}) == 1  # identical blocks, identical shares
    block = m.blocks[0]
    assert block.inputs == 8 * 64 * DIM * 4  # the residual stream, float32
    assert 0 < block.inputs < block.saved < m.activation_bytes / DEPTH
    outside = m.activation_bytes - DEPTH * block.saved
    assert m.checkpointed_bytes == outside + DEPTH * block.inputs + block.saved - block.inputs
    # No blocks: nothing to checkpoint, the activations as they are.
    assert measure(model(), sample(), loss_fn=loss).blocks == ()
    assert checkpointed_bytes(123, ()) == 123
    assert BlockActivations("b", saved=10, inputs=20).recomputed == 0


def test_plan_uses_the_checkpointed_activations() -> None:
    batch = sample()
    plain = plan(model(), world_size=2, sample=batch, loss_fn=loss)
    ckpt = plan(model(), world_size=2, sample=batch, loss_fn=loss, activation_checkpointing=True)
    assert ckpt.measurement is not None and [b.name for b in ckpt.measurement.blocks] == BLOCKS
    for a, b in zip(plain.strategies, ckpt.strategies):
        assert b.activations == ckpt.measurement.checkpointed_bytes < a.activations
        assert b.peak < a.peak
    chosen = plan(model(), world_size=2, sample=batch, loss_fn=loss, activation_checkpointing=True,
                  fsdp_units=["blocks.1"])
    assert chosen.measurement is not None and [b.name for b in chosen.measurement.blocks] == ["blocks.1"]
    with pytest.raises(ValueError, match="no module named 'blocks.9'"):
        plan(model(), world_size=2, sample=batch, activation_checkpointing=True, fsdp_units=["blocks.9"])


def test_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "test_plan_activations:model", "--sample", "test_plan_activations:sample",
            "--loss", "test_plan_activations:loss", "--world-size", "2"]
    assert main([*argv, "--activation-checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "with activation checkpointing of 4 block(s)" in out and "(used below)" in out
    assert "blocks.3" in out
    assert main(argv) == 0
    assert "activation checkpointing" not in capsys.readouterr().out
    assert main(argv[:2] + ["--world-size", "2", "--activation-checkpointing"]) == 2
    assert "needs a measurement of the blocks" in capsys.readouterr().err


def test_an_unwrapped_block_list_of_no_modules_is_refused() -> None:
    with pytest.raises(ValueError, match="no module named 'nope'"):
        measure(nn.Linear(2, 2), torch.randn(3, 2), blocks=["nope"])
