"""Checkpoints (tandem.checkpoint.one_rank) and exact resume (tandem.checkpoint.state).

- A save killed by SIGKILL in the middle of writing, or failing in torch.save,
  leaves the previous file loadable and equal to what was saved.
- save_checkpoint writes on rank 0 only and returns on every rank once the file is
  complete; a failed write is an error on every rank, not a hang.
- A run resumed from a TrainingState checkpoint, in fresh objects with another
  initialisation and other random streams, reaches the parameters of the run that
  was never interrupted, dropout included; the reference is that uninterrupted run,
  and a resume that leaves out the random streams must not reach it.

The two-rank checks run in one spawned group (see ``distributed``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tandem
from tandem.testing import max_abs_diff, run_distributed
from tandem.testing.models import IN, OUT
from tandem.checkpoint.one_rank import atomic_save, checkpoint_name, latest_checkpoint, list_checkpoints, \
    load_checkpoint, save_checkpoint
from tandem.checkpoint.rng import seed_everything
from tandem.checkpoint.state import TrainingState
from tandem.zero import ZeroOptimizer

TOL = 1e-6
CAP_MB = 0.0001  # tiny buckets: the small model makes several, and ZeRO shards cut across them
BATCH = 4        # per rank
K, M = 3, 4      # steps before the checkpoint, steps after it


def _small(step: int) -> dict[str, Any]:
    return {"step": step, "w": torch.arange(6.0).reshape(2, 3) * step, "name": f"after step {step}"}


def _same(a: Any, b: Any) -> bool:
    """Equal nested containers of tensors (bitwise) and plain values."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ---------------------------------------------------------------- atomic_save
_WRITER = """
import sys, torch
from tandem.checkpoint.one_rank import atomic_save
atomic_save({f"t{i}": torch.full((2_500_000,), float(i)) for i in range(20)}, sys.argv[1])  # 200 MB
"""


