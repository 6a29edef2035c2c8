"""Committed step directories (tandem.checkpoint): a checkpoint of several files
is loaded only once every file of it was written, and damage is an error on every
rank naming the file.

- A save SIGKILLed between shard files (ZeRO), after every file was written
  (DCP), or just before its marker (ZeRO): the harness's may_die lets the rank
  die, and the survivor's error names it. A fresh group at another world size
  (3) loads the previous committed step, bit for bit what was saved, and
  continues equal to the run that was never interrupted; the unfinished
  directory is ignored, then removed by the next save. Every rank process of
  every group is gone from /proc afterwards.
- A truncated, corrupt or missing file, ranks at different steps, and shards or
  models that do not fit: the same kind of error on every rank, naming the file
  and the parameter or key; an undamaged load in the same group succeeds.
- ZeRO shards (ZeroOptimizer.save_sharded) and fully_shard state through
  torch.distributed.checkpoint (save/load_sharded_checkpoint) both.
- In one process: keep=N, replacing a step, bad arguments.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tandem
from tandem.checkpoint import MARKER, commit, committed_steps, load_committed, load_sharded_checkpoint, \
    save_committed, save_sharded_checkpoint, step_directory
from tandem.comm.monitor import current_monitor
from tandem.comm.peers import Liveness
from tandem.testing import run_distributed, still_running
from tandem.testing.models import IN, MLP, OUT
from tandem.zero import ZeroOptimizer

TIMEOUT = 60      # seconds per spawned group
TOL = 1e-5        # world 3 against world 2: another order of summation
CAP_MB = 0.0001   # tiny buckets: ZeRO shards cut across parameters and buckets
GLOBAL_BATCH = 12  # splits evenly over 2 and 3 ranks
SAVED, KILLED = 2, 3  # the committed step, and the step whose save is killed


def _batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)
    n = GLOBAL_BATCH // world_size
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, world_size: int) -> None:
    for step in steps:
        opt.zero_grad()
        x, y = _batch(step, rank, world_size)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _zero(seed: int, width: int = 16) -> tuple[nn.Module, nn.Module, ZeroOptimizer]:
    torch.manual_seed(seed)
    model = MLP(width=width)
    ddp = tandem.DistributedDataParallel(model, bucket_cap_mb=CAP_MB, zero_stage=2)
    return model, ddp, ZeroOptimizer(ddp, torch.optim.Adam, lr=0.01)


def _listing(root: Path) -> dict[str, list[str]]:
    return {d.name: sorted(p.name for p in d.iterdir()) for d in sorted(root.iterdir()) if d.is_dir()}


def _record_pid(directory: Path, rank: int) -> None:
    directory.mkdir(exist_ok=True)
    (directory / f"{rank}.pid").write_text(str(os.getpid()))


def _assert_gone(pids: list[int]) -> None:
    """No rank process outlives its group: each pid has left /proc."""
    assert still_running(pids, wait=10.0) == []


# The survivor of a killed rank finds it gone once its beat is stale: a 1 s
# window (as the elastic tests use) instead of the default 2.5 s, set on every rank.
FAST_LIVENESS = Liveness(beat_s=0.25, stale_after_s=1.0)


def _die() -> NoReturn:
    os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("SIGKILL did not end this process")


def _wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def _survivor_error(save: Any) -> str:
    """The error of a rank whose peer is killed during ``save``."""
    try:
        save()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("the save completed although a rank was killed")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


# ---------------------------------------------------------------- a save killed midway
def _zero_save_then_die(rank: int, world_size: int, root: str, kill: str) -> str:
    root_path = Path(root)
    _record_pid(root_path.parent / f"pids-{root_path.name}", rank)
    current_monitor().set_liveness(FAST_LIVENESS)
    model, ddp, opt = _zero(seed=0)
    _train(ddp, opt, range(SAVED), rank, world_size)
    assert opt.save_sharded(root, step=SAVED) == step_directory(root, SAVED)
    expected = opt.state_dict()  # a collective: the consolidated state, on rank 0
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": expected}, f"{root}.expected.pt")
    _train(ddp, opt, range(SAVED, KILLED), rank, world_size)
    if rank == 0:  # the run that is never interrupted, one step on
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{root}.reference.pt")
    partial = step_directory(root, KILLED)
    if kill == "between shard files" and rank == 1:
        def die_once_rank_0_wrote() -> NoReturn:
            _wait_for(partial / "zero-shard-0-of-2.pt")
            _die()
        # rank 1 dies before writing its shard
        opt.sharded_state_dict = die_once_rank_0_wrote  # type: ignore[method-assign]
    elif kill == "before the marker" and rank == 0:
        commit._write_marker = lambda *args: _die()  # every shard written and agreed on
    return _survivor_error(lambda: opt.save_sharded(root, step=KILLED))


def _zero_resume(rank: int, world_size: int, roots: list[str]) -> tuple[int, dict]:
    out = {}
    for root in roots:
        saved = torch.load(f"{root}.expected.pt", weights_only=True)
        model, ddp, opt = _zero(seed=123)  # another initialisation: all must come from the checkpoint
        model.load_state_dict(saved["model"])
        before = _listing(Path(root))
        step = opt.load_sharded(root)
        state = opt.state_dict(to=None)
        _train(ddp, opt, range(SAVED, KILLED), rank, world_size)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        dist.barrier()  # every rank read step SAVED before the next save may prune
        opt.save_sharded(root, step=KILLED + 1)
        dist.barrier()  # rank 0 has cleaned up
        out[root] = {"step": step, "state": state, "params": params, "before": before,
                     "after": _listing(Path(root))}
    return os.getpid(), out


def test_zero_save_killed_midway_leaves_previous_step_loadable(tmp_path: Path) -> None:
    roots = {kill: str(tmp_path / kill.replace(" ", "-")) for kill in ("between shard files", "before the marker")}
    killed_rank = {"between shard files": 1, "before the marker": 0}
    for kill, root in roots.items():
        killed = killed_rank[kill]
        results = run_distributed(_zero_save_then_die, 2, args=(root, kill), timeout=TIMEOUT, may_die={killed})
        assert results[killed] is None  # died without a report: the SIGKILL
        assert f"rank {killed}" in results[1 - killed], results  # the survivor's error names it
        _assert_gone([int(p.read_text()) for p in (tmp_path / f"pids-{Path(root).name}").iterdir()])
        partial = _listing(Path(root))["step-00000003"]
        assert MARKER not in partial
        expected_partial = {"between shard files": ["zero-shard-0-of-2.pt"],
                            "before the marker": ["zero-shard-0-of-2.pt", "zero-shard-1-of-2.pt"]}[kill]
        assert partial == expected_partial, (kill, partial)

    results = run_distributed(_zero_resume, 3, args=(list(roots.values()),), timeout=TIMEOUT)
    _assert_gone([pid for pid, _ in results])
    for kill, root in roots.items():
        expected = torch.load(f"{root}.expected.pt", weights_only=True)["optim"]
        reference = torch.load(f"{root}.reference.pt", weights_only=True)
        for _, out in results:
            r = out[root]
            assert r["step"] == SAVED, kill
            assert "step-00000003" in r["before"] and MARKER not in r["before"]["step-00000003"]
            assert _same(r["state"], expected), kill  # bit for bit what was saved, at world 3
            assert max((r["params"][n] - p).abs().max().item() for n, p in reference.items()) <= TOL
            # The next commit removed the unfinished directory (and kept the older committed one).
            assert sorted(r["after"]) == ["step-00000002", "step-00000004"], r["after"]
            assert r["after"]["step-00000004"] == [MARKER, "zero-shard-0-of-3.pt", "zero-shard-1-of-3.pt",
                                                   "zero-shard-2-of-3.pt"]


# ---------------------------------------------------------------- damage: every rank names the file
def _error(fn: Any) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def _zero_damage(rank: int, world_size: int, root: str) -> tuple[int, dict]:
    model, ddp, opt = _zero(seed=0)
    _train(ddp, opt, range(1), rank, world_size)
    opt.save_sharded(root, step=1)
    _train(ddp, opt, range(1, 2), rank, world_size)
    opt.save_sharded(root, step=2)
    expected = opt.state_dict(to=None)
    step_dir = step_directory(root, 2)
    shard = {r: step_dir / f"zero-shard-{r}-of-2.pt" for r in range(2)}
    backup = {r: p.read_bytes() for r, p in shard.items()}

    def damaged(damage: Any, load: Any) -> tuple[str, str] | None:
        """Rank 0 damages, every rank loads, rank 0 restores."""
        dist.barrier()
        if rank == 0:
            damage()
        dist.barrier()
        error = _error(load)
        dist.barrier()
        if rank == 0:
            for r, p in shard.items():
                p.write_bytes(backup[r])
        dist.barrier()
        return error

    def flip_a_byte() -> None:
        data = bytearray(shard[0].read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard[0].write_bytes(bytes(data))

    out: dict[str, Any] = {}
    nothing = lambda: None  # noqa: E731  (a named no-op damage)
    out["undamaged"] = damaged(nothing, lambda: opt.load_sharded(root))
    out["undamaged state"] = _same(opt.state_dict(to=None), expected)
    out["truncated"] = damaged(lambda: shard[1].write_bytes(shard[1].read_bytes()[:200]),
                               lambda: opt.load_sharded(root))
    out["corrupt"] = damaged(flip_a_byte, lambda: opt.load_sharded(root))
    out["missing"] = damaged(lambda: shard[1].unlink(), lambda: opt.load_sharded(root))
    out["load different steps"] = damaged(nothing, lambda: opt.load_sharded(root, step=1 + rank))
    out["save different steps"] = _error(lambda: opt.save_sharded(root, step=10 + rank))
    out["after the refused save"] = sorted(p.name for p in Path(root).iterdir())
    out["no such step"] = _error(lambda: opt.load_sharded(root, step=7))
    # A model with other shapes: the error names the parameter and the file.
    _, _, wider = _zero(seed=0, width=17)
    out["shape"] = _error(lambda: wider.load_sharded(root))

    # A committed save whose shards hold other state keys (exp_avg renamed on rank 1).
    def write_renamed(directory: Path) -> list[str]:
        sd = opt.sharded_state_dict()
        if rank == 1:
            sd["entries"] = [(i, s, n, {("exp_avg_renamed" if k == "exp_avg" else k): v for k, v in vals.items()})
                             for i, s, n, vals in sd["entries"]]
        name = f"zero-shard-{rank}-of-2.pt"
        torch.save(sd, directory / name)
        return [name]

    save_committed(f"{root}-keys", 0, write_renamed, kind="zero-shards")
    out["state keys"] = _error(lambda: opt.load_sharded(f"{root}-keys"))
    out["kind"] = _error(lambda: load_sharded_checkpoint(root, model))
    return os.getpid(), out


def _expect(out: dict, rank: int, case: str, kind: str, *parts: str) -> None:
    """Rank ``rank`` raised ``kind`` in ``case``, naming itself and every one of ``parts``."""
    assert out[case] is not None, f"rank {rank}: {case}: no error"
    name, message = out[case]
    assert name == kind and message.startswith(f"rank {rank}"), (rank, case, out[case])
    for part in parts:
        assert part in message, (rank, case, part, message)


def test_damaged_zero_checkpoint_raises_on_every_rank_naming_the_file(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results = run_distributed(_zero_damage, 2, args=(str(root),), timeout=TIMEOUT)
    _assert_gone([pid for pid, _ in results])
    shard = {r: step_directory(root, 2) / f"zero-shard-{r}-of-2.pt" for r in range(2)}
    for rank, (_, out) in enumerate(results):
        assert out["undamaged"] is None and out["undamaged state"], out["undamaged"]
        expect = functools.partial(_expect, out, rank)
        expect("truncated", "CheckpointError", f"{shard[1]}: truncated: 200 of ",
               "load step 1, the previous committed one")
        expect("corrupt", "CheckpointError", f"{shard[0]}: corrupt: CRC-32")
        expect("missing", "CheckpointError", f"{shard[1]}: missing")
        expect("load different steps", "CheckpointError", "different steps", "rank 0: 1, rank 1: 2")
        expect("save different steps", "CheckpointError", "different steps", "rank 0: 10, rank 1: 11")
        assert out["after the refused save"] == ["step-00000001", "step-00000002"]  # nothing touched
        expect("no such step", "FileNotFoundError", "no committed checkpoint for step 7",
               "step-00000001, step-00000002")
        expect("shape", "ValueError", "parameter 'layers.0.0.weight'", "has shape (16, 8) in the checkpoint",
               "(17, 8) in the model", str(shard[0]))
        expect("state keys", "ValueError", "'exp_avg_renamed'", "zero-shard-1-of-2.pt", "zero-shard-0-of-2.pt")
        expect("kind", "CheckpointError", "holds a 'zero-shards' checkpoint, expected 'dcp'")
    # Nothing was committed by the refused save, and the damage was undone.
    assert committed_steps(root) == [1, 2]


# ---------------------------------------------------------------- fully_shard through DCP
class _Net(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, hidden)
        self.out = nn.Linear(hidden, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


def _sharded(seed: int, hidden: int = 16) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _Net(hidden)
    tandem.fully_shard(model.inp, min_unit_bytes=0)
    tandem.fully_shard(model, min_unit_bytes=0)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items()}  # a collective


def _dcp_save_then_die(rank: int, world_size: int, root: str) -> str:
    _record_pid(Path(root).parent / "pids-dcp", rank)
    current_monitor().set_liveness(FAST_LIVENESS)
    model, opt = _sharded(seed=0)
    _train(model, opt, range(SAVED), rank, world_size)
    save_sharded_checkpoint(root, model, opt, step=SAVED)
    expected = _full(model)
    _train(model, opt, range(SAVED, KILLED), rank, world_size)
    reference = _full(model)
    if rank == 0:
        torch.save({"expected": expected, "reference": reference}, f"{root}.expected.pt")
    if rank == 1:  # DCP has written every file; rank 1 dies measuring them
        commit.file_crc32 = lambda *args: _die()
    return _survivor_error(lambda: save_sharded_checkpoint(root, model, opt, step=KILLED))


def _dcp_resume(rank: int, world_size: int, root: str) -> tuple[int, dict]:
    out: dict[str, Any] = {}
    model, opt = _sharded(seed=123)
    out["step"] = load_sharded_checkpoint(root, model, opt)
    out["loaded"] = _full(model)
    _train(model, opt, range(SAVED, KILLED), rank, world_size)
    out["continued"] = _full(model)

    distcp = sorted(step_directory(root, SAVED).glob("__*.distcp"))[-1]
    backup = distcp.read_bytes()
    dist.barrier()
    if rank == 0:
        distcp.write_bytes(backup[:len(backup) // 2])
    dist.barrier()
    out["truncated"] = _error(lambda: load_sharded_checkpoint(root, *_sharded(seed=1)))
    dist.barrier()
    if rank == 0:
        distcp.write_bytes(backup)
    dist.barrier()  # restored before any rank reads it again
    out["truncated file"] = str(distcp)
    out["shape"] = _error(lambda: load_sharded_checkpoint(root, *_sharded(seed=1, hidden=17)))
    model_only = f"{root}-model-only"
    save_sharded_checkpoint(model_only, model, step=0)
    fresh, _ = _sharded(seed=1)
    out["model only"] = load_sharded_checkpoint(model_only, fresh), _full(fresh)
    out["no optimizer state"] = _error(lambda: load_sharded_checkpoint(model_only, *_sharded(seed=1)))
    dist.barrier()
    save_sharded_checkpoint(root, model, opt, step=KILLED + 1, keep=1)
    dist.barrier()  # rank 0 has cleaned up
    out["after"] = _listing(Path(root))
    return os.getpid(), out


def test_fully_shard_checkpoint_killed_midway_and_damaged(tmp_path: Path) -> None:
    root = tmp_path / "dcp"
    results = run_distributed(_dcp_save_then_die, 2, args=(str(root),), timeout=TIMEOUT, may_die={1})
    assert results[1] is None and "rank 1" in results[0], results
    _assert_gone([int(p.read_text()) for p in (tmp_path / "pids-dcp").iterdir()])
    partial = _listing(root)["step-00000003"]
    assert MARKER not in partial and {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(partial), partial
    assert committed_steps(root) == [SAVED]

    saved = torch.load(f"{root}.expected.pt", weights_only=True)
    results = run_distributed(_dcp_resume, 3, args=(str(root),), timeout=TIMEOUT)
    _assert_gone([pid for pid, _ in results])
    for rank, (_, out) in enumerate(results):
        assert out["step"] == SAVED
        assert _same(out["loaded"], saved["expected"])  # saved on 2 ranks, loaded on 3, bit for bit
        assert max((out["continued"][k] - v).abs().max().item() for k, v in saved["reference"].items()) <= TOL
        name, message = out["truncated"]
        assert name == "CheckpointError" and f"{out['truncated file']}: truncated" in message, message
        name, message = out["shape"]
        assert name == "CheckpointError" and "'inp.weight' has shape (16, 8) in the checkpoint, (17, 8)" in message
        assert message.startswith(f"rank {rank}"), message
        step, params = out["model only"]
        assert step == 0 and _same(params, out["continued"])
        _expect(out, rank, "no optimizer state", "CheckpointError", "holds no optimizer state")
        # keep=1: the new step alone; the unfinished step 3 is gone too.
        assert list(out["after"]) == ["step-00000004"], out["after"]


# ---------------------------------------------------------------- one process
def _writer(payloads: dict[str, bytes]) -> Any:
    def write(directory: Path) -> list[str]:
        for name, data in payloads.items():
            (directory / name).write_bytes(data)
        return list(payloads)
    return write


def test_keep_replace_and_unfinished_in_one_process(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for step in (1, 2, 3):
        save_committed(root, step, _writer({"a.bin": bytes([step]) * 10}), kind="test")
    marker = json.loads((step_directory(root, 3) / MARKER).read_text())
    assert marker["step"] == 3 and marker["world_size"] == 1 and marker["kind"] == "test"
    assert marker["files"]["a.bin"]["size"] == 10

    def failing(directory: Path) -> list[str]:
        (directory / "a.bin").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_committed(root, 4, failing, kind="test")
    assert committed_steps(root) == [1, 2, 3] and (step_directory(root, 4) / "a.bin").exists()
    assert load_committed(root).step == 3  # the unfinished step 4 is not a candidate

    # Replacing a committed step: a fresh directory, no file of the old save left.
    save_committed(root, 3, _writer({"b.bin": b"new"}), kind="test")
    assert sorted(p.name for p in step_directory(root, 3).iterdir()) == [MARKER, "b.bin"]
    save_committed(root, 5, _writer({"a.bin": b"five"}), kind="test", keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003", "step-00000005"]
    ckpt = load_committed(root, kind="test")
    assert ckpt.step == 5 and ckpt.path("a.bin").read_bytes() == b"five"
    # keep=1 below a newer step: the step just saved is kept all the same.
    save_committed(root, 4, _writer({"a.bin": b"four"}), kind="test", keep=1)
    assert committed_steps(root) == [4, 5]

    with pytest.raises(FileNotFoundError, match="no committed checkpoint in .*the directory does not exist"):
        load_committed(tmp_path / "nothing")


@pytest.mark.parametrize("kwargs, match", [
    ({"step": -1}, "step must be an int >= 0, got -1"),
    ({"step": 1.5}, "step must be an int >= 0, got 1.5"),
    ({"step": 1, "keep": 0}, "keep must be None or an int >= 1, got 0"),
])
def test_bad_arguments_name_the_value(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        save_committed(tmp_path, write=_writer({}), kind="test", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_writer_must_name_plain_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must return the plain names"):
        save_committed(tmp_path, 1, lambda d: ["../escape.bin"], kind="test")
    assert committed_steps(tmp_path) == []
