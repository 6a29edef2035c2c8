"""Slurm's variables in tandem.comm.world_from_env, and tandem.init() under srun
without torchrun.

The environments are written out as srun sets them for one task (Slurm's
env_array_for_step and setup_env): SLURM_PROCID/LOCALID/NODEID, SLURM_NTASKS and
SLURM_STEP_NUM_TASKS, SLURM_STEP_TASKS_PER_NODE and SLURM_TASKS_PER_NODE in
Slurm's compressed form, the step's and the job's node lists, SLURM_JOB_ID. The
expected values are worked out by hand from the layout, not by the parser. The
multi-process test gives three ranks nothing but such variables (no RANK, no
MASTER_ADDR, no MASTER_PORT) and lets tandem.init() find rank 0's host in the
node list and the port from the job id.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
from test_bootstrap import assert_refused

from tandem.comm import WorldInfo, world_from_env
from tandem.control import init, shutdown
from tandem.comm.device import bind_device
from tandem.comm.world import (
    Launcher,
    LaunchVars,
    first_host_of_nodelist,
    local_from_env,
    parse_tasks_per_node,
    slurm_default_port,
)
from tandem.testing import run_distributed

TIMEOUT_S = 60.0

# Task 5 of `srun --nodes 2 --ntasks-per-node 3 python train.py` in job 123456:
# tasks 0-2 on node01, 3-5 on node02 (block distribution), so task 5 is the
# third task (LOCALID 2) of the second node (NODEID 1).
TASK5 = {
    "SLURM_JOB_ID": "123456", "SLURM_JOBID": "123456", "SLURM_JOB_NAME": "train",
    "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NODELIST": "node[01-02]",
    "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
    "SLURM_NTASKS": "6", "SLURM_STEP_NUM_TASKS": "6", "SLURM_NTASKS_PER_NODE": "3",
    "SLURM_TASKS_PER_NODE": "3(x2)", "SLURM_STEP_TASKS_PER_NODE": "3(x2)",
}
# 10000 + 123456 % 20000 = 10000 + 3456
TASK5_PORT = 13456
TASK5_VARS = LaunchVars(rank=5, world_size=6, local_rank=2, local_world_size=3,
                        master_addr="node01", master_port=TASK5_PORT, launcher=Launcher.SLURM)


def task5(**changes: str | None) -> dict[str, str]:
    """TASK5 with some variables changed (a str) or removed (None)."""
    env = dict(TASK5)
    for k, v in changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


# ---------------------------------------------------------------- the two parsers, pure

@pytest.mark.parametrize("nodelist, first", [
    ("node01", "node01"),
    ("node[01-04,07],gpu5", "node01"),
    ("gpu5,node[01-04,07]", "gpu5"),
    ("n[7,3-4]", "n7"),
    ("node[001-010]", "node001"),               # zero padding kept
    ("rack[2-3]-n[007-010],login1", "rack2-n007"),
    ("node-[5-6]-ib", "node-5-ib"),
    (" host.example.com ", "host.example.com"),
    ("localhost", "localhost"),
])
def test_first_host_of_nodelist(nodelist, first):
    assert first_host_of_nodelist(nodelist) == first


@pytest.mark.parametrize("nodelist, needle", [
    ("", "no host"),
    (",node1", "no host"),
    ("node[01-04", "'[' without ']'"),
    ("node01]", "']' without '['"),
    ("node[[1]]", "nested"),
    ("node[a-b]", "does not start with a number"),
    ("node[]", "does not start with a number"),
    ("node[04-01]", "does not start with a number or a range"),
    ("no de1", "not a host name"),
])
def test_bad_nodelists(nodelist, needle):
    with pytest.raises(ValueError) as info:
        first_host_of_nodelist(nodelist, name="SLURM_STEP_NODELIST")
    for text in (needle, f"SLURM_STEP_NODELIST={nodelist!r}", "MASTER_ADDR"):
        assert text in str(info.value)


@pytest.mark.parametrize("text, counts", [
    ("4", [4]),
    ("2(x3)", [2, 2, 2]),
    ("4(x2),2", [4, 4, 2]),
    ("1,2(x2),3", [1, 2, 2, 3]),
    ("8(x1)", [8]),
])
def test_parse_tasks_per_node(text, counts):
    assert parse_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "x", "2(x)", "2(x0)", "0", "2(3)", "2,,3", "-1", "2(x3"])
def test_bad_tasks_per_node(text):
    with pytest.raises(ValueError, match=r"SLURM_TASKS_PER_NODE=.*'2\(x3\)'"):
        parse_tasks_per_node(text)


def test_default_port_is_the_same_for_every_task_and_in_range():
    assert slurm_default_port(123456) == TASK5_PORT
    assert slurm_default_port(0) == 10000
    assert slurm_default_port(19999) == 29999
    assert slurm_default_port(20000) == 10000


# ------------------------------------------------------ world_from_env, Slurm's variables

@pytest.mark.parametrize("env, expected", [
    (TASK5, TASK5_VARS),
    # `srun -N 2 -n 5`: block layout "3,2"; task 4 is the second task on node 1.
    (task5(SLURM_PROCID="4", SLURM_LOCALID="1", SLURM_NTASKS="5", SLURM_STEP_NUM_TASKS="5",
           SLURM_STEP_TASKS_PER_NODE="3,2", SLURM_TASKS_PER_NODE="3,2", SLURM_NTASKS_PER_NODE=None),
     LaunchVars(rank=4, world_size=5, local_rank=1, local_world_size=2, master_addr="node01",
                master_port=TASK5_PORT, launcher=Launcher.SLURM)),
    # `srun -N 4 -n 6`: "2(x2),1(x2)"; task 5 is alone on the fourth node.
    (task5(SLURM_NODEID="3", SLURM_LOCALID="0", SLURM_STEP_TASKS_PER_NODE="2(x2),1(x2)",
           SLURM_TASKS_PER_NODE="2(x2),1(x2)", SLURM_STEP_NODELIST="node[01-04]",
           SLURM_NTASKS_PER_NODE=None),
     LaunchVars(rank=5, world_size=6, local_rank=0, local_world_size=1, master_addr="node01",
                master_port=TASK5_PORT, launcher=Launcher.SLURM)),
    # A step on two of the job's eight nodes: rank 0 is on the step's first node.
    (task5(SLURM_JOB_NODELIST="gpu[1-8]", SLURM_NODELIST="gpu[1-8]", SLURM_STEP_NODELIST="gpu[5-6]"),
     LaunchVars(rank=5, world_size=6, local_rank=2, local_world_size=3, master_addr="gpu5",
                master_port=TASK5_PORT, launcher=Launcher.SLURM)),
    # srun --preserve-env keeps the job's SLURM_NTASKS and SLURM_TASKS_PER_NODE; the step's win.
    (task5(SLURM_NTASKS="16", SLURM_TASKS_PER_NODE="8(x2)"), TASK5_VARS),
    # Without the step's variables (set by hand): the job's node list, SLURM_NTASKS_PER_NODE.
    (task5(SLURM_STEP_NODELIST=None, SLURM_STEP_TASKS_PER_NODE=None, SLURM_TASKS_PER_NODE=None,
           SLURM_JOB_NODELIST="rack[2-3]-n[007-010]"),
     LaunchVars(rank=5, world_size=6, local_rank=2, local_world_size=3, master_addr="rack2-n007",
                master_port=TASK5_PORT, launcher=Launcher.SLURM)),
    # MASTER_ADDR and MASTER_PORT, when set, win over the node list and the job id.
    (task5(MASTER_ADDR="10.1.2.3", MASTER_PORT="29400"),
     LaunchVars(rank=5, world_size=6, local_rank=2, local_world_size=3, master_addr="10.1.2.3",
                master_port=29400, launcher=Launcher.SLURM)),
    (task5(MASTER_PORT="29400"),
     LaunchVars(rank=5, world_size=6, local_rank=2, local_world_size=3, master_addr="node01",
                master_port=29400, launcher=Launcher.SLURM)),
    # Old spelling of the job id only.
    (task5(SLURM_JOB_ID=None, SLURM_JOBID="40000"),
     LaunchVars(rank=5, world_size=6, local_rank=2, local_world_size=3, master_addr="node01",
                master_port=10000, launcher=Launcher.SLURM)),
], ids=["block-3x2", "uneven-3,2", "uneven-2x2,1x2", "step-subset", "preserve-env",
        "no-step-vars", "master-set", "port-set", "old-jobid"])
def test_srun_tasks(env, expected):
    got = world_from_env(env)
    assert got == expected
    assert got.rank_vars == ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS")


def test_master_not_read_without_env_rendezvous():
    got = world_from_env(task5(SLURM_JOB_ID=None, SLURM_JOBID=None, SLURM_STEP_NODELIST="bad["),
                         require_master=False)
    assert (got.rank, got.world_size, got.master_addr, got.master_port) == (5, 6, None, None)


def test_torchrun_variables_win():
    """`srun --ntasks-per-node 1 tandem run --nproc-per-node 4 ...`: each worker has
    torchrun's variables and the srun task's."""
    torchrun = {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
                "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}
    got = world_from_env({**task5(SLURM_PROCID="1", SLURM_LOCALID="0"), **torchrun})
    assert got == LaunchVars(rank=6, world_size=8, local_rank=2, local_world_size=4,
                             master_addr="node01", master_port=29500, launcher=Launcher.TORCHRUN)
    # A partial torchrun set is still torchrun's error, not silently Slurm's.
    with pytest.raises(ValueError, match="LOCAL_RANK='0' is set but RANK is not"):
        world_from_env({**TASK5, "LOCAL_RANK": "0"})


@pytest.mark.parametrize("env", [
    # `srun -n 1 python train.py`, or the interactive step of salloc.
    task5(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NTASKS="1",
          SLURM_STEP_NUM_TASKS="1", SLURM_STEP_TASKS_PER_NODE="1", SLURM_TASKS_PER_NODE="1",
          SLURM_NTASKS_PER_NODE=None, SLURM_JOB_ID=None, SLURM_JOBID=None),
    # A batch script of one task running Python itself.
    {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
     "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "node01"},
    # salloc's shell without --ntasks.
    {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "node[01-02]"},
], ids=["srun-n1", "batch-one-task", "salloc"])
def test_a_world_of_one(env):
    assert world_from_env(env) is None


@pytest.mark.parametrize("env, needles", [
    # Note [srun's tasks]: `python train.py` in a batch script of 8 tasks.
    ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
      "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "node[01-02]"},
     ["SLURM_NTASKS=8", "SLURM_STEP_NUM_TASKS is not", "srun python train.py", "--ntasks 1"]),
    (task5(SLURM_PROCID="x"), ["SLURM_PROCID='x'", "not an integer", "srun"]),
    (task5(SLURM_PROCID="6"), ["SLURM_PROCID=6", "SLURM_STEP_NUM_TASKS=6"]),
    (task5(SLURM_STEP_NUM_TASKS="0", SLURM_PROCID="0"), ["SLURM_STEP_NUM_TASKS=0", "at least 1"]),
    (task5(SLURM_LOCALID=None), ["SLURM_LOCALID is not"]),
    (task5(SLURM_LOCALID="-1"), ["SLURM_LOCALID=-1", "negative"]),
    (task5(SLURM_LOCALID="3"), ["SLURM_LOCALID=3", "SLURM_STEP_TASKS_PER_NODE='3(x2)'", "0 to 2"]),
    (task5(SLURM_STEP_TASKS_PER_NODE="3(x3)"), ["SLURM_STEP_TASKS_PER_NODE='3(x3)'", "places 9",
                                                "SLURM_STEP_NUM_TASKS=6"]),
    (task5(SLURM_STEP_TASKS_PER_NODE="3x2"), ["SLURM_STEP_TASKS_PER_NODE='3x2'", "'2(x3)'"]),
    (task5(SLURM_STEP_TASKS_PER_NODE="4,2", SLURM_NODEID=None), ["SLURM_NODEID", "'4,2'"]),
    (task5(SLURM_STEP_TASKS_PER_NODE="4,2", SLURM_NODEID="2"), ["SLURM_NODEID=2", "2 node(s)"]),
    (task5(SLURM_STEP_TASKS_PER_NODE=None, SLURM_TASKS_PER_NODE=None, SLURM_NTASKS_PER_NODE=None),
     ["SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"]),
    (task5(SLURM_STEP_TASKS_PER_NODE=None, SLURM_TASKS_PER_NODE=None, SLURM_NTASKS_PER_NODE="8"),
     ["SLURM_NTASKS_PER_NODE='8'", "exceeds SLURM_STEP_NUM_TASKS=6"]),
    (task5(SLURM_STEP_NODELIST="node[01-"), ["SLURM_STEP_NODELIST='node[01-'", "MASTER_ADDR"]),
    (task5(SLURM_STEP_NODELIST=None, SLURM_JOB_NODELIST=None, SLURM_NODELIST=None),
     ["MASTER_ADDR is not set", "SLURM_STEP_NODELIST"]),
    (task5(MASTER_ADDR=" "), ["MASTER_ADDR=''", "empty"]),
    (task5(SLURM_JOB_ID=None, SLURM_JOBID=None), ["MASTER_PORT is not set", "SLURM_JOB_ID"]),
    (task5(SLURM_JOB_ID="abc"), ["SLURM_JOB_ID='abc'", "not an integer"]),
    (task5(MASTER_PORT="0"), ["MASTER_PORT=0", "1..65535"]),
], ids=["batch-script", "procid-text", "procid-too-big", "no-tasks", "no-localid", "localid-negative",
        "localid-too-big", "layout-sum", "layout-syntax", "no-nodeid", "nodeid-too-big", "no-layout",
        "ntasks-per-node-too-big", "bad-nodelist", "no-nodelist", "empty-master-addr", "no-job-id",
        "job-id-text", "bad-master-port"])
def test_bad_srun_environments(env, needles):
    assert_refused(env, needles)


# ---------------------------------------------- local_from_env: a group someone else created

@pytest.mark.parametrize("env, rank, world_size, expected", [
    ({}, 1, 3, (1, 3)),                                      # nothing: one node
    ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, 5, 8, (1, 4)),
    # Lightning sets LOCAL_RANK and WORLD_SIZE only: one node assumed for the size.
    ({"LOCAL_RANK": "1", "WORLD_SIZE": "2", "NODE_RANK": "0"}, 1, 2, (1, 2)),
    ({"LOCAL_WORLD_SIZE": "2"}, 1, 4, (1, 2)),
    (TASK5, 5, 6, (2, 3)),                                   # this srun task's place
    ({**TASK5, "LOCAL_RANK": "0"}, 5, 6, (0, 3)),            # LOCAL_RANK wins where set
    (TASK5, 0, 2, (0, 2)),                                   # Slurm describes another world
    # A launcher's children in a batch script inherit its SLURM_* (Note [srun's tasks]).
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "7"}, 1, 2, (1, 2)),
    (task5(SLURM_STEP_TASKS_PER_NODE="garbage"), 5, 6, (5, 6)),  # unparsable: ignored
])
def test_local_from_env(env, rank, world_size, expected):
    assert local_from_env(env, rank=rank, world_size=world_size) == expected


@pytest.mark.parametrize("env, needles", [
    ({"RANK": "1", "WORLD_SIZE": "2"}, ["RANK=1", "rank 0", "another job"]),
    ({"RANK": "0", "WORLD_SIZE": "4"}, ["WORLD_SIZE=4", "world size 2"]),
    ({"LOCAL_RANK": "x"}, ["LOCAL_RANK='x'", "not an integer"]),
    ({"LOCAL_RANK": "2"}, ["LOCAL_RANK=2", "world size (no LOCAL_WORLD_SIZE: one node)=2"]),
    ({"LOCAL_WORLD_SIZE": "3"}, ["LOCAL_WORLD_SIZE=3", "exceeds the group's world size=2"]),
])
def test_local_from_env_errors(env, needles):
    with pytest.raises(ValueError) as info:
        local_from_env(env, rank=0, world_size=2)
    for needle in needles:
        assert needle in str(info.value)


# ------------------------------------------------------------ tandem.init() in this process

@pytest.fixture
def no_launcher(monkeypatch):
    """No launcher variables of either kind, and no process group left behind."""
    for name in list(os.environ):
        if name.startswith("SLURM_") or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                   "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(name)
    assert not dist.is_initialized()
    yield monkeypatch
    shutdown()


def test_init_in_a_batch_script_raises_before_any_group(no_launcher):
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}.items():
        no_launcher.setenv(name, value)
    with pytest.raises(ValueError, match="SLURM_NTASKS=4 .* not started by srun"):
        init()
    assert not dist.is_initialized()


def test_init_under_srun_n1_is_a_world_of_one(no_launcher):
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                        "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1",
                        "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_STEP_NODELIST": "node01"}.items():
        no_launcher.setenv(name, value)
    info = init(timeout=30.0)
    assert info == WorldInfo(rank=0, local_rank=0, world_size=1, local_world_size=1,
                             device=torch.device("cpu"), backend="gloo")
    t = torch.tensor([2.0])
    dist.all_reduce(t)
    assert t.item() == 2.0


def test_a_task_given_its_own_gpu_binds_cuda_0(monkeypatch):
    """Note [a Slurm task's own GPUs] in tandem/comm/device.py: `srun --ntasks-per-node 4
    --gpus-per-task 1` shows each task one GPU; torchrun's LOCAL_RANK beyond the GPUs stays an error."""
    bound = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    assert bind_device("nccl", 3, 7, local_world_size=4, slurm_task=True) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="rank 7: LOCAL_RANK=3 but this node has 1 CUDA"):
        bind_device("nccl", 3, 7, local_world_size=4, slurm_task=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # --gpus-per-node 4: all visible
    assert bind_device("nccl", 3, 7, local_world_size=4, slurm_task=True) == torch.device("cuda", 3)
    assert bound == [0, 3]


# ------------------------------------------------- three srun tasks on two "nodes", for real

def port_for_job() -> tuple[int, int]:
    """A free port in slurm_default_port's range, and a job id that derives it."""
    start = os.getpid() % 20000
    for offset in range(20000):
        port = 10000 + (start + offset) % 20000
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port, 7 * 20000 + port - 10000
    raise RuntimeError("no free port in 10000..29999")


# `srun --nodes 2 --ntasks 3`: tasks 0-1 on the first node ("localhost", so that
# the derived MASTER_ADDR resolves here), task 2 on the second.
_LAYOUT = {0: ("0", "0"), 1: ("0", "1"), 2: ("1", "0")}  # rank: (SLURM_NODEID, SLURM_LOCALID)


def _srun_task(rank: int, world_size: int, job_id: int) -> tuple[WorldInfo, float, bool]:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)  # the harness's; this rank is a process of its own
    node, local = _LAYOUT[rank]
    os.environ.update({
        "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "localhost,node02",
        "SLURM_STEP_NODELIST": "localhost,node02", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": local, "SLURM_NODEID": node, "SLURM_NTASKS": "3",
        "SLURM_STEP_NUM_TASKS": "3", "SLURM_TASKS_PER_NODE": "2,1", "SLURM_STEP_TASKS_PER_NODE": "2,1",
        # a job of several nodes shares one secret (Note [signed store] in tandem/store/job_secret.py)
        "TANDEM_JOB_SECRET": "5ec2e7" * 8,
    })
    info = init(timeout=TIMEOUT_S)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    agrees = (dist.get_rank(), dist.get_world_size()) == (rank, world_size)
    shutdown()
    return info, t.item(), agrees and not dist.is_initialized()


def test_srun_tasks_join_with_slurm_variables_only():
    port, job_id = port_for_job()
    assert slurm_default_port(job_id) == port
    results = run_distributed(_srun_task, 3, args=(job_id,), timeout=TIMEOUT_S,
                              init_process_group=False)
    cpu = torch.device("cpu")
    assert [info for info, _, _ in results] == [
        WorldInfo(rank=0, local_rank=0, world_size=3, local_world_size=2, device=cpu, backend="gloo"),
        WorldInfo(rank=1, local_rank=1, world_size=3, local_world_size=2, device=cpu, backend="gloo"),
        WorldInfo(rank=2, local_rank=0, world_size=3, local_world_size=1, device=cpu, backend="gloo"),
    ]
    assert [total for _, total, _ in results] == [6.0, 6.0, 6.0]
    assert all(ok for _, _, ok in results)


def test_srun_tasks_on_several_nodes_without_a_secret_refuse_to_start(monkeypatch):
    port, job_id = port_for_job()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TANDEM_JOB_SECRET", "TANDEM_JOB_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    for rank, (node, local) in _LAYOUT.items():  # each task refuses on its own, before it connects
        for name, value in {
            "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "localhost,node02",
            "SLURM_STEP_NODELIST": "localhost,node02", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": local, "SLURM_NODEID": node, "SLURM_NTASKS": "3",
            "SLURM_STEP_NUM_TASKS": "3", "SLURM_TASKS_PER_NODE": "2,1", "SLURM_STEP_TASKS_PER_NODE": "2,1",
        }.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"rank {rank}: a job of several nodes needs one job secret") as e:
            init(timeout=TIMEOUT_S)
        assert "export TANDEM_JOB_SECRET_FILE=" in str(e.value) and not dist.is_initialized()
