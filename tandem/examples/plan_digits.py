"""Factories for ``tandem plan`` on the digits example (tandem/examples/digits.py).

The run book::

    tandem plan --model tandem.examples.plan_digits:model \\
        --sample tandem.examples.plan_digits:sample --loss tandem.examples.plan_digits:loss \\
        --world-size 2 --optimizer adamw --device-memory 16GiB

The sample is one rank's batch of the example's default ``--batch-size 32``,
with random pixels: only its shapes matter to the plan.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.examples.digits import NUM_CLASSES, DigitNet

__all__ = ["loss", "model", "sample"]

BATCH_SIZE = 32  # per rank, digits.py's default


def model() -> nn.Module:
    """The digits example's model, as digits.py builds it."""
    return DigitNet()


def sample() -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's batch: images of shape (32, 1, 8, 8) and their labels."""
    gen = torch.Generator().manual_seed(0)
    return (torch.rand(BATCH_SIZE, 1, 8, 8, generator=gen),
            torch.randint(0, NUM_CLASSES, (BATCH_SIZE,), generator=gen))


def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The example's loss."""
    return nn.functional.cross_entropy(logits, labels)
