"""The Trainer's saves in the background (Note [saves in the background] in
tandem/train/background_saves.py), for both checkpoint formats: a plain model
saved whole by rank 0 ("full"), and a fully-sharded one saved by every rank
("sharded").

The references are the synchronous saves of the same runs. In spawned groups
of two ranks:
- each format trained twice, saving every 2 steps, synchronously and in the
  background: the checkpoints hold the same tensors, and the final parameters
  are bit-identical;
- rank 0's write of the first checkpoint fails (an injected OSError): every
  rank raises at the next save, naming the path and the rank; nothing is
  committed for that step;
- a process is SIGKILLed in the middle of the background write of step 4 (the
  writer has written part of its file, and training has gone on to step 5):
  step 2 stays the latest checkpoint, loads, and equals the synchronous one;
  step 4 is not listed.
In this process: one save in flight at a time (a write slowed down, a Trainer
of one process), the state machine's refusal, and the stager's copies.
"""

from __future__ import annotations

import functools
import io
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import tandem
from tandem.checkpoint import MARKER, committed_steps, load_committed
from tandem.checkpoint.background import WRITER_THREAD, BackgroundWrite
from tandem.checkpoint.flat import FlatPiece, FlatShard
from tandem.checkpoint.one_rank import latest_checkpoint, list_checkpoints
from tandem.checkpoint.staging import Stager
from tandem.comm.monitor import current_monitor
from tandem.comm.peers import Liveness
from tandem.testing import Case, run_cases, run_distributed, start_concurrently

NUM_FEATURES, HIDDEN, NUM_CLASSES = 6, 17, 3  # 17 rows: uneven shards on 2 ranks
N_TRAIN, GLOBAL_BATCH = 96, 12
EVERY, STEPS = 2, 6  # saves at steps 2, 4 and 6
KINDS = ("full", "sharded")
TIMEOUT = 120
FAST_LIVENESS = Liveness(beat_s=0.25, stale_after_s=1.0)  # a killed rank found in 1 s
# the records' measured times, which differ run to run
# Timings, and the bytes the steps handed to collectives (a save in the background issues its
# own during the steps).
TIMING = ("samples_per_s", "comm_wait_share", "rank_phases", "stragglers", "comm_bytes_per_step")


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N_TRAIN, NUM_FEATURES, generator=g)
    y = (x[:, :NUM_CLASSES] * 2 + 0.3 * torch.randn(N_TRAIN, NUM_CLASSES, generator=g)).argmax(1)
    return TensorDataset(x, y)


def _train(rank: int, output_dir: str, kind: str, *, async_checkpoint: bool, world_size: int = 2,
           holder: dict[str, Any] | None = None, **options: Any) -> dict[str, Any]:
    tandem.seed_everything(0)
    model = nn.Sequential(nn.Linear(NUM_FEATURES, HIDDEN), nn.Tanh(), nn.Dropout(0.1),
                          nn.Linear(HIDDEN, NUM_CLASSES))
    tandem.seed_everything(0, per_rank=True)  # dropout: every rank's RNG state is in the checkpoint
    if kind == "sharded":
        for layer in model:
            if isinstance(layer, nn.Linear):
                tandem.fully_shard(layer, min_unit_bytes=0)
        tandem.fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    config = tandem.TrainerConfig(output_dir=output_dir, epochs=1, batch_size=GLOBAL_BATCH // world_size,
                                  max_steps=STEPS, checkpoint_every=EVERY, keep_checkpoints=10, log_every=1,
                                  plot=False, progress=False, async_checkpoint=async_checkpoint, **options)
    trainer = tandem.Trainer(model, optimizer, _data(), nn.functional.cross_entropy, scheduler=scheduler,
                             config=config)
    assert trainer.checkpoint_format.value == kind
    if holder is not None:
        holder["trainer"] = trainer
    result = trainer.fit()
    module = getattr(trainer.model, "module", trainer.model)
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
              for k, v in module.state_dict().items()}
    return {"params": params, "steps": result.steps, "checkpoint": str(result.checkpoint)}


# ---------------------------------------------------------------- faults injected in a rank
def _in_writer_thread() -> bool:
    return threading.current_thread().name == WRITER_THREAD


