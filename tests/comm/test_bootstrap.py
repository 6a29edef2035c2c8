"""tandem.init/shutdown (tandem/control/bootstrap.py) and the launcher variables they read.

world_from_env is pure and tested on a grid of mappings in this process. The
rendezvous methods run on two real ranks through the harness; the world of one
runs as a plain script in a subprocess with the launcher variables scrubbed.
Adoption (a process group created before tandem.init(), as Ray Train, Lightning
or the script itself do) runs in this process on a world of one and on two ranks
that train one DDP step in the adopted group. Slurm's variables are in
test_slurm_env.py.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tandem.comm import WorldInfo, world_from_env
from tandem.control import init, shutdown
from tandem.control import bootstrap
from tandem.comm.device import bind_device, default_backend
from tandem.comm.exit import _CleanExitHook
from tandem.comm.world import LaunchVars
from tandem.ddp import DistributedDataParallel
from tandem.testing import grad_of, max_abs_diff, run_distributed

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT")
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
TIMEOUT_S = 60.0
CPU = torch.device("cpu")


def scrubbed(environ) -> dict[str, str]:
    """``environ`` without any launcher's variables (torchrun's or Slurm's), as for a
    plain ``python train.py`` even when the tests themselves run under srun."""
    return {k: v for k, v in environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_(**changes: str | None) -> dict[str, str]:
    """TORCHRUN with some variables changed (a str) or removed (None)."""
    env = dict(TORCHRUN)
    for k, v in changes.items():
        if v is None:
            env.pop(k)
        else:
            env[k] = v
    return env


# ---------------------------------------------------------------- world_from_env, pure

def test_no_variables_is_a_world_of_one():
    assert world_from_env({}) is None
    assert world_from_env({"PATH": "/usr/bin", "TANDEM_X": "1"}) is None
    # MASTER_* are not read for tcp:// and file://, so alone they mean nothing there.
    assert world_from_env({"MASTER_ADDR": "h", "MASTER_PORT": "1"}, require_master=False) is None


@pytest.mark.parametrize("env, expected", [
    (TORCHRUN, LaunchVars(rank=1, world_size=4, local_rank=1, local_world_size=2,
                          master_addr="10.0.0.1", master_port=29500)),
    (with_(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"),
     LaunchVars(rank=0, world_size=1, local_rank=0, local_world_size=1,
                master_addr="10.0.0.1", master_port=29500)),
    # No local variables: one node, local = global.
    (with_(LOCAL_RANK=None, LOCAL_WORLD_SIZE=None, RANK="3"),
     LaunchVars(rank=3, world_size=4, local_rank=3, local_world_size=4,
                master_addr="10.0.0.1", master_port=29500)),
    (with_(RANK=" 2 ", MASTER_PORT="65535"),
     LaunchVars(rank=2, world_size=4, local_rank=1, local_world_size=2,
                master_addr="10.0.0.1", master_port=65535)),
], ids=["torchrun", "one-rank-launch", "no-local-vars", "whitespace"])
def test_good_environments(env, expected):
    assert world_from_env(env) == expected


def test_master_not_read_without_env_rendezvous():
    env = with_(MASTER_ADDR=None, MASTER_PORT="not-a-port")
    got = world_from_env(env, require_master=False)
    assert (got.rank, got.world_size, got.master_addr, got.master_port) == (1, 4, None, None)


@pytest.mark.parametrize("env, needles", [
    (with_(WORLD_SIZE=None), ["WORLD_SIZE is not", "RANK='1'"]),
    (with_(RANK=None), ["RANK is not", "WORLD_SIZE='4'"]),
    ({"LOCAL_RANK": "0"}, ["RANK is not", "LOCAL_RANK='0'"]),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "1"}, ["RANK is not", "single process"]),
    (with_(RANK="x"), ["RANK='x'", "not an integer"]),
    (with_(RANK=""), ["RANK=''", "not an integer"]),
    (with_(RANK="1.0"), ["RANK='1.0'", "not an integer"]),
    (with_(RANK="-1"), ["RANK=-1", "negative"]),
    (with_(WORLD_SIZE="0", RANK="0"), ["WORLD_SIZE=0", "at least 1"]),
    (with_(RANK="4"), ["RANK=4", "WORLD_SIZE=4", "0 to 3"]),
    (with_(LOCAL_RANK="2"), ["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"]),
    (with_(LOCAL_RANK="-1"), ["LOCAL_RANK=-1", "negative"]),
    (with_(LOCAL_WORLD_SIZE="0", LOCAL_RANK="0"), ["LOCAL_WORLD_SIZE=0", "at least 1"]),
    (with_(LOCAL_WORLD_SIZE="8"), ["LOCAL_WORLD_SIZE=8", "WORLD_SIZE=4"]),
    (with_(LOCAL_WORLD_SIZE=None), ["LOCAL_RANK='1'", "LOCAL_WORLD_SIZE is not"]),
    (with_(LOCAL_RANK=None), ["LOCAL_WORLD_SIZE='2'", "LOCAL_RANK is not"]),
    (with_(MASTER_ADDR=None), ["MASTER_ADDR is not set", "env://", "tcp://"]),
    (with_(MASTER_PORT=None), ["MASTER_PORT is not set", "env://"]),
    (with_(MASTER_ADDR=" "), ["MASTER_ADDR=''", "empty"]),
    (with_(MASTER_PORT="http"), ["MASTER_PORT='http'", "not an integer"]),
    (with_(MASTER_PORT="0"), ["MASTER_PORT=0", "1..65535"]),
    (with_(MASTER_PORT="70000"), ["MASTER_PORT=70000", "1..65535"]),
])
def test_bad_environments(env, needles):
    assert_refused(env, needles)


def assert_refused(env: dict[str, str], needles: list[str]) -> None:
    """world_from_env refuses ``env`` with a ValueError that says each of ``needles``."""
    with pytest.raises(ValueError) as info:
        world_from_env(env)
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.parametrize("fields", [
    dict(rank=2, world_size=2), dict(rank=-1), dict(world_size=0, rank=0, local_world_size=0),
    dict(local_rank=1, local_world_size=1), dict(local_world_size=3),
])
def test_world_info_validates(fields):
    base = dict(rank=0, local_rank=0, world_size=2, local_world_size=2,
                device=torch.device("cpu"), backend="gloo")
    with pytest.raises(ValueError, match="WorldInfo"):
        WorldInfo(**{**base, **fields})


# ------------------------------------------------------- init/shutdown in this process

@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables, and no process group left behind whatever happens."""
    for name in set(os.environ) - set(scrubbed(os.environ)):
        monkeypatch.delenv(name)
    assert not dist.is_initialized()
    yield monkeypatch
    shutdown()
    if dist.is_initialized():  # a test's own group, if it failed before destroying it
        dist.destroy_process_group()


