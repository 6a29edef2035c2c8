"""The Trainer's sharded checkpoints (Note [sharded trainer checkpoints] in
tandem/train/sharded_checkpoint.py), for a fully-sharded model and for ZeRO-2
(sharded by default), and for plain DDP with checkpoint_format="sharded".

One story per model, in four spawned groups:
- world 2: an uninterrupted run (the reference), a run stopped at step 5 (a
  sharded checkpoint, the default), and the same run saving the old full format;
- world 2, fully_shard and ZeRO: the stopped run resumed to step 7, whose save
  is SIGKILLed between DCP files (one rank waits for the other's file, then
  dies): the survivor raises, step 7 has no commit marker;
- world 3: the stopped runs resumed (the sharded one past its unfinished step 7,
  the full one from its .pt file) to the end: equal to the uninterrupted world-2
  run. The global batch stays 12 (6 x 2 ranks, 4 x 3 ranks), so by Note [equal
  to one process] every world size trains like one process on it; without
  dropout the RNG streams do not matter (the precedent: tests/train/test_trainer.py's
  fully-sharded run resumed by one process).

Checked in this process, from the files: torch's own dcp_to_torch_save reads a
sharded checkpoint as the full-format checkpoint of the same step (model and
Adam state); each rank's .distcp file holds exactly that rank's shard of every
sharded tensor (fully_shard: its rows; ZeRO: its flat ranges, from the bucket
layout); during a sharded save rank 0 creates no tensor of a full parameter's
shape (the full-format save does: the check can fail) and a ZeroOptimizer never
consolidates.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import TensorDataset

import tandem
from tandem.checkpoint import MARKER, committed_steps
from tandem.checkpoint.flat import flat_boxes
from tandem.comm.monitor import current_monitor
from tandem.comm.peers import Liveness
from tandem.testing import run_distributed, start_concurrently

NUM_FEATURES, HIDDEN, NUM_CLASSES = 6, 17, 3  # 17 rows: uneven shards on 2 and 3 ranks
N_TRAIN, GLOBAL_BATCH = 96, 12
STOP, KILLED, TOTAL = 5, 7, 16  # 8 steps per epoch, 2 epochs
TOL = 1e-5  # world 3 after world 2: another order of summation
KINDS = ("fsdp", "zero", "ddp")  # ddp: a plain model, checkpoint_format="sharded" asked for
SHARDED_KINDS = ("fsdp", "zero")  # sharded by default
TIMEOUT = 120
FAST_LIVENESS = Liveness(beat_s=0.25, stale_after_s=1.0)  # a killed rank found in 1 s, not 2.5 s


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N_TRAIN, NUM_FEATURES, generator=g)
    y = (x[:, :NUM_CLASSES] * 2 + 0.3 * torch.randn(N_TRAIN, NUM_CLASSES, generator=g)).argmax(1)
    return TensorDataset(x, y)


def _model(kind: str, init_seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    tandem.seed_everything(init_seed)
    model = nn.Sequential(nn.Linear(NUM_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, NUM_CLASSES))
    if kind == "zero":  # tiny buckets: shards cut across parameters and buckets
        ddp = tandem.DistributedDataParallel(model, zero_stage=2, bucket_cap_mb=0.0005)
        return ddp, tandem.ZeroOptimizer(ddp, torch.optim.Adam, lr=0.05)
    if kind == "ddp":  # the Trainer wraps it
        return model, torch.optim.Adam(model.parameters(), lr=0.05)
    for layer in model:
        if isinstance(layer, nn.Linear):
            tandem.fully_shard(layer, min_unit_bytes=0)
    tandem.fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # a collective for DTensors


class _Shapes(TorchDispatchMode):
    """The shapes of the plain floating-point tensors that ops create."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if type(t) is torch.Tensor and t.is_floating_point():
                self.shapes.add(tuple(t.shape))
        return out


