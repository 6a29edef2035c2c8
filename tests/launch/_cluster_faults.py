"""A Trainer job for the namespace cluster's fault tests
(tests/launch/test_cluster_faults.py): one epoch over N indexed samples, each rank
writing the indices it trains at each step to OUT/samples-<node>-<pid>.jsonl
and, at the end, its parameters and the world changes to
OUT/done-<node>-<pid>.pt. :func:`reference` trains one process on the same
global batches for a schedule of world sizes.

Environment: OUT (where to write), DIE_AT ("node:local:step": that worker
SIGKILLs itself in that step's backward, in the first attempt only), ELASTIC ("1": the
Trainer trains elastically, with a liveness window of 2 s), HOLD_FOR_JOIN
(a step: from there, while the world is below 4, each step waits up to 60 s
for a replacement to ask, so that every one joins before the epoch ends, on
a loaded host too),
HANG_AT ("node:local:step": that worker sleeps for good in that step's loss),
PAUSE_AT (a step: every rank reaching it in its first pass writes
OUT/paused-<node>-<pid> and waits in its loss until OUT/resume exists, so
that a test acts on a job that has not finished, at a point it knows).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

from tandem.testing.indexed import IndexedSamples

N, FEATURES, BATCH = 192, 8, 4


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 2))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def global_batches(schedule: list[int]) -> list[list[int]]:
    """The sample indices of each step's global batch, for a schedule of world
    sizes: a contiguous chunk of the epoch's order, world x BATCH long; the
    sampler pads the rest of the epoch to a multiple of the world size with
    samples from the start of the order (Note in tandem/data/sampler.py), so
    the last chunk may be shorter and carry repeats."""
    from tandem.data.sampler import _epoch_order

    order = _epoch_order(N, shuffle=True, seed=0, epoch=0)
    batches, consumed = [], 0
    for world in schedule:
        rest = order[consumed:]
        rest += order[:(-len(rest)) % world]
        batches.append(rest[:world * BATCH])
        consumed += world * BATCH
    assert consumed >= N > consumed - schedule[-1] * BATCH, (consumed, schedule)
    return batches


def reference(schedule: list[int]) -> list[torch.Tensor]:
    """One process on the global batches of ``schedule`` (world size per step)."""
    data = IndexedSamples(N, FEATURES)
    model = make_model()
    opt = make_optimizer(model)
    for idx in global_batches(schedule):
        loss = ((model(data.x[idx]) - data.y[idx]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def main() -> None:
    import tandem
    from tandem import Trainer, TrainerConfig
    from tandem.control.generation import ElasticConfig

    out = Path(os.environ["OUT"])
    node, local = os.environ["GROUP_RANK"], os.environ["LOCAL_RANK"]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    joining = os.environ.get("TANDEM_ELASTIC_JOIN") == "1"
    tandem.init()
    log = out / f"samples-{node}-{os.getpid()}.jsonl"
    trainer: Trainer | None = None

    def loss_fn(outputs: torch.Tensor, targets: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        y, idx = targets
        assert trainer is not None
        hold = os.environ.get("HOLD_FOR_JOIN")
        if hold is not None and trainer.state.step >= int(hold) and not joining and trainer.world_size < 4:
            membership = trainer._elastic.membership  # type: ignore[union-attr]
            deadline = time.monotonic() + 60
            while not membership.waiting_joiners() and time.monotonic() < deadline:
                time.sleep(0.05)
        pause = os.environ.get("PAUSE_AT")
        if pause is not None and trainer.state.step == int(pause) and not (out / "resume").exists():
            (out / f"paused-{node}-{os.getpid()}").touch()
            deadline = time.monotonic() + 120
            while not (out / "resume").exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {trainer.rank} paused at step {pause} for 120 s: OUT/resume never came")
                time.sleep(0.05)
        if os.environ.get("HANG_AT") == f"{node}:{local}:{trainer.state.step}":
            time.sleep(3600)
        with log.open("a") as f:
            f.write(json.dumps({"step": trainer.state.step, "idx": idx.tolist(), "attempt": attempt}) + "\n")
        return ((outputs - y) ** 2).mean()

    model = make_model()
    die = os.environ.get("DIE_AT")
    if die and attempt == 0 and not joining:
        die_node, die_local, die_step = die.split(":")
        if (die_node, die_local) == (node, local):
            def kill(grad: torch.Tensor) -> torch.Tensor:
                assert trainer is not None
                if trainer.state.step == int(die_step):
                    os.kill(os.getpid(), signal.SIGKILL)
                return grad
            first = model[0]
            assert isinstance(first, nn.Linear)
            first.weight.register_hook(kill)
    optimizer = make_optimizer(model)
    elastic = ElasticConfig(beat_s=0.1, stale_after_s=2.0) if os.environ.get("ELASTIC") == "1" else None
    trainer = Trainer(model, optimizer, IndexedSamples(N, FEATURES), loss_fn,
                      config=TrainerConfig(batch_size=BATCH, epochs=1, elastic=elastic, progress=False,
                                           plot=False, log_every=1, output_dir=out / "run",
                                           checkpoint_every=4, keep_checkpoints=2))
    result = trainer.fit()
    torch.save({"params": [p.detach().clone() for p in model.parameters()],
                "changes": [c.record() for c in trainer.world_changes], "steps": result.steps,
                "world_size": trainer.world_size, "rank": trainer.rank, "attempt": attempt},
               out / f"done-{node}-{os.getpid()}.pt")
    print(f"DONE rank={trainer.rank} world={trainer.world_size} node={node} attempt={attempt}", flush=True)
    tandem.shutdown()


if __name__ == "__main__":
    main()