def test_init_twice_returns_the_same_world_and_shutdown_allows_again(clean_env):
    info = init()
    assert info == WorldInfo(rank=0, local_rank=0, world_size=1, local_world_size=1,
                             device=CPU, backend="gloo")
    # Again, with nothing that contradicts the group init() created: the same answer.
    assert init() == info
    assert init("gloo", timeout=bootstrap.DEFAULT_TIMEOUT) == info
    with pytest.raises(ValueError, match=r"rank 0: .*timeout=0:00:30, but the group was created "
                                         r"with 0:10:00.*tandem.shutdown\(\) first"):
        init(timeout=30.0)
    with pytest.raises(ValueError, match=r"backend='nccl', but the group's backend is 'gloo'"):
        init(backend="nccl")
    with pytest.raises(ValueError, match=r"init_method='tcp://127.0.0.1:1', but the group was "
                                         r"created with an in-memory store"):
        init(init_method="tcp://127.0.0.1:1", rank=0, world_size=1)
    assert init() == info
    shutdown()
    assert not dist.is_initialized()
    shutdown()  # a no-op now
    assert init(timeout=30.0).world_size == 1
    t = torch.tensor([3.0])
    dist.all_reduce(t)
    assert t.item() == 3.0


def test_adopts_a_group_the_script_created(clean_env):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    info = init(timeout=30.0)  # the timeout cannot apply to a group that exists: a warning
    assert info == WorldInfo(rank=0, local_rank=0, world_size=1, local_world_size=1,
                             device=CPU, backend="gloo")
    assert isinstance(sys.excepthook, _CleanExitHook)
    assert init() == info and init(backend="gloo") == info
    with pytest.raises(ValueError, match=r"rank=0, world_size=2, but the group has rank 0 of 1.*"
                                         r"destroy_process_group\(\)"):
        init(init_method="tcp://127.0.0.1:1", rank=0, world_size=2)
    shutdown()
    assert dist.is_initialized(), "tandem.shutdown() destroyed a group it did not create"
    assert not isinstance(sys.excepthook, _CleanExitHook)
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    assert t.item() == 1.0
    dist.destroy_process_group()


def test_a_group_replaced_behind_tandems_back_is_adopted(clean_env):
    init()
    dist.destroy_process_group()  # tandem's group, destroyed by the user ...
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # ... and a new one
    assert init().world_size == 1
    shutdown()
    assert dist.is_initialized(), "tandem.shutdown() destroyed the user's group"
    dist.destroy_process_group()


def test_inconsistent_env_raises_before_any_group(clean_env):
    clean_env.setenv("RANK", "2")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK=2 is not less than WORLD_SIZE=2"):
        init()
    clean_env.setenv("RANK", "0")
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        init()
    assert not dist.is_initialized()