def _train(rank: int, world_size: int, output_dir: str, kind: str, *, init_seed: int = 0,
           watch_save: bool = False, export: str | None = None, **options: Any) -> dict[str, Any]:
    model, optimizer = _model(kind, init_seed)
    if kind == "ddp":
        options.setdefault("checkpoint_format", "sharded")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    config = tandem.TrainerConfig(output_dir=output_dir, epochs=2, batch_size=GLOBAL_BATCH // world_size,
                                  max_grad_norm=0.5, log_every=1, plot=False, progress=False, **options)
    trainer = tandem.Trainer(model, optimizer, _data(), nn.functional.cross_entropy,
                             scheduler=scheduler, config=config)
    out: dict[str, Any] = {"shapes": set(), "consolidations": 0}
    if watch_save:
        save, state_dict = trainer._save, optimizer.state_dict

        def counted_state_dict(*args: Any, **kwargs: Any) -> Any:
            out["consolidations"] += 1
            return state_dict(*args, **kwargs)

        def watched_save(history: Any) -> Path:
            optimizer.state_dict = counted_state_dict  # type: ignore[method-assign]
            with _Shapes() as mode:
                path = save(history)
            optimizer.state_dict = state_dict  # type: ignore[method-assign]
            out["shapes"] |= mode.shapes
            return path

        trainer._save = watched_save  # type: ignore[method-assign]
    result = trainer.fit()
    module = getattr(trainer.model, "module", trainer.model)
    out.update(steps=result.steps, checkpoint=str(result.checkpoint),
               params={k: _full(v).detach().clone() for k, v in module.state_dict().items()},
               losses=[(r["step"], r["loss"]) for r in result.history if r["kind"] == "train"])
    if kind == "zero":  # the bucket layout's flat ranges of each parameter this rank owns
        ddp = trainer.model
        assert isinstance(ddp, tandem.DistributedDataParallel) and ddp.reducer is not None
        assert isinstance(optimizer, tandem.ZeroOptimizer)
        names = ddp.reducer.names
        out["owned"] = {}
        for run in optimizer.shards.runs:
            for p in run.pieces:
                out["owned"].setdefault(names[p.param], []).append((p.param_start, p.length))
    if export is not None:
        out["exported"] = str(trainer.export(export))
    return out


# ---------------------------------------------------------------- the spawned groups
def _at_world_2(rank: int, world_size: int, base: str) -> dict[str, Any]:
    out = {}
    for kind in KINDS:
        out[kind] = {"full": _train(rank, world_size, f"{base}/{kind}-full", kind),
                     "first": _train(rank, world_size, f"{base}/{kind}-parted", kind, max_steps=STOP,
                                     watch_save=True),
                     "old": _train(rank, world_size, f"{base}/{kind}-old", kind, max_steps=STOP,
                                   checkpoint_format="full", watch_save=True)}
    return out


def _killed_between_files(rank: int, world_size: int, base: str, kind: str, victim: int) -> str:
    """Resume the stopped run to step KILLED; its save dies on ``victim`` once the
    other rank's DCP file is there (the victim's own never is)."""
    import torch.distributed.checkpoint as dcp

    current_monitor().set_liveness(FAST_LIVENESS)  # the survivor finds the victim gone in 1 s
    other = f"__{1 - victim}_0.distcp"
    partial = Path(f"{base}/{kind}-parted/checkpoints/step-{KILLED:08d}")
    if rank == victim:
        def die_once_the_other_wrote(self: Any, plan: Any, planner: Any) -> Any:
            deadline = time.monotonic() + 30
            while not (partial / other).exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        dcp.FileSystemWriter.write_data = die_once_the_other_wrote  # type: ignore[method-assign]
    try:
        _train(rank, world_size, f"{base}/{kind}-parted", kind, max_steps=KILLED)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("the save completed although a rank was killed")


def _at_world_3(rank: int, world_size: int, base: str) -> dict[str, Any]:
    out = {}
    for kind in KINDS:
        parted = Path(f"{base}/{kind}-parted/checkpoints")
        before = sorted(p.name for p in parted.iterdir())
        # Another initialisation: everything must come from the checkpoints.
        second = _train(rank, world_size, f"{base}/{kind}-parted", kind, init_seed=1,
                        export=f"{base}/{kind}-exported.pt")
        out[kind] = {"before": before, "second": second,
                     "after": sorted(p.name for p in parted.iterdir()),
                     "old": _train(rank, world_size, f"{base}/{kind}-old", kind, init_seed=1)}
    return out


@functools.cache
def _results(base: str) -> dict[str, Any]:
    two = run_distributed(_at_world_2, 2, args=(base,), timeout=TIMEOUT)
    for kind in KINDS:  # kept aside: the resumed runs prune them
        shutil.copytree(f"{base}/{kind}-parted/checkpoints/step-{STOP:08d}", f"{base}/{kind}-sharded-{STOP}")
        shutil.copy(f"{base}/{kind}-old/checkpoints/step-{STOP:08d}.pt", f"{base}/{kind}-full-{STOP}.pt")
    # The two kinds' killed saves, at once: each mostly waits for its victim to be found gone.
    with start_concurrently({kind: functools.partial(run_distributed, _killed_between_files, 2,
                                                     args=(base, kind, victim), timeout=TIMEOUT, may_die={victim})
                             for kind, victim in (("fsdp", 1), ("zero", 0))}) as runs:
        killed = {kind: run.result() for kind, run in runs.items()}
    partial = {kind: sorted(p.name for p in Path(f"{base}/{kind}-parted/checkpoints/step-{KILLED:08d}").iterdir())
               for kind in SHARDED_KINDS}
    three = run_distributed(_at_world_3, 3, args=(base,), timeout=TIMEOUT)
    return {"two": two, "killed": killed, "partial": partial, "three": three}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    base = tmp_path_factory.mktemp("sharded-trainer")
    return base, _results(str(base))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ---------------------------------------------------------------- equal to uninterrupted training