def _failing_save(rank: int, world_size: int, base: str, kind: str) -> dict[str, Any]:
    """Rank 0's writer thread fails to write any file of step 2."""
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if _in_writer_thread() and f"step-{EVERY:08d}" in str(getattr(f, "name", "")):
            raise OSError(28, "No space left on device (injected)")
        return real_save(obj, f, *args, **kwargs)

    if rank == 0:
        torch.save = save
    holder: dict[str, Any] = {}
    try:
        _train(rank, f"{base}/{kind}-failing", kind, async_checkpoint=True, holder=holder)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "step": holder["trainer"].state.step,
                "cause": None if e.__cause__ is None else type(e.__cause__).__name__}
    finally:
        torch.save = real_save
    raise AssertionError("the run ended although a write failed")


def _wait_for(condition: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


def _killed_mid_write(rank: int, world_size: int, base: str, kind: str, victim: int) -> str:
    """Run in the background; ``victim`` dies in the middle of its write of step 4,
    once training has gone on to step 5."""
    current_monitor().set_liveness(FAST_LIVENESS)  # the survivor finds the victim gone in 1 s
    holder: dict[str, Any] = {}
    directory = Path(f"{base}/{kind}-killed/checkpoints")
    killed = f"step-{2 * EVERY:08d}"

    def die() -> None:
        _wait_for(lambda: holder["trainer"].state.step > 2 * EVERY, "training went on")
        (directory.parent / f"killed-by-rank-{rank}-in-{threading.current_thread().name}").touch()
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == victim and kind == "full":  # rank 0 writes the file: half of it, then dies
        real_save = torch.save

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if _in_writer_thread() and killed in str(getattr(f, "name", "")):
                buffer = io.BytesIO()
                real_save(obj, buffer)
                f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
                f.flush()
                die()
            return real_save(obj, f, *args, **kwargs)
        torch.save = save
    elif rank == victim:  # the victim's DCP file is never written, the other rank's is
        import torch.distributed.checkpoint as dcp
        real_write = dcp.FileSystemWriter.write_data

        def write_data(self: Any, plan: Any, planner: Any) -> Any:
            if killed in str(self.path):
                _wait_for(lambda: (directory / killed / f"__{1 - victim}_0.distcp").exists(), "the other's file")
                die()
            return real_write(self, plan, planner)
        dcp.FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    try:
        _train(rank, f"{base}/{kind}-killed", kind, async_checkpoint=True, holder=holder)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("the run ended although a rank was killed")


# ---------------------------------------------------------------- the spawned groups
@functools.cache
def _results(base: str) -> dict[str, Any]:
    cases = {}
    for kind in KINDS:
        for mode, background in (("sync", False), ("async", True)):
            cases[f"{kind}-{mode}"] = Case(_case_train, timeout=TIMEOUT, args=(base, kind, mode, background))
        cases[f"{kind}-failing"] = Case(_failing_save, timeout=TIMEOUT, args=(base, kind))
    two = run_cases(cases, 2)
    with start_concurrently({kind: functools.partial(run_distributed, _killed_mid_write, 2,
                                                     args=(base, kind, victim), timeout=TIMEOUT, may_die={victim})
                             for kind, victim in (("full", 0), ("sharded", 1))}) as runs:
        killed = {kind: run.result() for kind, run in runs.items()}
    return {"two": two, "killed": killed}


def _case_train(rank: int, world_size: int, base: str, kind: str, mode: str, background: bool) -> dict[str, Any]:
    return _train(rank, f"{base}/{kind}-{mode}", kind, async_checkpoint=background)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    base = tmp_path_factory.mktemp("async-checkpoints")
    return base, _results(str(base))


def _read(path: Path) -> dict[str, Any]:
    """A checkpoint as one dict: the .pt file, or a step directory's DCP files
    (read by torch's own converter) beside its trainer.pt."""
    if path.is_file():
        return torch.load(path, weights_only=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = path.parent.parent / f"{path.parent.parent.name}-{path.name}.pt"
    dcp_to_torch_save(path, out)
    return {"dcp": torch.load(out, weights_only=False), "loop": torch.load(path / "trainer.pt", weights_only=True)}


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ: tensors bit for bit, containers key by key,
    the records' timings ignored."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a if k not in TIMING for d in _differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _checkpoint(base: Path, run: str, step: int) -> Path:
    found = [p for p in list_checkpoints(base / run / "checkpoints") if p.name.startswith(f"step-{step:08d}")]
    assert len(found) == 1, (run, step, found)
    return found[0]


# ---------------------------------------------------------------- the same checkpoints, the same training
@pytest.mark.parametrize("kind", KINDS)
def test_a_background_checkpoint_holds_the_synchronous_ones_tensors(results, kind):
    base, r = results
    for run in (f"{kind}-sync", f"{kind}-async"):
        assert [p.name.removesuffix(".pt") for p in list_checkpoints(base / run / "checkpoints")] == \
            [f"step-{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)]
    for step in range(EVERY, STEPS + 1, EVERY):
        sync, background = _read(_checkpoint(base, f"{kind}-sync", step)), \
            _read(_checkpoint(base, f"{kind}-async", step))
        assert _differences(sync, background) == []
        loop = sync if kind == "full" else sync["loop"]
        assert loop["step"] == step and len(loop["rng"]) == 2
        assert len(loop["extra"]["history"]) == step  # the history as it was at the save, not at the write


@pytest.mark.parametrize("kind", KINDS)
def test_training_with_background_saves_is_bit_identical(results, kind):
    _, r = results
    for rank in range(2):
        sync, background = r["two"][f"{kind}-sync"][rank], r["two"][f"{kind}-async"][rank]
        assert sync["steps"] == background["steps"] == STEPS
        assert sync["checkpoint"].replace("-sync", "-async") == background["checkpoint"]
        assert _differences(sync["params"], background["params"]) == []


# ---------------------------------------------------------------- a write that fails
@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_background_write_raises_on_every_rank_at_the_next_save(results, kind):
    base, r = results
    path = base / f"{kind}-failing" / "checkpoints" / f"step-{EVERY:08d}{'.pt' if kind == 'full' else ''}"
    for rank, outcome in enumerate(r["two"][f"{kind}-failing"]):
        assert outcome["step"] == 2 * EVERY  # training went on to the next save, which raised
        assert outcome["error"].startswith(f"CheckpointError: rank {rank}: ")
        assert f"the background save of {path} failed" in outcome["error"]
        assert "No space left on device (injected)" in outcome["error"]
    assert r["two"][f"{kind}-failing"][0]["cause"] in ("OSError", "CheckpointError")
    assert "rank 0" in r["two"][f"{kind}-failing"][1]["error"]  # whose write failed
    assert list_checkpoints(base / f"{kind}-failing" / "checkpoints") == []


# ---------------------------------------------------------------- a kill during the write
@pytest.mark.parametrize("kind", KINDS)
def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint_loadable(results, kind):
    base, r = results
    victim = {"full": 0, "sharded": 1}[kind]
    run = base / f"{kind}-killed"
    directory = run / "checkpoints"
    assert r["killed"][kind][victim] is None  # SIGKILLed
    assert r["killed"][kind][1 - victim] is not None  # the survivor raised instead of hanging
    # Killed by its writer thread, mid-write, with training at step 5.
    assert [p.name for p in run.glob("killed-by-*")] == [f"killed-by-rank-{victim}-in-{WRITER_THREAD}"]
    previous = _checkpoint(base, f"{kind}-sync", EVERY)
    assert latest_checkpoint(directory).name == previous.name  # step 2, not the unfinished step 4
    if kind == "full":
        partial = list(directory.glob(f".step-{2 * EVERY:08d}.pt.tmp-*"))
        assert len(partial) == 1 and partial[0].stat().st_size > 0  # half a file, never listed
        assert not (directory / f"step-{2 * EVERY:08d}.pt").exists()
    else:
        unfinished = directory / f"step-{2 * EVERY:08d}"
        assert (unfinished / f"__{1 - victim}_0.distcp").exists() and not (unfinished / MARKER).exists()
        assert committed_steps(directory) == [EVERY]
        assert load_committed(directory).step == EVERY  # every file there, sizes and checksums right
    assert _differences(_read(previous), _read(latest_checkpoint(directory))) == []


# ---------------------------------------------------------------- in this process
def test_at_most_one_save_is_in_flight_and_the_next_save_waits_for_it(tmp_path, monkeypatch):
    import tandem.train.background_saves as background_saves

    writes: list[tuple[str, float, float]] = []
    active, most = [0], [0]
    real = background_saves.atomic_save

    def slow_save(obj: Any, path: Any) -> Any:
        active[0] += 1
        most[0] = max(most[0], active[0])
        started = time.monotonic()
        time.sleep(0.3)
        out = real(obj, path)
        active[0] -= 1
        writes.append((Path(path).name, started, time.monotonic()))
        return out

    monkeypatch.setattr(background_saves, "atomic_save", slow_save)
    model = nn.Sequential(nn.Linear(NUM_FEATURES, 8), nn.Tanh(), nn.Linear(8, NUM_CLASSES))
    config = tandem.TrainerConfig(output_dir=tmp_path, epochs=1, batch_size=16, checkpoint_every=1,
                                  keep_checkpoints=2, plot=False, progress=False, async_checkpoint=True)
    trainer = tandem.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(),
                             nn.functional.cross_entropy, config=config)
    saves: list[tuple[int, float, float]] = []
    save = trainer._save

    def timed_save(history: Any) -> Path:
        started = time.monotonic()
        path = save(history)
        saves.append((trainer.state.step, started, time.monotonic()))
        return path

    trainer._save = timed_save
    result = trainer.fit()
    steps = N_TRAIN // 16
    assert [s for s, _, _ in saves] == list(range(1, steps + 1))
    assert [name for name, _, _ in writes] == [f"step-{s:08d}.pt" for s in range(1, steps + 1)]
    assert most[0] == 1
    for (_, _, ended), (_, started, _) in zip(writes, writes[1:]):
        assert started >= ended  # one write at a time
    for (_, _, written), (_, _, returned) in zip(writes, saves[1:]):
        assert returned >= written  # the next save returned only once the previous write was done
    assert saves[0][2] - saves[0][1] < 0.3  # the first save did not wait for its own write
    assert result.checkpoint == tmp_path / "checkpoints" / f"step-{steps:08d}.pt"
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == \
        [f"step-{s:08d}.pt" for s in (steps - 1, steps)]  # pruned after each commit


def test_a_launch_while_a_write_is_in_flight_is_refused():
    release = threading.Event()
    write = BackgroundWrite(rank=0)
    write.launch(Path("first"), release.wait)
    with pytest.raises(RuntimeError, match=r"rank 0: the background write of first is WRITING.*finish\(\)"):
        write.launch(Path("second"), lambda: None)
    release.set()
    assert write.finish() == Path("first")
    write.launch(Path("second"), lambda: None)
    assert write.finish() == Path("second") and write.finish() is None


def test_a_write_error_is_raised_by_finish_naming_the_path_and_rank():
    write = BackgroundWrite(rank=0)

    def fail() -> None:
        raise OSError("disk on fire")
    write.launch(Path("ckpt/step-7.pt"), fail)
    with pytest.raises(tandem.CheckpointError, match=r"rank 0: the background save of ckpt/step-7.pt "
                                                     r"failed: OSError: disk on fire") as info:
        write.finish()
    assert isinstance(info.value.__cause__, OSError)
    assert write.finish() is None  # reported once


def test_the_stager_copies_into_buffers_it_reuses():
    stager = Stager()
    weight = torch.arange(6.0).view(2, 3)
    flat = torch.arange(10.0)
    history = [{"step": 1}]
    state = {"model": {"w": weight, "tied": weight},
             "shard": FlatShard((2, 5), torch.float32, [FlatPiece(3, flat[3:8])]),
             "extra": {"history": history}, "step": 1}
    first = stager.stage(state)
    weight.add_(100)
    flat.add_(100)
    history.append({"step": 2})
    assert torch.equal(first["model"]["w"], torch.arange(6.0).view(2, 3))
    assert first["model"]["tied"] is first["model"]["w"]  # one copy of a tensor under two keys
    assert torch.equal(first["shard"].box((0, 3)), torch.tensor([[3.0, 4.0]]))
    assert first["extra"]["history"] == [{"step": 1}] and first["step"] == 1
    buffer = first["model"]["w"].data_ptr()
    second = stager.stage(state)
    assert second["model"]["w"].data_ptr() == buffer  # the same buffer, new contents
    assert torch.equal(second["model"]["w"], weight) and second["model"]["w"].data_ptr() != weight.data_ptr()
    assert stager.nbytes == (6 + 5) * 4


def test_async_checkpoint_must_be_a_bool():
    with pytest.raises(ValueError, match="async_checkpoint must be a bool, got 'yes'"):
        tandem.TrainerConfig(async_checkpoint="yes")
