"""Elastic training (Note [elastic trainer]): a rank SIGKILLed inside backward,
the survivors go on without restarting, a replacement joins and gets the state
from a live peer; under DDP, ZeRO-2 and fully_shard (the sharded ones through
buddy copies: Notes [buddy copies] and [elastic fully_shard]).

Each scenario is one spawned world of 3 ranks on gloo, with the harness's
timeout and an orphan check. The scenarios mostly wait (for a 1 s staleness
window, for a replacement to start), so a module fixture runs them three at a
time, each in a directory of its own; each test checks its own scenario. The survivors' parameters are compared with a
reference computed here, in one process, from the epoch's order alone: step i
of a world of W ranks with batch B trains on positions [c, c + W*B) of the
order, c being what earlier steps consumed. The world size of each step comes
from the test's own schedule for losses; for a join, from when the Trainer says
it admitted the replacement (a wrong report gives different parameters).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NoReturn
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tandem.control.generation import ElasticConfig
from tandem.testing import as_dtensor, run_distributed, start_concurrently
from tandem.testing.harness import RankFailure, still_running
from tandem.testing.indexed import IndexedSamples
from tandem.testing.replay import world_sizes

N, BATCH, FEATURES = 48, 2, 6
TIMEOUT = 120.0
CONFIG = ElasticConfig(beat_s=0.05, stale_after_s=1.0, regroup_timeout_s=30.0, connect_timeout_s=10.0)


def indexed() -> IndexedSamples:
    """The scenarios' N samples, each carrying its index in the target."""
    return IndexedSamples(N, FEATURES)


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 2))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