@pytest.mark.parametrize("kwargs, error, needle", [
    (dict(init_method="nfs://x"), ValueError, "not supported"),
    (dict(init_method="tcp://127.0.0.1"), ValueError, "host and a port"),
    (dict(init_method="tcp://127.0.0.1:1"), ValueError, "needs this process's rank"),
    (dict(init_method="file://"), ValueError, "needs a path"),
    (dict(init_method="env://"), ValueError, "launch with torchrun"),
    (dict(rank=0, world_size=1), ValueError, "launcher's RANK and WORLD_SIZE are used"),
    (dict(init_method="tcp://h:1", rank=0), ValueError, "world_size is missing"),
    (dict(init_method="tcp://h:1", rank=2, world_size=2), ValueError, "rank=2 must be in 0..1"),
    (dict(init_method="tcp://h:1", rank=0, world_size=0), ValueError, "world_size=0"),
    (dict(init_method="tcp://h:1", rank=0.0, world_size=1), TypeError, "rank must be an int"),
    (dict(timeout=0), ValueError, "timeout must be positive"),
    (dict(timeout=datetime.timedelta(seconds=-1)), ValueError, "timeout must be positive"),
    (dict(timeout="10"), TypeError, "timeout must be"),
    (dict(backend="nccl"), ValueError, "needs CUDA"),
])
def test_bad_arguments(clean_env, kwargs, error, needle):
    with pytest.raises(error, match=needle):
        init(**kwargs)
    assert not dist.is_initialized()


def test_rank_args_must_agree_with_env(clean_env):
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="contradict the environment's RANK=0, WORLD_SIZE=2"):
        init(init_method="tcp://127.0.0.1:1", rank=1, world_size=2)


def test_cuda_device_binding(monkeypatch):
    """The CUDA path without a GPU: the backend choice and the device check."""
    bound = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    assert default_backend() == "nccl"
    assert bind_device("nccl", 1, rank=5) == torch.device("cuda", 1)
    assert bound == [1]
    assert bind_device("gloo", 1, rank=5) == torch.device("cpu")
    with pytest.raises(ValueError, match="rank 6: LOCAL_RANK=2 but this node has 2 CUDA"):
        bind_device("cpu:gloo,cuda:nccl", 2, rank=6)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert default_backend() == "gloo"


# ------------------------------------------------------------ two ranks, three rendezvous

def _join_and_reduce(rank: int, world_size: int, how: str, port: int) -> WorldInfo:
    store = os.environ["TANDEM_TEST_STORE"]
    if how == "env":
        info = init(timeout=TIMEOUT_S)
    elif how == "tcp":  # rank and world size from the harness's RANK/WORLD_SIZE
        info = init("gloo", f"tcp://127.0.0.1:{port}", datetime.timedelta(seconds=TIMEOUT_S))
    else:  # explicit rank and world size, agreeing with the environment
        info = init(init_method=f"file://{store}", timeout=TIMEOUT_S, rank=rank,
                    world_size=world_size)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) / 2, t
    assert init() == info  # a second init(): the same world, no second group
    shutdown()
    assert not dist.is_initialized()
    # Join again through a fresh file store: shutdown leaves nothing behind.
    again = init(init_method=f"file://{store}.again", timeout=TIMEOUT_S)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size and again == info
    shutdown()
    return info


@pytest.mark.parametrize("how", ["env", "tcp", "file"])
def test_two_ranks(how):
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} if how == "env" else {}
    infos = run_distributed(_join_and_reduce, 2, args=(how, port), timeout=TIMEOUT_S,
                            init_process_group=False, env=env)
    assert infos == [WorldInfo(rank=r, local_rank=r, world_size=2, local_world_size=2,
                               device=torch.device("cpu"), backend="gloo") for r in range(2)]


# ------------------------------------------------- two ranks adopt the group a script made

def _problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A tiny model and a global batch of 8, the same in every process."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.randn(8, 4), torch.randn(8, 2)


def _contradictions(store: str, rank: int) -> dict[str, dict]:
    return {
        "backend": dict(backend="nccl"),
        "rank": dict(init_method=f"file://{store}", rank=1 - rank, world_size=2),
        "world_size": dict(init_method=f"file://{store}", rank=rank, world_size=3),
        "tcp": dict(init_method="tcp://127.0.0.1:1", rank=rank, world_size=2),
        "other_file": dict(init_method=f"file://{store}.other", rank=rank, world_size=2),
        "env": dict(init_method="env://"),
    }


