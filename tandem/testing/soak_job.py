"""The job a soak runs (``tandem run --elastic -m tandem.testing.soak_job``):
a Trainer on an MLP over an indexed dataset, under DDP, ZeRO-2 or fully_shard,
that writes what the soak checks (:mod:`tandem.testing.soak`).

Every process appends events to ``$SOAK_DIR/events-<pid>.jsonl``, one JSON line
each (a killed process may leave its last line cut; the reader skips it):

- ``batch``: the generation, step, epoch, rank and world size of a step's
  attempt, and the dataset indices it trained on this rank;
- ``commit``: a step committed (the optimizer stepped), with the time; a
  step's first forward (``forward``) is timed too;
- ``change``: a world change this process went through (its record), written
  at the next commit;
- ``done``: the step count and the world changes this process went through;
- ``start``: when this process was born (``born``, from ``/proc``) and when
  its imports were done; ``ready``: its Trainer built, about to train (for a
  replacement: about to ask to join).

It trains ``SOAK_STEPS`` steps, or, once the soak writes a step number into
``$SOAK_DIR/stop`` (atomically), up to that step: every rank reads the same.

Faults on purpose (``SOAK_KILLS``, JSON): ``[{"member": "2", "step": 5,
"phase": "forward"}, ...]``: the process of that elastic member SIGKILLs itself
at the first such point of a step at or after that one, in a world at full
size (``SOAK_WORKERS``: one loss at a time, so that the job never runs out of
members): in its forward, in its backward while the gradient reductions run
(``backward``), after the optimizer's update (``step``: before the step is
committed and its buddy copies sent), under ZeRO-2 inside the optimizer's
parameter all-gather once its own shard is updated (``gather``), inside a
checkpoint save (``save``), in the world's rebuild after a regroup
(``regroup``: the step is the one the job goes on from), or, for a replacement
(``"member": "j1"``), as soon as it is admitted (``join``). A kill with
``"after": n`` waits until n kills on purpose have happened (their ``killed``
events) and the generation has changed since the last of them: a death that
must come alone, not in the same step or rebuild as another, waits for the
others to have been seen (a count alone let a member die in the step in
which another did: ZeRO-2's parameter all-gather, where a ``gather`` kill
falls, runs on while the step commits).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

FEATURES = 32


class Indexed(Dataset):
    """Samples whose targets carry their index, so that the soak sees which were trained."""

    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(7)
        # float64: the soak compares with one process after thousands of steps, where
        # float32's rounding (sums in another order) would hide a real difference.
        self.x = torch.randn(size, FEATURES, generator=g, dtype=torch.float64)
        self.y = torch.randn(size, 2, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, tuple[torch.Tensor, int]]:
        return self.x[i], (self.y[i], i)


def make_model(hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, 2)).double()


LR = 0.01  # stable at every width the soak uses: a run that diverges compares nothing


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def loss_of(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((outputs - y) ** 2).mean()


class Events:
    """This process's event file."""

    def __init__(self, directory: Path) -> None:
        self._file = (directory / f"events-{os.getpid()}.jsonl").open("a", buffering=1)

    def write(self, event: str, /, **fields: Any) -> None:
        self._file.write(json.dumps({**fields, "e": event, "t": time.time()}) + "\n")