ADAM: dict[str, Any] = {"lr": 0.01}  # ZeRO runs: Adam, whose moments are what a lost shard would take away
LOCAL_LR = 0.1  # local steps (LocalSGD): plain SGD, so that the reference is plain too


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """The sharded runs' schedule: a replacement must start at the current learning rate."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)


def _die_once_admitted(when: str = "admitted") -> None:
    """Make this replacement die once a generation admits it (it asks to join in
    fit() or prepare(): Note [a replacement builds first] in
    tandem/control/elastic_group.py): ``"admitted"``, in the new group, before the
    state arrives; ``"connecting"``, before it marks itself arrived to build
    the group (Note [arrivals] in tandem/control/elastic_group.py); ``"arrived"``,
    after it marked itself arrived, before it connects."""
    if when in ("connecting", "arrived"):
        import tandem.control.elastic_group as group_module
        from tandem.control.membership import Membership
        arrive = group_module.await_members

        def gone(membership: Membership, generation: Any, what: str = "group", building: Any = None,
                 **kwargs: Any) -> None:
            if when == "arrived":
                arrive(membership, generation, what, building, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        group_module.await_members = gone
        return
    import tandem.elastic.run as run_module
    admit = run_module.ask_to_join

    def admitted_then_gone(membership: Any, then: Any) -> Any:
        return admit(membership, lambda generation: os.kill(os.getpid(), signal.SIGKILL))  # before its rebuild

    run_module.ask_to_join = admitted_then_gone


def _killed(*args: Any, **kwargs: Any) -> NoReturn:
    """SIGKILL this process, in place of whatever it was about to call."""
    os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("SIGKILL did not end this process")


def die_before_sending_copy(step: int) -> None:
    """Make this rank die as it would send its buddy copy of ``step`` (Note [one step
    back] in tandem/elastic/buddy.py), after it took the previous rank's: that rank
    goes on, and sees the loss later (after its scheduler stepped)."""
    from tandem.comm.p2p import recv
    from tandem.elastic.buddy import BuddyCopies
    send = BuddyCopies.refresh

    def die(self: BuddyCopies, shard: dict[str, Any], at: int, members: tuple[str, ...], me: int) -> None:
        if at == step:
            recv((me - 1) % len(members))
            os.kill(os.getpid(), signal.SIGKILL)
        send(self, shard, at, members, me)
    mock.patch.object(BuddyCopies, "refresh", die).start()  # for the rest of this process


def join_or_found(rank: int, world_size: int, out: str, join_dies: str | None = None) -> bool:
    """Start this process's part of the job: a founding rank of ``world_size``,
    or a replacement (``TANDEM_ELASTIC_JOIN=1``), which asks to join once the
    members have shrunk (they then hold a step until the request is there, so
    that it joins through a step's decision) and, with ``join_dies``, dies once
    admitted (:func:`_die_once_admitted`). Returns whether it is a replacement."""
    import tandem

    joining = os.environ.get("TANDEM_ELASTIC_JOIN") == "1"
    url = f"file://{os.environ['TANDEM_TEST_STORE']}"
    if joining:
        ready = Path(out) / "shrunk"
        while not ready.exists():
            time.sleep(0.02)
        tandem.init("gloo", init_method=url)
        if join_dies:
            _die_once_admitted(join_dies)
    else:
        tandem.init("gloo", init_method=url, rank=rank, world_size=world_size)
    return joining


def _rank(rank: int, world_size: int, out: str, deaths: dict[int, int], join_dies: str | None,
          join_at: int | None, zero: bool = False, checkpoint_every: int = 0, fsdp: bool = False,
          admitting_dies: int | None = None, group_dies: int | None = None, in_refresh: bool = False,
          save_dies: int | None = None, miscounts: int | None = None, leaves_at: int | None = None,
          local_steps: int | None = None, ends_apart_at: int | None = None, hook: str | None = None,
          admitting_dies_at: str = "share", other_model: bool = False) -> dict:
    """One rank: train one epoch elastically (with ``zero``: ZeRO-2 and Adam; with
    ``fsdp``: fully_shard and Adam; with ``local_steps``: LocalSGD syncing every
    that many steps, plain SGD); ``deaths`` maps a founding rank to
    the step in whose backward it kills itself. With ``join_at``, the members
    hold step ``join_at`` until a replacement asks to join, so that it joins
    before the (short) epoch ends; founding rank ``admitting_dies`` kills itself
    as the state is sent to the replacement (its shards have arrived), or, with
    ``admitting_dies_at="copy"``, in the copies that end the first loss's change,
    once it has sent its copy of its new shard and before it receives one (Note
    [a change cut short after its shards moved]), or, with ``"first-copy"``, in
    the first copies after a replacement joined, once it received one and before
    it sends its own (Note [a grow's copies ride on its first step]), and
    ``group_dies`` as fully_shard builds its reduce-scatter group in a smaller
    world (at the first forward after a loss). With ``other_model``, a replacement
    builds a wider model than the members'."""
    from tandem import Trainer, TrainerConfig

    joining = join_or_found(rank, world_size, out, join_dies)
    if rank == group_dies and not joining:
        import tandem.fsdp.schedule as schedule
        build = schedule.new_world_group

        def die_in_a_smaller_world(what: str) -> Any:
            if dist.get_world_size() < world_size:
                os.kill(os.getpid(), signal.SIGKILL)
            return build(what)

        schedule.new_world_group = die_in_a_smaller_world
    if rank == admitting_dies and not joining and admitting_dies_at == "share":
        from tandem.elastic.world import ElasticWorld
        ElasticWorld.share_state = lambda self, wanting: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[method-assign]
    if rank == admitting_dies and not joining and admitting_dies_at in ("copy", "first-copy"):
        from tandem.comm.p2p import isend, recv
        from tandem.elastic.buddy import BuddyCopies
        copy_then = BuddyCopies.refresh

        def die_in_the_copies(self: BuddyCopies, shard: dict[str, Any], at: int, members: tuple[str, ...],
                              me: int) -> None:
            if admitting_dies_at == "copy" and len(members) == world_size - 1:  # a loss's copies
                isend({"step": at, "shard": shard}, (me + 1) % len(members)).wait()
                os.kill(os.getpid(), signal.SIGKILL)
            if admitting_dies_at == "first-copy" and any(m.startswith("j") for m in members):
                recv((me - 1) % len(members))  # a grow's first copies, after its first step
                os.kill(os.getpid(), signal.SIGKILL)
            copy_then(self, shard, at, members, me)
        mock.patch.object(BuddyCopies, "refresh", die_in_the_copies).start()
    if in_refresh and rank in deaths and not joining:
        die_before_sending_copy(deaths[rank])
    if rank == miscounts and not joining:  # as a failed attempt to build a group on this rank only would
        import tandem.control.elastic_group as group_module
        from tandem.control.membership import Membership
        arrive = group_module.await_members

        def miscount(membership: Membership, generation: Any, what: str = "group", building: Any = None,
                     **kwargs: Any) -> None:
            from torch.distributed import distributed_c10d as c10d
            c10d._world.group_count += 1
            arrive(membership, generation, what, building, **kwargs)
        group_module.await_members = miscount
    if leaves_at is not None and rank == 2 and not joining:
        # Rank 2 leaves for a regroup, alive, as it would send its copy of step leaves_at:
        # rank 0 waits for that copy (Note [a peer gone to regroup] in tandem/comm/peers.py).
        from tandem.comm.peers import PeerLostError
        from tandem.elastic.buddy import BuddyCopies
        send_copy = BuddyCopies.refresh
        left: list[bool] = []

        def leave(self: BuddyCopies, shard: dict[str, Any], at: int, members: tuple[str, ...], me: int) -> None:
            if at == leaves_at and not left:
                left.append(True)
                raise PeerLostError(me, {}, "a test: rank 2 leaves for a regroup")
            send_copy(self, shard, at, members, me)
        mock.patch.object(BuddyCopies, "refresh", leave).start()
    if ends_apart_at is not None and rank == 2 and not joining:
        # Rank 2 leaves for a regroup, alive, as it would send its copy of the epoch's last
        # step (the Trainer's buddy refresh): the others, logging nothing there, end the epoch and see it
        # in the save.
        from tandem.comm.peers import PeerLostError
        refresh = Trainer._refresh_buddy
        apart: list[bool] = []

        def leave_at_the_end(self: Trainer) -> None:
            if self.state.step == ends_apart_at and not apart:
                apart.append(True)
                raise PeerLostError(2, {}, "a test: rank 2 leaves for a regroup at the epoch's end")
            refresh(self)
        Trainer._refresh_buddy = leave_at_the_end  # type: ignore[method-assign]
    if rank == save_dies and not joining and fsdp:  # inside dcp.save, between its plan's collectives and its last
        from torch.distributed.checkpoint import FileSystemWriter
        FileSystemWriter.write_data = _killed  # type: ignore[method-assign]
    if rank == save_dies and not joining and not fsdp:  # inside a whole-file save, before its collective
        import tandem.train.run_checkpoints as run_checkpoints
        run_checkpoints.save_checkpoint = _killed
    from tandem.elastic.buddy import BuddyCopies
    locate, located = BuddyCopies.locate, []

    def counted_locate(*args: Any, **kwargs: Any) -> Any:
        located.append(True)
        return locate(*args, **kwargs)
    BuddyCopies.locate = counted_locate  # type: ignore[method-assign]
    copy_of, copies = BuddyCopies.refresh, []

    def counted_refresh(*args: Any, **kwargs: Any) -> Any:
        copies.append(True)
        return copy_of(*args, **kwargs)
    BuddyCopies.refresh = counted_refresh  # type: ignore[method-assign]
    agree, places = Trainer._agree_on_the_place, []

    def counted_agree(*args: Any, **kwargs: Any) -> Any:
        places.append(True)
        return agree(*args, **kwargs)
    Trainer._agree_on_the_place = counted_agree  # type: ignore[method-assign]
    member = "j" if joining else str(rank)
    log = Path(out) / f"samples-{member}-{os.getpid()}.jsonl"
    trainer: Trainer | None = None

    def loss_fn(outputs: torch.Tensor, targets: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        y, idx = targets
        assert trainer is not None
        if join_at is not None and trainer.state.step == join_at and not joining:
            (Path(out) / "shrunk").touch()
            membership = trainer._elastic.membership  # type: ignore[union-attr]
            deadline = time.monotonic() + 60
            while not membership.waiting_joiners() and time.monotonic() < deadline:
                time.sleep(0.05)
        with log.open("a") as f:
            f.write(json.dumps({"step": trainer.state.step, "idx": idx.tolist()}) + "\n")
        return ((outputs - y) ** 2).mean()

    model = make_model()
    if other_model and joining:
        model = nn.Sequential(nn.Linear(FEATURES, 17), nn.Tanh(), nn.Linear(17, 2))
    if fsdp:  # a unit per Linear and a root without parameters: Note [elastic fully_shard]
        from tandem import fully_shard
        fully_shard(model[0], min_unit_bytes=0)
        fully_shard(model[2], min_unit_bytes=0)
        fully_shard(model)
    if not joining and rank in deaths and not in_refresh:
        def die(grad: torch.Tensor) -> torch.Tensor:
            assert trainer is not None
            if trainer.state.step == deaths[rank]:
                os.kill(os.getpid(), signal.SIGKILL)
            return grad
        if fsdp:  # after the last unit's backward, before the first's
            model[0].register_forward_hook(lambda m, i, out: (out.register_hook(die), out)[1])
        else:
            model.get_parameter("0.weight").register_hook(die)
    wrapped: nn.Module = model
    if fsdp:
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), **ADAM)
    elif zero:  # ZeRO-2 over small buckets: every rank owns a part of every bucket's state
        from tandem import DistributedDataParallel, ZeroOptimizer
        wrapped = DistributedDataParallel(model, zero_stage=2, bucket_cap_mb=0.0001)
        optimizer = ZeroOptimizer(wrapped, torch.optim.Adam, **ADAM)
    elif local_steps is not None:
        optimizer = torch.optim.SGD(model.parameters(), lr=LOCAL_LR)
    else:
        optimizer = make_optimizer(model)
    hook_state: Any = None
    if hook is not None:  # registered in a replacement's world of one too: it must follow it into the job's
        from tandem import DistributedDataParallel, comm_hooks
        wrapped = DistributedDataParallel(model, bucket_cap_mb=0.0001)
        if hook == "powersgd":  # lossless: rank as large as each gradient (Note [powersgd in a new world])
            hook_state = comm_hooks.PowerSGDState(comm_hooks.PowerSGDConfig(
                matrix_rank=16, start_iter=1, min_compression_rate=1e-3))
            wrapped.register_comm_hook(hook_state, comm_hooks.powersgd_hook)
        else:
            hook_state = comm_hooks.QuantizedState(8, block=16)
            wrapped.register_comm_hook(hook_state, counted_quantized_hook)
    diloco = None
    if local_steps is not None:
        from tandem import DiLoCoConfig
        diloco = DiLoCoConfig.local_sgd(local_steps)
    two = ends_apart_at is not None  # two epochs, and no logging collective at the first one's end
    trainer = Trainer(wrapped, optimizer, indexed(), loss_fn,
                      scheduler=make_scheduler(optimizer) if zero or fsdp else None,
                      config=TrainerConfig(batch_size=BATCH, epochs=2 if two else 1, elastic=CONFIG, progress=False,
                                           plot=False, log_every=100 if two else 1, output_dir=Path(out) / "run",
                                           resume=False, ddp_options={"bucket_cap_mb": 0.0001},
                                           checkpoint_every=checkpoint_every, diloco=diloco))
    result = trainer.fit()
    params = [as_dtensor(p).full_tensor() if fsdp else p for p in model.parameters()]  # fully_shard: a collective
    return {"params": [p.detach().clone() for p in params],
            "changes": [c.record() for c in trainer.world_changes],
            "world_size": dist.get_world_size(), "pid": os.getpid(), "member": member,
            "rank": dist.get_rank(), "local": _local_place(), "headers_gathered": len(located), "copies": len(copies),
            "places_gathered": len(places),
            "buddy_bytes": (trainer._elastic.buddy.nbytes  # type: ignore[union-attr]
                            if trainer._elastic is not None and trainer._elastic.buddy is not None else None),
            "kept_bytes": (trainer._elastic.buddy.kept_nbytes  # type: ignore[union-attr]
                           if trainer._elastic is not None and trainer._elastic.buddy is not None else None),
            "steps": result.steps,
            "hook_steps": None if hook_state is None else getattr(hook_state, "iter", QUANTIZED_STEPS[0])}


def _local_place() -> tuple[int, int]:
    """This process's local rank and local world size, as the last world change made them."""
    from tandem.control import group_record
    record = group_record.current()
    assert record is not None
    return record.info.local_rank, record.info.local_world_size


QUANTIZED_STEPS = [0]  # backwards whose last bucket this process's int8 hook reduced


def counted_quantized_hook(state: Any, bucket: Any) -> Any:
    """tandem's int8 hook, counting this process's backwards (at each one's last bucket)."""
    from tandem.comm_hooks import quantized_hook
    if bucket.is_last():
        QUANTIZED_STEPS[0] += 1
    return quantized_hook(state, bucket)


def _reference(schedule: list[int], zero: bool = False) -> list[torch.Tensor]:
    """One process trains on the global batches of ``schedule`` (world size per step);
    with ``zero``, with Adam and the sharded runs' scheduler."""
    from tandem.data.sampler import _epoch_order

    order = _epoch_order(N, shuffle=True, seed=0, epoch=0)
    batches, consumed = [], 0
    for world in schedule:  # the last global batch may be smaller than world * BATCH
        batches.append(order[consumed:consumed + world * BATCH])
        consumed = min(consumed + world * BATCH, N)
    assert consumed == N
    return reference_on(batches, sharded=zero)


def local_sgd_reference(out: Path, died_at: dict[str, int], sync_every: int, epochs: int) -> list[torch.Tensor]:
    """LocalSGD written from the records alone: in each committed step, each
    process trains its own copy on its batch, weighed as the loader says (its
    share of the step's samples times the number of ranks), with plain SGD; every
    ``sync_every`` steps, at each epoch's end and where the processes change, the
    copies become their average."""
    data = indexed()
    per_step: dict[int, dict[str, list[int]]] = {}
    for path in out.glob("samples-*.jsonl"):
        process = path.name.removeprefix("samples-").removesuffix(".jsonl")
        member = process.split("-")[0]
        last: dict[int, list[int]] = {}
        for line in path.read_text().splitlines():
            record = json.loads(line)
            last[record["step"]] = record["idx"]
        for step, idx in last.items():
            if not (member in died_at and step >= died_at[member]):
                per_step.setdefault(step, {})[process] = idx
    steps = sorted(per_step)
    assert steps == list(range(len(steps))), steps
    synced = make_model()
    local: dict[str, torch.nn.Module] = {}
    seen = 0
    for step in steps:
        batches = per_step[step]
        if set(batches) != set(local):  # a new world: every copy starts from the synced model
            assert not local or (step % sync_every == 0 or seen % N == 0), (step, seen)
            local = {p: copy.deepcopy(synced) for p in batches}
        total = sum(len(idx) for idx in batches.values())
        for process, idx in batches.items():
            if not idx:
                continue
            model = local[process]
            weight = len(idx) * len(batches) / total
            loss = ((model(data.x[idx]) - data.y[idx]) ** 2).mean() * weight
            grads = torch.autograd.grad(loss, list(model.parameters()))
            with torch.no_grad():
                for param, grad in zip(model.parameters(), grads):
                    param.sub_(LOCAL_LR * grad)
        seen += total
        if (step + 1) % sync_every == 0 or seen % N == 0:
            with torch.no_grad():
                for target, *copies in zip(synced.parameters(), *(m.parameters() for m in local.values())):
                    target.copy_(torch.stack(copies).mean(0))
            local = {p: copy.deepcopy(synced) for p in local}
    assert seen == epochs * N
    return [p.detach().clone() for p in synced.parameters()]


def global_batches(out: Path, died_at: dict[str, int]) -> list[list[int]]:
    """Each committed step's samples, all ranks together, from the logs."""
    steps: dict[int, list[int]] = {}
    for step, idx in committed_steps(out, died_at):
        steps.setdefault(step, []).extend(idx)
    return [sorted(steps[step]) for step in sorted(steps)]


def reference_on(batches: list[list[int]], *, sharded: bool = True) -> list[torch.Tensor]:
    """One process on these global batches, with Adam and the sharded runs'
    scheduler (``sharded``) or the DDP runs' optimizer: the reference where the
    rest of an epoch was split exactly (Note [exact split]), whose steps are not
    the order's next samples."""
    data, model = indexed(), make_model()
    opt = torch.optim.Adam(model.parameters(), **ADAM) if sharded else make_optimizer(model)
    scheduler = make_scheduler(opt) if sharded else None
    for idx in batches:
        loss = ((model(data.x[idx]) - data.y[idx]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return [p.detach().clone() for p in model.parameters()]


def _schedule(changes: list[dict], start_world: int = 3) -> list[int]:
    """World size per step: ``start_world`` until each change's step, then its new size."""
    return world_sizes(changes, start_world=start_world, samples=N, batch=BATCH)


def _used_samples(out: Path, died_at: dict[str, int]) -> list[int]:
    """Every sample index of a committed step (:func:`committed_steps`)."""
    return sorted(i for _, idx in committed_steps(out, died_at) for i in idx)


def committed_steps(out: Path, died_at: dict[str, int]) -> list[tuple[int, list[int]]]:
    """Each process's committed steps and their sample indices: per process, the
    last record of each step (a dropped step is redone under the same number); a
    rank that died at step k committed only the steps before k."""
    steps: list[tuple[int, list[int]]] = []
    for path in out.glob("samples-*.jsonl"):
        member = path.name.split("-")[1]
        last: dict[int, list[int]] = {}
        for line in path.read_text().splitlines():
            record = json.loads(line)
            last[record["step"]] = record["idx"]
        steps += [(step, idx) for step, idx in last.items() if not (member in died_at and step >= died_at[member])]
    return steps


def _run(tmp_path: Path, deaths: dict[int, int], *, replace: tuple[int, ...] = (),
         join_dies: str | None = None, join_at: int | None = None, zero: bool = False,
         checkpoint_every: int = 0, fsdp: bool = False, admitting_dies: int | None = None,
         group_dies: int | None = None, in_refresh: bool = False, save_dies: int | None = None,
         world: int = 3, miscounts: int | None = None, leaves_at: int | None = None,
         local_steps: int | None = None, ends_apart_at: int | None = None, hook: str | None = None,
         admitting_dies_at: str = "share", other_model: bool = False) -> list[dict]:
    may_die = list(deaths) + ([3] if join_dies else []) + [r for r in (admitting_dies, group_dies, save_dies)
                                                           if r is not None]
    results = run_distributed(_rank, world, args=(str(tmp_path), deaths, join_dies, join_at, zero, checkpoint_every,
                                                  fsdp, admitting_dies, group_dies, in_refresh, save_dies,
                                                  miscounts, leaves_at, local_steps, ends_apart_at, hook,
                                                  admitting_dies_at, other_model),
                              timeout=TIMEOUT,
                              init_process_group=False, may_die=may_die, replace=replace)
    pids = [r["pid"] for r in results if r is not None]
    assert still_running(pids) == []
    return results


def _check_equal_replicas(live: list[dict]) -> None:
    for other in live[1:]:
        for a, b in zip(live[0]["params"], other["params"]):
            assert torch.equal(a, b), "the replicas differ"


def _check_reference(live: list[dict], schedule: list[int], zero: bool = False) -> None:
    for a, b in zip(live[0]["params"], _reference(schedule, zero)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def _sharded(sharding: str) -> dict[str, bool]:
    return {"ddp": {}, "zero2": {"zero": True}, "fsdp": {"fsdp": True}}[sharding]


JOIN = {"replace": (1,), "join_at": 4}
SCENARIOS: dict[str, tuple[dict[int, int], dict]] = {  # name: (deaths, _run's keywords)
    "shrink": ({1: 2}, {}),
    "replacement": ({1: 2}, JOIN),
    **{f"sharded-shrink-{s}": ({1: 2}, _sharded(s)) for s in ("zero2", "fsdp")},
    **{f"sharded-replacement-{s}": ({1: 2}, {**JOIN, **_sharded(s)}) for s in ("zero2", "fsdp")},
    **{f"buddy-lost-{s}": ({1: 3, 2: 3}, {"checkpoint_every": 2, **_sharded(s)}) for s in ("zero2", "fsdp")},
    **{f"two-losses-{s}": ({1: 1, 2: 3}, _sharded(s)) for s in ("ddp", "zero2", "fsdp")},
    **{f"lost-joining-{s}": ({1: 2}, {**JOIN, "join_dies": "admitted", **_sharded(s)})
       for s in ("ddp", "zero2", "fsdp")},
    "lost-connecting": ({1: 2}, {**JOIN, "join_dies": "connecting"}),
    "lost-after-arriving": ({1: 2}, {**JOIN, "join_dies": "arrived"}),
    "lost-building-a-group": ({1: 2}, {"group_dies": 2, "fsdp": True}),
    **{f"member-lost-admitting-{s}": ({1: 2}, {**JOIN, "admitting_dies": 2, **_sharded(s)})
       for s in ("ddp", "zero2", "fsdp")},
    # Founding rank 3 of 4 (rank 2 of the world after rank 1's loss) sends its copy of its new
    # shard as that change ends and dies before it receives one: rank 1's copy to it fails,
    # rank 0's completes (Note [a change cut short after its shards moved]).
    "member-lost-in-the-changes-copies-fsdp": ({1: 2}, {"admitting_dies": 3, "admitting_dies_at": "copy",
                                                        "world": 4, "fsdp": True}),
    # Founding rank 2 (rank 1 of the grown world 0, 2, j1) dies in the first copies after j1
    # joined, having received rank 0's and before sending its own to j1 (Note [a grow's copies
    # ride on its first step]).
    **{f"member-lost-before-the-grows-first-copy-{s}": (
        {1: 2}, {**JOIN, "admitting_dies": 2, "admitting_dies_at": "first-copy", **_sharded(s)})
       for s in ("zero2", "fsdp")},
    # Rank 1 dies as it would send its copy of step 4, where the StepLR halves the rate.
    "step-back-fsdp": ({1: 4}, {"in_refresh": True, "fsdp": True}),
    # Rank 2 of 4 dies inside dcp.save of step 2's checkpoint; gloo's ring is such that
    # rank 0 waits there on a rank that is alive but has left for the regroup.
    "lost-in-dcp-save-fsdp": ({}, {"save_dies": 2, "world": 4, "checkpoint_every": 2, "fsdp": True}),
    # The same in a whole-file save (rank 0 writes, the others wait in one all-reduce).
    "lost-in-file-save-ddp": ({}, {"save_dies": 2, "world": 4, "checkpoint_every": 2}),
    "miscounted-groups": ({1: 2}, {"miscounts": 2}),
    "left-alive-zero2": ({}, {"leaves_at": 3, "zero": True}),
    # Rank 2 of 3 leaves for a regroup after the last step of the first of two epochs (8 steps).
    "epoch-end-seen-apart": ({}, {"ends_apart_at": 8}),
    **{f"{hook}-replacement": ({1: 2}, {**JOIN, "hook": hook}) for hook in ("powersgd", "int8")},
    # Local steps (Note [elastic local steps]): rank 1 dies in step 4, after the sync of step 3.
    "local-steps": ({1: 4}, {"local_steps": 3}),
    "local-steps-replacement": ({1: 4}, {**JOIN, "join_at": 5, "local_steps": 3}),
    # j1 built a wider model than the members' (Note [a grow checked in the store]).
    "replacement-other-model": ({1: 2}, {**JOIN, "other_model": True}),
    # Rank 2 dies in step 6, while j1's group is built ahead (Note [a group built ahead]).
    "lost-while-built-ahead": ({1: 2, 2: 5}, JOIN),
}


@contextlib.contextmanager
def launch_all(factory: pytest.TempPathFactory, run: Callable[..., Any],
               scenarios: dict[str, tuple[dict[int, int], dict]]) -> Iterator[dict[str, tuple[Path, Future]]]:
    """``run(directory, deaths, **keywords)`` for every scenario, three at a time,
    each in a new directory: the directory and future of each, by name."""
    paths = {name: factory.mktemp(name) for name in scenarios}
    calls = {name: functools.partial(run, paths[name], deaths, **kwargs)
             for name, (deaths, kwargs) in scenarios.items()}
    with start_concurrently(calls) as runs:
        yield {name: (paths[name], runs[name]) for name in scenarios}


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, Future]]]:
    """Every scenario, started when the first test asks."""
    with launch_all(tmp_path_factory, _run, SCENARIOS) as runs:
        yield runs


def _launched(scenarios: dict[str, tuple[Path, Future]], name: str) -> tuple[Path, list[dict]]:
    """Scenario ``name``'s directory and per-rank results (or its failure, raised)."""
    path, future = scenarios[name]
    return path, future.result()


def test_shrink_after_a_rank_dies_in_backward(scenarios: dict) -> None:
    tmp_path, results = _launched(scenarios, "shrink")
    live = [r for r in results if r is not None]
    assert [r["member"] for r in live] == ["0", "2"] and all(r["world_size"] == 2 for r in live)
    _check_equal_replicas(live)
    changes = live[0]["changes"]
    assert len(changes) == 1
    change = changes[0]
    assert change["step"] == 2 and change["lost_ranks"] == [1] and change["world_size"] == 2
    assert change["steps_lost"] == 1 and "all_reduce" in change["cause"]
    schedule = [3, 3] + [2] * ((N - 12) // 4)
    assert _schedule(changes) == schedule
    _check_reference(live, schedule)
    # A world that stayed at 3 gives different parameters: the comparison can fail.
    assert not torch.allclose(live[0]["params"][0], _reference([3] * (N // 6))[0], atol=1e-6)
    assert _used_samples(tmp_path, {"1": 2}) == list(range(N))


def test_replacement_joins_and_gets_the_state(scenarios: dict) -> None:
    tmp_path, results = _launched(scenarios, "replacement")
    live = [r for r in results if r is not None]
    assert sorted(r["member"] for r in live) == ["0", "2", "j"]
    assert all(r["world_size"] == 3 for r in live)
    _check_equal_replicas(live)
    changes = live[0]["changes"]
    assert [c["lost_ranks"] for c in changes] == [[1], []]
    grow = changes[1]
    assert grow["joined"] == ["j1"] and grow["world_size"] == 3
    # It asked before step 5's decision: the members began its group then, and trained
    # on for a step in the old world meanwhile (Note [a group built ahead]).
    assert grow["built_ahead_from"] == 5 and grow["step"] == 6
    # The loss gathered each rank's place; the grow, none (Note [a grow checked in the store]).
    assert {r["member"]: r["places_gathered"] for r in live} == {"0": 1, "2": 1, "j": 0}
    # One host: every member is local to every other, after the loss (gathered) and the
    # admission (read from the store: the replacement every member's host, the members its).
    assert all(r["local"] == (r["rank"], 3) for r in live), [(r["rank"], r["local"]) for r in live]
    _check_reference(live, _schedule(changes))
    assert _used_samples(tmp_path, {"1": 2}) == list(range(N))


def _replaced_with_hook(scenarios: dict, name: str) -> tuple[list[dict], list[int], list[dict]]:
    """A hook's scenario (a loss, then a replacement that registered its hook in its
    world of one): the live ranks, the world size per step and the changes, once
    the checks every such run passes hold (equal replicas, every sample once)."""
    tmp_path, results = _launched(scenarios, name)
    live = [r for r in results if r is not None]
    assert sorted(r["member"] for r in live) == ["0", "2", "j"] and all(r["world_size"] == 3 for r in live)
    _check_equal_replicas(live)
    changes = live[0]["changes"]
    assert [(c["lost_ranks"], c["joined"]) for c in changes] == [([1], []), ([], ["j1"])]
    assert _used_samples(tmp_path, {"1": 2}) == list(range(N))
    return live, _schedule(changes), changes


def test_powersgd_follows_the_model_into_each_new_world(scenarios: dict) -> None:
    # Note [powersgd in a new world] in tandem/comm_hooks/powersgd.py. Every rank compresses
    # every step after the first (the replacement from rank 0's step count and Qs; without
    # them it all-reduced whole buckets against the members' [uncompressed | P]), and at a
    # rank as large as each gradient PowerSGD loses nothing: the run equals DDP's across
    # both changes (with the survivors' error memory kept, it parts by 0.08).
    live, schedule, _ = _replaced_with_hook(scenarios, "powersgd-replacement")
    assert [r["hook_steps"] for r in live] == [len(schedule)] * 3
    for a, b in zip(live[0]["params"], _reference(schedule)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


def test_the_int8_hook_follows_a_replacement_into_the_job(scenarios: dict) -> None:
    # DDP has no reducer in a world of one: the replacement's hook was dropped there, and it
    # all-reduced each bucket while the members sent int8 all-to-alls. Now every rank runs
    # the hook on every step, and the parameters stay near DDP's (int8 with error feedback
    # is not lossless).
    live, schedule, changes = _replaced_with_hook(scenarios, "int8-replacement")
    steps = {r["member"]: r["hook_steps"] for r in live}
    # A member may have reached the last bucket of the step the loss dropped: counted too.
    assert steps["j"] == len(schedule) - changes[1]["step"] and min(steps["0"], steps["2"]) >= len(schedule), steps
    reference = _reference(schedule)
    assert max((a - b).abs().max().item() for a, b in zip(live[0]["params"], reference)) < 5e-3


# Note [buddy copies]: ZeRO-2 copies the optimizer-state shard, fully_shard the
# parameter shard and its state (Note [elastic fully_shard]); both recover a lost
# rank's from its buddy, and rebuild a replacement's from the live ranks.
SHARDED = pytest.mark.parametrize("sharding", ["zero2", "fsdp"])


@SHARDED
def test_sharded_shrink_recovers_the_lost_shard_from_its_buddy(scenarios: dict, sharding: str) -> None:
    tmp_path, results = _launched(scenarios, f"sharded-shrink-{sharding}")
    live = [r for r in results if r is not None]
    assert [r["member"] for r in live] == ["0", "2"] and all(r["world_size"] == 2 for r in live)
    _check_equal_replicas(live)
    changes = live[0]["changes"]
    assert [(c["step"], c["lost_ranks"], c["world_size"], c["steps_lost"]) for c in changes] == [(2, [1], 2, 1)]
    schedule = [3, 3] + [2] * ((N - 12) // 4)
    _check_reference(live, schedule, zero=True)
    # A world that stayed at 3 gives other parameters: the comparison can fail.
    assert not torch.allclose(live[0]["params"][0], _reference([3] * (N // 6), zero=True)[0], atol=1e-6)
    # `tandem plan --elastic` shows the copy rank 1 holds of rank 0's shard at world 2, and
    # its own kept shard (Note [one step back]), planned as the same size.
    from tandem.tools.plan import plan_report
    if sharding == "zero2":
        planned = plan_report(make_model(), world_size=2, optimizer="adam", bucket_cap_mb=0.0001, elastic=True)
        assert 2 * live[1]["buddy_bytes"] == planned.strategies[2].estimate.buddy > 0
        assert 0 < live[1]["kept_bytes"] <= live[1]["buddy_bytes"]  # rank 1's own: no larger than rank 0's
    else:  # the units of _rank: one per Linear, and a root without parameters
        planned = plan_report(make_model(), world_size=2, optimizer="adam", fsdp_units=["0", "2", ""],
                              min_unit_bytes=0, elastic=True)
        assert 2 * live[1]["buddy_bytes"] == planned.strategies[3].estimate.buddy > 0
        assert 0 < live[1]["kept_bytes"] <= live[1]["buddy_bytes"]
    assert _used_samples(tmp_path, {"1": 2}) == list(range(N))


@SHARDED
def test_sharded_replacement_joins_with_its_shard(scenarios: dict, sharding: str) -> None:
    tmp_path, results = _launched(scenarios, f"sharded-replacement-{sharding}")
    live = [r for r in results if r is not None]
    assert sorted(r["member"] for r in live) == ["0", "2", "j"]
    assert all(r["world_size"] == 3 for r in live)
    _check_equal_replicas(live)
    changes = live[0]["changes"]
    assert [c["world_size"] for c in changes] == [2, 3] and changes[1]["joined"] == ["j1"]
    # The shards' headers are gathered after the loss; the grow locates them without
    # (Note [a grow located without a gather]).
    assert {r["member"]: r["headers_gathered"] for r in live} == {"0": 1, "2": 1, "j": 0}, live
    # It sends no copies (Note [a grow's copies ride on its first step]): the replacement one
    # after each step it trained, from the grow's.
    [j] = [r for r in live if r["member"] == "j"]
    assert j["copies"] == j["steps"] - changes[1]["step"], (j["copies"], j["steps"], changes[1]["step"])
    _check_reference(live, _schedule(changes), zero=True)
    assert _used_samples(tmp_path, {"1": 2}) == list(range(N))


@SHARDED
def test_sharded_shard_and_its_buddy_lost_together_falls_back_to_the_checkpoint(scenarios: dict,
                                                                              sharding: str) -> None:
    # Ranks 1 and 2 die in the same step: rank 1's shard and rank 2's copy of it are
    # both gone. Rank 0 goes on alone from the checkpoint of step 2, saying so.
    tmp_path, results = _launched(scenarios, f"buddy-lost-{sharding}")
    live = [r for r in results if r is not None]
    assert [r["member"] for r in live] == ["0"] and live[0]["world_size"] == 1
    assert live[0]["steps"] == 2 + (N - 12) // 2  # trained from step 2 again, at world 1
    # The change says so: it goes on from the checkpoint's step, the steps since redone.
    [change] = live[0]["changes"]
    assert (change["lost_ranks"], change["world_size"], change["step"], change["checkpoint_step"],
            change["steps_lost"]) == ([1, 2], 1, 2, 2, 2)
    _check_reference(live, [3, 3] + [1] * ((N - 12) // 2), zero=True)
    assert _used_samples(tmp_path, {"1": 2, "2": 2}) == list(range(N))


# Two losses, and a loss in the middle of a rejoin, under each strategy: the
# sharded ones recover each lost shard from its buddy copy in the world of the
# moment (after the first loss, a world of 2 whose copies were refreshed for it).
EVERY = pytest.mark.parametrize("sharding", ["ddp", "zero2", "fsdp"])


@EVERY
def test_two_successive_losses(scenarios: dict, sharding: str) -> None:
    tmp_path, results = _launched(scenarios, f"two-losses-{sharding}")
    live = [r for r in results if r is not None]
    assert [r["member"] for r in live] == ["0"] and live[0]["world_size"] == 1
    changes = live[0]["changes"]
    assert [(c["step"], c["lost_ranks"], c["world_size"], c["checkpoint_step"]) for c in changes] == [
        (1, [1], 2, None), (3, [1], 1, None)]
    schedule = [3, 2, 2] + [1] * ((N - 6 - 8) // 2)
    assert _schedule(changes) == schedule
    _check_reference(live, schedule, zero=sharding != "ddp")
    assert _used_samples(tmp_path, {"1": 1, "2": 3}) == list(range(N))


@EVERY
@pytest.mark.parametrize(("scenario", "survivors", "lost"), [
    ("lost-joining", ["0", "2"], [2]),  # j1 (rank 2 of world 3) dies as it is admitted
    # Note [a join cut short] in tandem/elastic/run.py: member 2 (rank 1 of world 3)
    # dies as the state is sent to j1, which takes part in the next change, gets the
    # state there, and trains on.
    ("member-lost-admitting", ["0", "j"], [1]),
])
def test_a_loss_while_a_replacement_is_admitted(scenarios: dict, sharding: str, scenario: str,
                                                survivors: list[str], lost: list[int]) -> None:
    tmp_path, results = _launched(scenarios, f"{scenario}-{sharding}")
    live = [r for r in results if r is not None]
    assert sorted(r["member"] for r in live) == survivors
    _check_equal_replicas(live)
    changes = live[0]["changes"]
    assert [(c["lost_ranks"], c["joined"], c["world_size"]) for c in changes] == \
        [([1], [], 2), ([], ["j1"], 3), (lost, [], 2)]
    assert all(c["checkpoint_step"] is None and not c["stepped_back"] for c in changes)
    assert [r["steps"] for r in live] == [len(_schedule(changes))] * 2
    _check_reference(live, _schedule(changes), zero=sharding != "ddp")
    assert _used_samples(tmp_path, {"1": 2}) == list(range(N))


def test_a_loss_as_a_changes_copies_are_sent_recovers_the_new_worlds_shards(scenarios: dict) -> None:
    # Founding rank 3 dies between its copy and its neighbour's as the change after rank 1's
    # loss ends: rank 0 holds the new world's copies, rank 1 (founding 2) still the old
    # world's. Its own shards of both worlds are offered; the new world's are complete
    # (rank 2's copy on rank 0), and taken whole, never mixed with the old world's.
    tmp_path, results = _launched(scenarios, "member-lost-in-the-changes-copies-fsdp")
    live = [r for r in results if r is not None]
    assert sorted(r["member"] for r in live) == ["0", "2"]
    _check_equal_replicas(live)
    changes = live[0]["changes"]
    assert [(c["lost_ranks"], c["joined"], c["world_size"]) for c in changes] == [([1], [], 3), ([2], [], 2)]
    assert all(c["checkpoint_step"] is None and not c["stepped_back"] for c in changes), changes
    _check_reference(live, _schedule(changes, start_world=4), zero=True)
    assert _used_samples(tmp_path, {"1": 2, "3": 2}) == list(range(N))  # 3's step 2 was dropped


@SHARDED
def test_a_loss_in_a_grows_first_copies_goes_back_to_the_old_worlds_shards(scenarios: dict, sharding: str) -> None:
    # Note [a grow's copies ride on its first step]: j1 joined at step 6 and no copies were
    # sent; founding rank 2 dies in the first ones (step 7's), having received rank 0's and
    # before sending its own to j1. No layout of the grown world is complete at step 7 or 6
    # (its shards of both steps are on no survivor), so the old world's is taken at step 6:
    # rank 0's own shard and its copy of founding rank 2's, kept past the first copies. The
    # job goes back to step 6 and ends equal to one process on the committed global
    # batches, every sample once.
    tmp_path, results = _launched(scenarios, f"member-lost-before-the-grows-first-copy-{sharding}")
    live = [r for r in results if r is not None]
    assert sorted(r["member"] for r in live) == ["0", "j"]
    _check_equal_replicas(live)
    changes = live[0]["changes"]
    assert [(c["lost_ranks"], c["joined"], c["world_size"], c["step"], c["stepped_back"]) for c in changes] == \
        [([1], [], 2, 2, False), ([], ["j1"], 3, 6, False), ([1], [], 2, 6, True)], changes
    assert all(c["checkpoint_step"] is None for c in changes), changes
    batches = global_batches(tmp_path, {"1": 2, "2": 6})
    assert [len(b) for b in batches][:8] == [6, 6, 4, 4, 4, 4, 4, 4] and sum(map(len, batches)) == N
    for a, b in zip(live[0]["params"], reference_on(batches)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert _used_samples(tmp_path, {"1": 2, "2": 6}) == list(range(N))


def test_a_loss_while_a_replacements_group_is_built_ahead(scenarios: dict) -> None:
    # Note [a group built ahead]: j1 was seen at step 5's decision; rank 2 dies in step 6,
    # as the members build the new group. The change goes to the generation proposed for
    # j1 (generation 2: 0, 2, j1), finds rank 2 gone, and the next (3) leaves it out, rank 1
    # of generation 2: 0 and j1 go on from step 5's commit, equal to one process on the
    # committed global batches, every sample once.
    tmp_path, results = _launched(scenarios, "lost-while-built-ahead")
    live = [r for r in results if r is not None]
    assert sorted(r["member"] for r in live) == ["0", "j"]
    _check_equal_replicas(live)
    changes = live[0]["changes"]
    assert [(c["generation"], c["lost_ranks"], c["joined"], c["world_size"], c["step"]) for c in changes] == \
        [(1, [1], [], 2, 2), (3, [1], [], 2, 5)], changes
    _check_reference(live, _schedule(changes))
    assert _used_samples(tmp_path, {"1": 2, "2": 5}) == list(range(N))


@pytest.mark.parametrize(("scenario", "seen"), [
    ("lost-connecting", "the arrival of generation 2's members"),
    ("lost-after-arriving", "the arrival of generation 2's members (group connected)"),
])
def test_a_replacement_lost_before_it_connects_holds_no_one(scenarios: dict, scenario: str, seen: str) -> None:
    # Note [arrivals] in tandem/control/elastic_group.py: admitted, j1 dies before it marks itself
    # arrived, or after, before it connects; the members see it dead as they wait for its
    # mark, or as they build the group's backend on threads of their own (Note [a death while
    # the group is built]: the roll call of the connected ones names it, not building's timeout,
    # connect_timeout_s), and go on without it.
    tmp_path, results = _launched(scenarios, scenario)
    live = [r for r in results if r is not None]
    assert sorted(r["member"] for r in live) == ["0", "2"]
    _check_equal_replicas(live)
    changes = live[0]["changes"]
    assert [(c["lost_ranks"], c["world_size"]) for c in changes] == [([1], 2), ([2], 2)]
    assert seen in changes[1]["cause"], changes[1]
    _check_reference(live, _schedule(changes))
    assert _used_samples(tmp_path, {"1": 2}) == list(range(N))


def test_a_rank_lost_as_fully_shard_builds_its_reduce_group_holds_no_one(scenarios: dict) -> None:
    # Note [arrivals] in tandem/control/elastic_group.py: after rank 1's loss, member 2 dies as the
    # first forward of world 2 builds fully_shard's reduce-scatter group; rank 0 sees it
    # dead before building, and goes on alone (it waited in torch's new_group before).
    tmp_path, results = _launched(scenarios, "lost-building-a-group")
    live = [r for r in results if r is not None]
    assert [r["member"] for r in live] == ["0"]
    changes = live[0]["changes"]
    assert [(c["step"], c["lost_ranks"], c["world_size"]) for c in changes] == [(2, [1], 2), (2, [1], 1)]
    assert "fully_shard reduce-scatters" in changes[1]["cause"], changes[1]
    assert all(c["checkpoint_step"] is None for c in changes)
    _check_reference(live, _schedule(changes), zero=True)
    assert _used_samples(tmp_path, {"1": 2, "2": 2}) == list(range(N))


def test_a_replacement_with_another_model_is_named_on_every_rank(scenarios: dict) -> None:
    # Note [a grow checked in the store]: the digests read from the store differ, so DDP's
    # check gathers the models and raises the same error on the members and on j1.
    with pytest.raises(RankFailure) as failed:
        _launched(scenarios, "replacement-other-model")
    tracebacks = failed.value.tracebacks
    assert len(tracebacks) == 3, sorted(tracebacks)
    for rank, text in tracebacks.items():
        assert "ValueError" in text and "DistributedDataParallel needs the same model on every rank" in text \
            and "(16, 6)" in text and "(17, 6)" in text, (rank, text[-2000:])


@pytest.mark.parametrize("bad", [{"min_world_size": 0}, {"beat_s": 0}, {"beat_s": 1.0, "stale_after_s": 2.0}])
def test_config_is_checked(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        ElasticConfig(**bad)


def test_one_step_back_sets_the_learning_rate_back(scenarios: dict) -> None:
    # Note [one step back] in tandem/elastic/buddy.py: rank 0 got rank 2's copy of step 4
    # and went on (its scheduler halved the rate for step 5); rank 1's copy of step 4 never
    # left, so the job goes back to step 3, whose rate is the whole one: fully_shard's shard
    # does not hold the rate, the point the job goes back to does.
    tmp_path, results = _launched(scenarios, "step-back-fsdp")
    live = [r for r in results if r is not None]
    assert [r["member"] for r in live] == ["0", "2"]
    _check_equal_replicas(live)
    changes = live[0]["changes"]
    assert [(c["step"], c["lost_ranks"], c["world_size"], c["stepped_back"]) for c in changes] == \
        [(3, [1], 2, True)]
    batches = global_batches(tmp_path, {"1": 3})
    assert [len(b) for b in batches][:4] == [6, 6, 6, 4] and sum(map(len, batches)) == N
    for a, b in zip(live[0]["params"], reference_on(batches)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("scenario", ["lost-in-dcp-save-fsdp", "lost-in-file-save-ddp"])
def test_a_rank_lost_inside_a_save_holds_no_one(scenarios: dict, scenario: str) -> None:
    # Found by the soak: DCP plans a save with torch's own collectives, and a rank waiting
    # there on a live peer that left for the regroup waited until the regroup gave up (a
    # 15 s stall there, 30 s here, then a failure). Watched, it sees the dead rank at once.
    # A whole-file save's one all-reduce held a rank so too (the DDP soak, 240 s in CI).
    tmp_path, results = _launched(scenarios, scenario)
    live = [r for r in results if r is not None]
    assert [r["member"] for r in live] == ["0", "1", "3"] and all(r["world_size"] == 3 for r in live)
    _check_equal_replicas(live)
    changes = live[0]["changes"]
    assert [(c["step"], c["lost_ranks"], c["world_size"], c["checkpoint_step"]) for c in changes] == \
        [(2, [2], 3, None)]
    batches = global_batches(tmp_path, {})
    assert [len(b) for b in batches][:3] == [8, 8, 6] and sum(map(len, batches)) == N
    for a, b in zip(live[0]["params"], reference_on(batches, sharded="fsdp" in scenario)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_a_member_that_counted_other_groups_builds_the_next_one_with_the_others(scenarios: dict) -> None:
    # torch names a group by a per-process count, and its store keys by the name: a member
    # whose attempt to build a generation's group failed had counted one more than a member
    # that saw the death before trying, and the next generation's group never formed (a
    # soak's job ended so). Here rank 2 miscounts before each group it builds.
    tmp_path, results = _launched(scenarios, "miscounted-groups")
    live = [r for r in results if r is not None]
    assert [r["member"] for r in live] == ["0", "2"] and all(r["world_size"] == 2 for r in live)
    _check_equal_replicas(live)
    changes = live[0]["changes"]
    assert [(c["step"], c["lost_ranks"], c["world_size"]) for c in changes] == [(2, [1], 2)]
    _check_reference(live, [3, 3] + [2] * ((N - 12) // 4))


def test_a_rank_waited_on_by_a_peer_that_left_for_a_regroup_follows_it(scenarios: dict) -> None:
    # Note [a peer gone to regroup]: rank 2 leaves for a regroup, alive, before sending rank 0
    # its copy of step 3; rank 0 waits in that receive. Its heartbeat going on, rank 0 used to
    # wait for gloo's timeout (40 s in a soak); it sees rank 2 asked for the next generation,
    # and follows. Nobody is lost: the three regroup and train on.
    tmp_path, results = _launched(scenarios, "left-alive-zero2")
    assert [r["member"] for r in results] == ["0", "1", "2"] and all(r["world_size"] == 3 for r in results)
    _check_equal_replicas(results)
    changes = results[0]["changes"]
    assert [(c["lost_ranks"], c["joined"], c["world_size"]) for c in changes] == [([], [], 3)]
    assert "rank 2 has left generation 0 to regroup" in changes[0]["cause"], changes[0]["cause"]
    _check_reference(results, [3] * (N // 6), zero=True)
    assert _used_samples(tmp_path, {}) == list(range(N))


def test_an_epochs_end_seen_apart_is_ended_again_together(scenarios: dict) -> None:
    # Note [an epoch's end seen apart] in tandem/elastic/epoch_end.py: rank 2 regroups before
    # counting the first epoch, ranks 0 and 1 after counting it (their end-of-epoch save sees
    # rank 2 gone). Found by a ZeRO-2 soak: the first saved while the others trained the next
    # step, and each waited for the other (300 s). Now all three end the epoch again, save,
    # and train the second epoch as one process would.
    tmp_path, results = _launched(scenarios, "epoch-end-seen-apart")
    assert [r["member"] for r in results] == ["0", "1", "2"] and all(r["world_size"] == 3 for r in results)
    _check_equal_replicas(results)
    changes = results[0]["changes"]
    assert [(c["step"], c["lost_ranks"], c["joined"], c["world_size"]) for c in changes] == [(8, [], [], 3)]
    assert "rank 2 has left generation 0 to regroup" in changes[0]["cause"], changes[0]["cause"]
    batches = global_batches(tmp_path, {})
    assert len(batches) == 16 and all(len(b) == 6 for b in batches)
    for epoch in (batches[:8], batches[8:]):
        assert sorted(i for b in epoch for i in b) == list(range(N))  # every sample once an epoch
    for a, b in zip(results[0]["params"], reference_on(batches, sharded=False)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved[-1] == "step-00000016.pt" and "step-00000008.pt" in saved, saved


def test_local_steps_go_back_to_the_last_sync_and_admit_at_one(scenarios: dict) -> None:
    """The Trainer with LocalSGD (H=3): the survivors of a loss in step 4 go back to
    the sync of step 3 and train the window again; a replacement held for at step 5
    has its group built during step 7 (Note [a group built ahead]) and is admitted
    at the next sync, step 9's. Each ends equal to LocalSGD written from what
    every process trained, with every sample once."""
    for name in ("local-steps", "local-steps-replacement"):
        tmp_path, results = _launched(scenarios, name)
        live = [r for r in results if r is not None]
        _check_equal_replicas(live)  # the epoch's end is a sync
        changes = live[0]["changes"]
        assert (changes[0]["step"], changes[0]["lost_ranks"], changes[0]["stepped_back"]) == (3, [1], True), changes
        if name == "local-steps-replacement":
            assert [c["joined"] for c in changes] == [[], ["j1"]] and changes[1]["built_ahead_from"] == 6 \
                and changes[1]["step"] == 9, changes
            assert sorted(r["member"] for r in live) == ["0", "2", "j"]
        else:
            assert len(changes) == 1 and [r["member"] for r in live] == ["0", "2"]
        assert _used_samples(tmp_path, {"1": 3}) == list(range(N))
        for a, b in zip(live[0]["params"], local_sgd_reference(tmp_path, {"1": 3}, 3, 1)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