def _adopt_train_and_leave(rank: int, world_size: int) -> dict:
    store = os.environ["TANDEM_TEST_STORE"]
    # The script (or Ray Train, or Lightning) creates the group; tandem adopts it.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    info = init()
    again = [init(), init(backend="gloo"),
             init(init_method=f"file://{store}", rank=rank, world_size=world_size)]
    errors: dict[str, str | None] = {}
    for name, kwargs in _contradictions(store, rank).items():
        try:
            init(**kwargs)
        except ValueError as e:
            errors[name] = str(e)
        else:
            errors[name] = None
    again.append(init())

    model, x, y = _problem()
    ddp = DistributedDataParallel(model)
    half = x.shape[0] // world_size
    rows = slice(rank * half, (rank + 1) * half)
    nn.functional.mse_loss(ddp(x[rows]), y[rows]).backward()
    grads = {name: grad_of(p).clone() for name, p in model.named_parameters()}

    shutdown()
    left_alone = dist.is_initialized()
    t = torch.ones(1)
    dist.all_reduce(t)  # the user's group still works after tandem.shutdown()
    hook_removed = not isinstance(sys.excepthook, _CleanExitHook)
    dist.destroy_process_group()  # the user's to destroy
    return dict(info=info, again=again, errors=errors, grads=grads, left_alone=left_alone,
                total=t.item(), hook_removed=hook_removed, store=store)


def test_two_ranks_adopt_an_existing_group():
    results = run_distributed(_adopt_train_and_leave, 2, timeout=TIMEOUT_S, init_process_group=False)

    model, x, y = _problem()  # one process, the global batch
    nn.functional.mse_loss(model(x), y).backward()
    reference = {name: p.grad for name, p in model.named_parameters()}

    for rank, r in enumerate(results):
        # The harness sets LOCAL_RANK/LOCAL_WORLD_SIZE as torchrun would: read for the local place.
        assert r["info"] == WorldInfo(rank=rank, local_rank=rank, world_size=2, local_world_size=2,
                                      device=CPU, backend="gloo")
        assert r["again"] == [r["info"]] * 4
        store = r["store"]
        needles = {
            "backend": ["backend='nccl'", "'gloo'"],
            "rank": [f"rank={1 - rank}, world_size=2", f"rank {rank} of 2"],
            "world_size": [f"rank={rank}, world_size=3", f"rank {rank} of 2"],
            "tcp": ["init_method='tcp://127.0.0.1:1'", f"file store 'file://{store}'"],
            "other_file": [f"init_method='file://{store}.other'", f"file store 'file://{store}'"],
            "env": ["init_method='env://'", f"file store 'file://{store}'"],
        }
        for name, texts in needles.items():
            error = r["errors"][name]
            assert error is not None, f"rank {rank}: init() with a contradicting {name} did not raise"
            for text in texts + [f"rank {rank}:", "Leave these arguments out",
                                 "torch.distributed.destroy_process_group()"]:
                assert text in error, (name, text, error)
        assert max_abs_diff(r["grads"], reference) <= 1e-6
        assert r["left_alone"] and r["hook_removed"] and r["total"] == 2.0


# ----------------------------------------------------------- a plain script, world of one

_SCRIPT = textwrap.dedent("""
    import logging
    import torch, torch.distributed as dist
    from tandem.control import init, shutdown
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    info = init()
    t = torch.tensor([2.0])
    dist.all_reduce(t)
    assert t.item() == 2.0 and dist.get_world_size() == 1
    print(info)
    shutdown()
""")


def test_world_of_one_in_a_clean_script():
    env = scrubbed(os.environ)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert "rank=0, local_rank=0, world_size=1, local_world_size=1" in proc.stdout
    assert "tandem: rank 0/1 (local 0/1), backend gloo, device cpu" in proc.stderr


def _elastic_beats(rank: int, world_size: int, how: str) -> dict:
    """An elastic member's beat thread, after the exit hook or after shutdown
    (Note [threads at exit] in tandem/control/group_record.py)."""
    import threading

    from tandem.control import group_record
    from tandem.control.elastic_group import elastic_membership
    from tandem.control.generation import ElasticConfig

    def beating() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("tandem-elastic-beat")]

    init("gloo", init_method=f"file://{os.environ['TANDEM_TEST_STORE']}", rank=rank, world_size=world_size)
    elastic_membership(ElasticConfig(beat_s=0.05))
    out = {"while training": beating()}
    if how == "exit":
        group_record.stop_elastic_at_exit()   # what the process's exit runs
    else:
        shutdown()
    out["after"] = beating()
    return out


def test_an_elastic_members_beat_thread_ends_at_shutdown_and_at_exit():
    """Left beating, a process aborted in its teardown once it had finished
    training ("terminate called without an active exception", seen in
    tests/launch/test_cluster_faults.py)."""
    for how in ("exit", "shutdown"):
        for out in run_distributed(_elastic_beats, 2, args=(how,), timeout=TIMEOUT_S, init_process_group=False):
            assert len(out["while training"]) == 1 and out["after"] == [], (how, out)
