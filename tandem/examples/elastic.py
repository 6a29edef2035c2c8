"""Survive a failure: a small Trainer job that SIGKILLs one of its workers on purpose.

The run book::

    tandem run --nproc-per-node 3 --elastic --max-restarts 1 -m tandem.examples.elastic

Worker 1 kills itself in step 3, after two committed steps (``--kill-rank``,
``--kill-step``, which counts the steps committed before; ``--kill-rank -1``
kills none). The other two see the death at once, drop the step in flight and
go on at world 2; the launcher starts a replacement, which builds its model and
Trainer, asks to join, and is admitted at a step boundary with the training
state of a live worker (not from disk); the job ends at world 3. Rank 0 prints
the run's line ("trained 1 epoch(s), 11 steps, over 3 -> 2 -> 3 rank(s)" when
the launcher's spare worker, which had imported torch already, became the
replacement; 12 when it was admitted after step 7), and each worker a digest
of its parameters: the replicas are equal.

The epoch is short (120 samples, 10 steps of 4 per rank at world 3), so from
step 7 the members wait for the replacement to ask (``--hold-from 6``), which a
new interpreter importing torch takes a few seconds to do (when no spare was
ready): without that wait the epoch could end before it joins. The Trainer
writes to ``tandem-elastic/``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import tandem


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kill-rank", type=int, default=1, help="the worker that SIGKILLs itself (-1: none)")
    p.add_argument("--kill-step", type=int, default=2, help="after this many committed steps")
    p.add_argument("--hold-from", type=int, default=6,
                   help="after this many committed steps, while the world is short, wait up to 60 s for a "
                        "replacement to ask")
    p.add_argument("--output-dir", default="tandem-elastic")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    world = tandem.init()
    replacement = os.environ.get("TANDEM_ELASTIC_JOIN") == "1"  # started by the launcher after the loss
    full_world = world.world_size
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(120, 8, generator=g), torch.randn(120, 2, generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    trainer: tandem.Trainer | None = None

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        assert trainer is not None
        step = trainer.state.step
        if world.rank == args.kill_rank and not replacement and step == args.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)  # the failure this demo survives
        if step >= args.hold_from and not replacement and trainer.world_size < full_world:
            deadline = time.monotonic() + 60
            while not trainer.waiting_replacements() and time.monotonic() < deadline:
                time.sleep(0.05)
        return ((out - y) ** 2).mean()

    config = tandem.TrainerConfig(batch_size=4, epochs=1, progress=False, plot=False, log_every=1,
                                  resume=False, output_dir=args.output_dir)
    trainer = tandem.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), data, loss_fn, config=config)
    result = trainer.fit()
    if trainer.rank == 0:  # the rank now, which fit()'s changes of world may have moved
        print(result.describe(), flush=True)  # the worlds it went through
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    print(f"done world={trainer.world_size} rank={trainer.rank} params={digest.hexdigest()[:16]}", flush=True)
    tandem.shutdown()


if __name__ == "__main__":
    main()