@pytest.mark.parametrize("kind", KINDS)
def test_saved_at_world_2_resumed_at_world_3_equals_uninterrupted_training(results, kind):
    _, r = results
    full = r["two"][0][kind]["full"]
    assert r["two"][0][kind]["first"]["steps"] == STOP
    assert Path(r["two"][0][kind]["first"]["checkpoint"]).name == f"step-{STOP:08d}"  # a directory
    for rank in range(3):
        second = r["three"][rank][kind]["second"]
        assert second["steps"] == full["steps"] == TOTAL
        assert _max_diff(second["params"], full["params"]) <= TOL
    # The records after the resume: the same steps, the same global-batch losses.
    resumed = r["three"][0][kind]["second"]["losses"]
    assert [s for s, _ in resumed] == [s for s, _ in full["losses"]]  # history restored, then continued
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in full["losses"]], abs=TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_an_old_full_state_checkpoint_resumes_and_the_run_continues_sharded(results, kind):
    base, r = results
    full = r["two"][0][kind]["full"]
    assert Path(r["two"][0][kind]["old"]["checkpoint"]).name == f"step-{STOP:08d}.pt"
    for rank in range(3):
        old = r["three"][rank][kind]["old"]
        assert old["steps"] == TOTAL and _max_diff(old["params"], full["params"]) <= TOL
    # keep_checkpoints=2 across both formats: the .pt file was pruned by the sharded saves.
    names = sorted(p.name for p in (base / f"{kind}-old" / "checkpoints").iterdir())
    assert names == ["step-00000008", "step-00000016"]


# ---------------------------------------------------------------- a save killed between files
@pytest.mark.parametrize("kind", SHARDED_KINDS)
def test_a_save_killed_between_files_leaves_the_previous_checkpoint_loadable(results, kind):
    base, r = results
    victim = {"fsdp": 1, "zero": 0}[kind]
    outcomes = r["killed"][kind]
    assert outcomes[victim] is None  # SIGKILLed, no report
    assert outcomes[1 - victim] is not None  # the survivor raised instead of hanging
    # Rank 0 wrote trainer.pt before DCP started; only the survivor's DCP file is there.
    assert r["partial"][kind] == sorted(["trainer.pt", f"__{1 - victim}_0.distcp"])
    # World 3 resumed from step 5, not the unfinished step 7, which its first save removed.
    assert f"step-{KILLED:08d}" in r["three"][0][kind]["before"]
    assert f"step-{KILLED:08d}" not in r["three"][0][kind]["after"]
    assert committed_steps(base / f"{kind}-parted" / "checkpoints") == [8, 16]
    assert MARKER not in r["partial"][kind]


# ---------------------------------------------------------------- what the files hold
def _read_sharded(directory: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = directory.parent / f"{directory.name}.as-one-file.pt"
    if not out.exists():
        dcp_to_torch_save(directory, out)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("kind", KINDS)
def test_torch_reads_a_sharded_checkpoint_as_the_full_one_of_the_same_step(results, kind):
    base, _ = results
    sharded = _read_sharded(base / f"{kind}-sharded-{STOP}")
    full = torch.load(base / f"{kind}-full-{STOP}.pt", weights_only=True)
    assert _max_diff(sharded["model"], full["model"]) == 0
    names = list(full["model"])  # the parameters' names, in the optimizer's order (no buffers)
    assert sharded["optim"]["state"].keys() == {names[i] for i in full["optimizer"]["state"]}
    for i, state in full["optimizer"]["state"].items():
        ours = sharded["optim"]["state"][names[i]]
        assert ours.keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(ours[key]), torch.as_tensor(value)), (names[i], key)
    assert [g["lr"] for g in sharded["optim"]["param_groups"]] == [g["lr"] for g in full["optimizer"]["param_groups"]]
    assert [g["params"] for g in sharded["optim"]["param_groups"]] == [names]