def _wait_until_writing(tmp: Path, child: subprocess.Popen, timeout: float) -> int:
    """The size of ``tmp`` once the child has written 1 MiB of it (of 200 MB)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            pytest.fail(f"the writer exited (code {child.returncode}) before it could be killed")
        try:
            size = tmp.stat().st_size
        except FileNotFoundError:
            size = 0
        if size >= 2**20:
            return size
        time.sleep(0.001)
    pytest.fail(f"{tmp.name} did not appear and grow within {timeout}s")


def test_save_killed_while_writing_leaves_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    atomic_save(_small(1), path)
    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)])
    try:
        tmp = tmp_path / f".ckpt.pt.tmp-{child.pid}"
        written = _wait_until_writing(tmp, child, timeout=60)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert tmp.stat().st_size >= written, "the killed save's partial file should still be there"
    assert _same(load_checkpoint(path), _small(1))

    atomic_save(_small(2), path)
    assert _names(tmp_path) == ["ckpt.pt"], "the next save removes the stray temporary file"
    assert _same(load_checkpoint(path), _small(2))


def test_failed_save_keeps_previous_checkpoint_and_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    atomic_save(_small(1), path)
    with pytest.raises(TypeError, match="pickle"):
        atomic_save({"w": torch.ones(1000), "lock": threading.Lock()}, path)
    assert _names(tmp_path) == ["ckpt.pt"]
    assert _same(load_checkpoint(path), _small(1))


def test_atomic_save_creates_missing_directories(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "ckpt.pt"
    assert atomic_save(_small(3), path) == path
    assert _same(torch.load(path, weights_only=True), _small(3))


# ---------------------------------------------------------------- finding checkpoints
def test_list_and_latest_order_by_step_and_ignore_other_files(tmp_path: Path) -> None:
    assert list_checkpoints(tmp_path / "missing") == [] and latest_checkpoint(tmp_path / "missing") is None
    assert list_checkpoints(tmp_path) == [] and latest_checkpoint(tmp_path) is None
    for name in ["step-00000010.pt", "step-9.pt", "step-1.pt", ".step-00000011.pt.tmp-4242",
                 "step-00000012.pt.tmp", "step-x.pt", "step-13.pth", "latest.pt", "notes.txt"]:
        (tmp_path / name).write_bytes(b"")
    expected = [tmp_path / n for n in ["step-1.pt", "step-9.pt", "step-00000010.pt"]]
    assert list_checkpoints(tmp_path) == expected
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000010.pt"
    assert checkpoint_name(14) == "step-00000014.pt"
    atomic_save(_small(14), tmp_path / checkpoint_name(14))
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000014.pt"


def test_load_missing_checkpoint_names_path_and_directory_contents(tmp_path: Path) -> None:
    atomic_save(_small(1), tmp_path / "step-1.pt")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    missing = tmp_path / "step-2.pt"
    with pytest.raises(FileNotFoundError) as info:
        load_checkpoint(missing)
    assert str(missing) in str(info.value) and "step-1.pt" in str(info.value)
    nowhere = tmp_path / "no-such-dir" / "step-1.pt"
    with pytest.raises(FileNotFoundError, match="no .pt files") as info:
        load_checkpoint(nowhere)
    assert str(nowhere) in str(info.value)


# ---------------------------------------------------------------- two ranks
def _dropout_net() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, 32), nn.Tanh(), nn.Dropout(0.5), nn.Linear(32, OUT))


def _payload() -> dict[str, Any]:
    """Large enough (8 MB) that a rank returning before rank 0 finished writing
    would find no file, or a partial one."""
    return {"w": torch.arange(2_000_000, dtype=torch.float32), "step": 7, "name": "payload"}


def _save_on_rank_0(rank: int, directory: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    good = directory / "good.pt"
    out["returned"] = save_checkpoint(_payload() if rank == 0 else None, good)
    out["loaded_at_return"] = _same(load_checkpoint(good), _payload())
    # Only rank 0's object is written, whatever the others pass.
    decoy = directory / "decoy.pt"
    save_checkpoint(_small(1) if rank == 0 else _small(2), decoy)
    out["decoy"] = _same(load_checkpoint(decoy), _small(1))
    try:  # rank 0 cannot replace a directory with a file
        save_checkpoint(_payload() if rank == 0 else None, directory / "a-directory")
        out["error"] = None
    except Exception as e:
        out["error"] = (type(e).__name__, str(e))
    after = torch.tensor([rank + 1.0])
    dist.all_reduce(after)  # the ranks are still in step
    out["after"] = after.item()
    return out


def _setup(zero: bool, init_seed: int) -> tuple[nn.Module, nn.Module, Any, Any]:
    torch.manual_seed(init_seed)
    model = _dropout_net()
    ddp = tandem.DistributedDataParallel(model, bucket_cap_mb=CAP_MB, zero_stage=1 if zero else 0)
    opt = (ZeroOptimizer(ddp, torch.optim.Adam, lr=0.01) if zero
           else torch.optim.Adam(model.parameters(), lr=0.01))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, ddp, opt, sched


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(model: nn.Module, ddp: nn.Module, opt: Any, sched: Any, steps: range,
           rank: int) -> list[dict[str, torch.Tensor]]:
    """Parameters after each step; dropout draws from the global torch generator."""
    record = []
    for step in steps:
        opt.zero_grad()
        x, y = _batch(step, rank)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        sched.step()
        record.append(_params(model))
    return record


def _worst(a: list[dict], b: list[dict]) -> float:
    return max(max_abs_diff(x, y) for x, y in zip(a, b))


def _resume(rank: int, world_size: int, path: Path, zero: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model, ddp, opt, sched = _setup(zero, init_seed=0)
    seed_everything(0, per_rank=True)  # dropout masks differ between ranks
    _train(model, ddp, opt, sched, range(K), rank)
    out["rng_at_save"] = torch.get_rng_state()
    out["lr_at_save"] = sched.get_last_lr()
    saved = _params(model)
    state = TrainingState(ddp, opt, sched, step=K, epoch=1, consumed=K * BATCH * world_size,
                          extra={"note": "k steps"}).state_dict()
    out["got_state"] = state is not None
    save_checkpoint(state, path)
    reference = _train(model, ddp, opt, sched, range(K, K + M), rank)

    model, ddp, opt, sched = _setup(zero, init_seed=1)
    seed_everything(1, per_rank=True)
    out["fresh_differs"] = max_abs_diff(_params(model), saved) > 0.01
    loaded = load_checkpoint(path)
    resumed = TrainingState(ddp, opt, sched)
    resumed.load_state_dict(loaded)
    out["counters"] = (resumed.step, resumed.epoch, resumed.consumed, resumed.extra)
    out["rng_restored"] = torch.get_rng_state()
    out["lr_restored"] = sched.get_last_lr()
    out["model_restored"] = max_abs_diff(_params(model), saved)
    if zero:
        consolidated = opt.state_dict(to=None)
        out["optimizer_round_trip"] = _same(consolidated["state"], loaded["optimizer"]["state"])
    out["resume_diff"] = _worst(reference, _train(model, ddp, opt, sched, range(K, K + M), rank))

    # Control: everything but the random streams restored, so dropout draws other masks.
    model, ddp, opt, sched = _setup(zero, init_seed=2)
    seed_everything(2, per_rank=True)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    sched.load_state_dict(loaded["scheduler"])
    out["control_diff"] = _worst(reference, _train(model, ddp, opt, sched, range(K, K + M), rank))
    return out


def _two_ranks(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    root = Path(directory)
    return {"save": _save_on_rank_0(rank, root),
            "adam": _resume(rank, world_size, root / "adam.pt", zero=False),
            "zero": _resume(rank, world_size, root / "zero.pt", zero=True)}


@pytest.fixture(scope="module")
def distributed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("checkpoints")
    (directory / "a-directory").mkdir()
    return directory, run_distributed(_two_ranks, 2, args=(str(directory),), timeout=90)


def test_save_checkpoint_writes_on_rank_0_and_returns_when_complete(distributed) -> None:
    directory, results = distributed
    for rank, r in enumerate(results):
        save = r["save"]
        assert save["returned"] == directory / "good.pt"
        assert save["loaded_at_return"], f"rank {rank} found the checkpoint incomplete"
        assert save["decoy"], f"rank {rank}: the file holds another rank's object"
        assert save["after"] == 3.0
    assert _same(torch.load(directory / "good.pt", weights_only=True), _payload())
    assert sorted(p.name for p in directory.iterdir() if p.name.startswith(".")) == []


def test_failed_write_on_rank_0_is_an_error_on_every_rank(distributed) -> None:
    directory, results = distributed
    own, other = results[0]["save"]["error"], results[1]["save"]["error"]
    assert own is not None and own[0] == "IsADirectoryError", own
    assert other is not None and other[0] == "RuntimeError" and "rank 0" in other[1], other
    assert (directory / "a-directory").is_dir() and not any((directory / "a-directory").iterdir())


@pytest.mark.parametrize("kind", ["adam", "zero"])
def test_resume_reaches_the_uninterrupted_parameters(distributed, kind: str) -> None:
    directory, results = distributed
    file = torch.load(directory / f"{kind}.pt", weights_only=True)
    assert file["format"] == "tandem.training_state/1" and len(file["rng"]) == 2
    ours, theirs = (r[kind] for r in results)
    assert [ours["got_state"], theirs["got_state"]] == [True, False]
    assert not torch.equal(ours["rng_at_save"], theirs["rng_at_save"])
    for rank, r in enumerate(results):
        r = r[kind]
        assert r["fresh_differs"], f"rank {rank}: the fresh model starts where the saved one was"
        assert r["counters"] == (K, 1, K * BATCH * 2, {"note": "k steps"})
        assert torch.equal(r["rng_restored"], r["rng_at_save"]), f"rank {rank}: RNG not restored"
        assert r["lr_restored"] == r["lr_at_save"]
        assert r["model_restored"] == 0.0
        assert r["resume_diff"] == 0.0, f"rank {rank}: resumed run differs by {r['resume_diff']}"
        assert r["control_diff"] > 1e-3, f"rank {rank}: dropout does not depend on the RNG state"
        if kind == "zero":
            assert r["optimizer_round_trip"], f"rank {rank}: consolidated optimizer state changed"


def test_zero_checkpoint_holds_the_plain_optimizer_state(distributed) -> None:
    """ZeRO's consolidated state is torch's format: equal to plain Adam's, trained alike."""
    directory, _ = distributed
    adam = torch.load(directory / "adam.pt", weights_only=True)
    zero = torch.load(directory / "zero.pt", weights_only=True)
    assert max_abs_diff(adam["model"], zero["model"]) <= TOL
    assert adam["optimizer"]["state"].keys() == zero["optimizer"]["state"].keys()
    for idx, expected in adam["optimizer"]["state"].items():
        got = zero["optimizer"]["state"][idx]
        assert max_abs_diff(expected, got) <= TOL, idx
    assert adam["scheduler"] == zero["scheduler"]


# ---------------------------------------------------------------- bad input
def test_load_state_dict_rejects_another_format() -> None:
    model = _dropout_net()
    state = TrainingState(model)
    for bad in [model.state_dict(), {"format": "tandem.training_state/0"}, None]:
        with pytest.raises(ValueError, match="not a tandem training state"):
            state.load_state_dict(bad)  # type: ignore[arg-type]


def test_load_without_scheduler_state_into_a_scheduler_raises_and_loads_nothing() -> None:
    torch.manual_seed(0)
    model = _dropout_net()
    saved = TrainingState(model, torch.optim.Adam(model.parameters(), lr=0.1)).state_dict()
    assert saved is not None  # one process: it is rank 0
    torch.manual_seed(1)
    other = _dropout_net()
    before = _params(other)
    opt = torch.optim.Adam(other.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    with pytest.raises(ValueError, match="no scheduler state"):
        TrainingState(other, opt, sched).load_state_dict(saved)
    assert max_abs_diff(_params(other), before) == 0.0, "the model was loaded before the error"
    assert opt.param_groups[0]["lr"] == 0.01, "the optimizer was loaded before the error"