class Commits:
    """The Trainer's scheduler slot, stepped once per committed step: records it."""

    def __init__(self, on_commit: Any) -> None:
        self._on_commit = on_commit

    def step(self) -> None:
        self._on_commit()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def main() -> None:
    import tandem
    from tandem import Trainer, TrainerConfig

    out = Path(os.environ["SOAK_DIR"])
    strategy = os.environ.get("SOAK_STRATEGY", "ddp")
    kills = json.loads(os.environ.get("SOAK_KILLS", "[]"))
    steps = int(os.environ["SOAK_STEPS"])
    full = int(os.environ.get("SOAK_WORKERS", "1"))
    events = Events(out)
    events.write("start", born=_born())
    tandem.init()
    trainer: Trainer | None = None

    def member() -> str:
        return trainer._elastic.membership.member if trainer is not None and trainer._elastic else "?"

    def generation() -> int:
        return trainer._elastic.membership.generation.number if trainer is not None and trainer._elastic else -1

    def kills_so_far() -> list[dict[str, Any]]:
        """The ``killed`` events written so far (a line being written is left out)."""
        done = []
        for path in out.glob("events-*.jsonl"):
            for line in path.read_text().splitlines():
                if '"e": "killed"' in line:
                    with contextlib.suppress(json.JSONDecodeError):
                        done.append(json.loads(line))
        return done

    def due(phase: str, step: int) -> bool:
        """A kill of this member at this point is due (a world at full size: one loss at a time)."""
        if dist.get_world_size() < full:
            return False  # a kill waits for the world to have grown back
        mine = [k for k in kills if k["member"] == member() and k["phase"] == phase and k["step"] <= step]
        if not mine:
            return False
        if all(k.get("after", 0) == 0 for k in mine):
            return True
        done = kills_so_far()
        since = max((d.get("gen", -1) for d in done), default=-1)  # the generation of the last kill
        return any(k.get("after", 0) <= len(done) and generation() > since for k in mine)

    def kill_if(phase: str, step: int | None = None) -> None:
        if trainer is None:
            return
        step = trainer.state.step if step is None else step
        if due(phase, step):
            events.write("killed", member=member(), phase=phase, step=step, gen=generation())
            os.kill(os.getpid(), signal.SIGKILL)

    joined = os.environ.get("TANDEM_ELASTIC_JOIN") == "1"
    if joined:
        from tandem.control import group_record
        record = group_record.current()
        me = record.elastic.member if record is not None and record.elastic is not None else "?"
        if any(k["member"] == me and k["phase"] == "join" for k in kills):
            # Admitted, then gone before the state arrives: it asks to join in fit()
            # (Note [a replacement builds first] in tandem/control/elastic_group.py).
            import tandem.elastic.run as run_module
            admit = run_module.ask_to_join

            def admitted_then_gone(membership: Any, then: Any) -> Any:
                def gone(generation: Any) -> None:  # in the new group, before its rebuild
                    events.write("killed", member=me, phase="join", step=-1, gen=generation.number)
                    os.kill(os.getpid(), signal.SIGKILL)
                return admit(membership, gone)

            run_module.ask_to_join = admitted_then_gone

    def loss_fn(outputs: torch.Tensor, targets: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        y, idx = targets
        assert trainer is not None
        events.write("batch", gen=generation(), step=trainer.state.step, epoch=trainer.state.epoch,
                     rank=trainer.rank, world=trainer.world_size, idx=idx.tolist())
        return loss_of(outputs, y)

    model = make_model(int(os.environ.get("SOAK_HIDDEN", "256")))
    wrapped: nn.Module = model
    if strategy == "fsdp":
        fully_shard = tandem.fully_shard
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, min_unit_bytes=0)
        fully_shard(model)
        optimizer: torch.optim.Optimizer = make_optimizer(model.parameters())
    elif strategy == "zero2":
        wrapped = tandem.DistributedDataParallel(model, zero_stage=2)
        optimizer = tandem.ZeroOptimizer(wrapped, torch.optim.SGD, lr=LR, momentum=0.9)
        from tandem.zero.param_gather import ParamGather
        launch = ParamGather.launch

        def launch_or_die(gather: ParamGather, bucket: int) -> None:  # the shard updated, its all-gather issued
            launch(gather, bucket)
            kill_if("gather")
        # On the class: a world change gives the optimizer a new one (this process is the job's own).
        ParamGather.launch = launch_or_die  # type: ignore[method-assign, assignment]
    elif strategy == "ddp":
        optimizer = make_optimizer(model.parameters())
    else:
        raise ValueError(f"SOAK_STRATEGY must be ddp, zero2 or fsdp, got {strategy!r}")

    def on_forward(module: nn.Module, inputs: Any) -> None:
        assert trainer is not None
        events.write("forward", gen=generation(), step=trainer.state.step)
        kill_if("forward")

    def on_grad(grad: torch.Tensor) -> torch.Tensor:
        kill_if("backward")  # the first layer's gradient: the later layers' reductions are under way
        return grad

    stop = out / "stop"

    written = 0

    def stop_when_told() -> None:
        # The soak had its failures: stop at the step it names, the same on every rank.
        # (Read at each commit, and by a replacement before its first step: it is
        # admitted before the members reach that step, so it finds the file if they stop.)
        assert trainer is not None
        if stop.exists() and trainer.config.max_steps == steps:
            trainer.config = dataclasses.replace(trainer.config, max_steps=int(stop.read_text()))

    def on_commit() -> None:
        nonlocal written
        assert trainer is not None
        # The parameters' sum after the step (replicated parameters only): where a run
        # parts from one process, the soak names the step.
        total = None if strategy == "fsdp" else float(sum(p.detach().sum() for p in model.parameters()))
        events.write("commit", gen=generation(), step=trainer.state.step, sum=total)
        for change in trainer.world_changes[written:]:  # each member writes each change it saw
            events.write("change", **change.record())
        written = len(trainer.world_changes)
        kill_if("step")
        stop_when_told()

    model.register_forward_pre_hook(on_forward)
    if strategy == "fsdp":
        model[0].register_forward_hook(lambda m, i, o: (o.register_hook(on_grad), o)[1])
    else:
        first: nn.Linear = model[0]  # type: ignore[assignment]
        first.weight.register_hook(on_grad)

    config = TrainerConfig(batch_size=int(os.environ.get("SOAK_BATCH", "16")), epochs=1_000_000,
                           max_steps=steps, progress=False, plot=False,
                           log_every=50, resume=False, output_dir=out / "run",
                           checkpoint_every=int(os.environ.get("SOAK_CHECKPOINT_EVERY", "0")),
                           keep_checkpoints=1)
    trainer = Trainer(wrapped, optimizer, Indexed(int(os.environ.get("SOAK_SAMPLES", "1536"))), loss_fn,
                      scheduler=Commits(on_commit), config=config)
    elastic = trainer._elastic
    if elastic is not None:
        own_shard = elastic.own_shard

        def own_shard_or_die() -> Any:  # the first thing a rebuild does: Note [elastic trainer]
            kill_if("regroup")
            return own_shard()
        elastic.own_shard = own_shard_or_die  # type: ignore[method-assign]
    save = trainer._checkpoints.save

    def save_or_die(*args: Any, **kwargs: Any) -> Any:
        assert trainer is not None
        if due("save", trainer.state.step):
            # Killed from another thread a moment into the save, not before it starts.
            threading.Timer(0.002, kill_if, args=("save", trainer.state.step)).start()
        return save(*args, **kwargs)
    trainer._checkpoints.save = save_or_die  # type: ignore[method-assign]

    stop_when_told()
    events.write("ready")
    trainer.fit()
    trainer.export(out / "final.pt")
    local = [getattr(p, "to_local", lambda p=p: p)() for p in model.parameters()]
    digest = hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in local))
    events.write("done", member=member(), rank=trainer.rank, world=trainer.world_size, step=trainer.state.step,
                 params=digest.hexdigest()[:16], changes=[c.record() for c in trainer.world_changes])
    tandem.shutdown()


def _born() -> float:
    """When this process started, wall-clock seconds (its start in ``/proc``)."""
    stat = Path("/proc/self/stat").read_text()
    ticks = int(stat[stat.rfind(")") + 2:].split()[19])
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