def _elements_by_file(directory: Path) -> dict[str, dict[int, set[int]]]:
    """Key -> rank -> the elements (row-major indices) its .distcp file holds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    metadata = dcp.FileSystemReader(directory).read_metadata()
    out: dict[str, dict[int, set[int]]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata) or len(md.size) == 0:
            continue
        index = torch.arange(math.prod(md.size)).view(md.size)
        for chunk in md.chunks:
            where = metadata.storage_data[MetadataIndex(key, chunk.offsets)].relative_path
            rank = int(where.split("_")[2])  # __{rank}_{i}.distcp
            box = index[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]
            out.setdefault(key, {}).setdefault(rank, set()).update(box.flatten().tolist())
    return out


def _rows(n_rows: int, width: int, rank: int, world: int) -> set[int]:
    """fully_shard's dim-0 slice of rank ``rank`` (torch.chunk's split), as elements."""
    per = math.ceil(n_rows / world)
    return set(range(min(n_rows, rank * per) * width, min(n_rows, (rank + 1) * per) * width))


@pytest.mark.parametrize("kind", KINDS)
def test_each_rank_writes_only_its_own_shard(results, kind):
    base, r = results
    found = _elements_by_file(base / f"{kind}-sharded-{STOP}")
    shapes = {k: tuple(v.shape) for k, v in r["two"][0][kind]["full"]["params"].items()}
    for name, shape in shapes.items():
        width = math.prod(shape[1:])
        for key in ("exp_avg", "exp_avg_sq"):
            if kind == "ddp":  # replicated: written once, by one rank
                assert len(found[f"optim.state.{name}.{key}"]) == 1
                continue
            if kind == "fsdp":
                expected = {rank: _rows(shape[0], width, rank, 2) for rank in range(2)}
            else:
                expected = {rank: {e for start, n in r["two"][rank][kind]["first"]["owned"].get(name, [])
                                   for e in range(start, start + n)} for rank in range(2)}
            expected = {rank: e for rank, e in expected.items() if e}
            assert found[f"optim.state.{name}.{key}"] == expected, (name, key)
        if kind == "fsdp":
            assert found[f"model.{name}"] == {rank: _rows(shape[0], width, rank, 2) for rank in range(2)
                                              if _rows(shape[0], width, rank, 2)}
        else:  # replicated: written once, by one rank
            assert len(found[f"model.{name}"]) == 1


@pytest.mark.parametrize("kind", SHARDED_KINDS)
def test_rank_0_never_holds_the_full_state_during_a_sharded_save(results, kind):
    _, r = results
    first, old = r["two"][0][kind]["first"], r["two"][0][kind]["old"]
    if kind == "zero":  # ZeroOptimizer.state_dict() is what gathers its shards
        assert first["consolidations"] == 0 and old["consolidations"] == 1
    else:
        full_shapes = {(HIDDEN, NUM_FEATURES), (NUM_CLASSES, HIDDEN), (HIDDEN,)}
        assert not first["shapes"] & full_shapes, first["shapes"]
        assert old["shapes"] & full_shapes  # the check can fail: the full format gathers


def test_export_writes_the_full_state_that_a_plain_model_loads(results):
    base, r = results
    for kind in KINDS:
        exported = torch.load(base / f"{kind}-exported.pt", weights_only=True)
        assert _max_diff(exported["model"], r["three"][0][kind]["second"]["params"]) == 0
        model = nn.Sequential(nn.Linear(NUM_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, NUM_CLASSES))
        model.load_state_dict(exported["model"])
        torch.optim.Adam(model.parameters()).load_state_dict(exported["optimizer"])


# ---------------------------------------------------------------- one process
@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (), (1, 7), (4, 1, 3)])
def test_flat_ranges_are_unions_of_contiguous_boxes(shape):
    numel = math.prod(shape)
    reference = torch.arange(numel).view(shape)
    for start in range(numel + 1):
        for stop in range(start, numel + 1):
            boxes = flat_boxes(shape, start, stop - start)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
            position = 0
            for (offsets, sizes), at in boxes:
                assert at == position
                block = reference[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                assert block.flatten().tolist() == list(range(start + at, start + at + block.numel()))
                position += block.numel()
            assert position == stop - start
    with pytest.raises(ValueError, match="outside a tensor of shape"):
        flat_boxes(shape, 0, numel + 1)


def test_bad_checkpoint_format_names_the_value():
    with pytest.raises(ValueError, match="checkpoint_format") as info:
        tandem.TrainerConfig(checkpoint_format="sharded-ish")
    assert "'sharded-ish'" in str(info.value)
