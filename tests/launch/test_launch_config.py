"""The launcher's pure parts, in this process: flags to a LaunchConfig (grids of
made-up machines), the worker command and its checks, rank prefixes and line
splitting, the failure summary, the log layout and worker environment, the
per-attempt store, and the command line's errors."""

from __future__ import annotations

import datetime
import io
import json
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tandem.launch import cli
from tandem.launch.cli import TargetKind, check_target, worker_command
from tandem.launch.config import (
    AUTO_MAX_CPU_WORKERS,
    LaunchConfig,
    parse_nnodes,
    parse_rank_list,
    parse_rdzv_conf,
    resolve_nproc,
    threads_per_worker,
)
from tandem.launch.logs import WorkerLogs
from tandem.launch.output import RankOutput, rank_prefix, split_lines, without_backtraces
from tandem.launch.rendezvous import FreshWorkerStore
from tandem.launch.summary import Failure, format_summary, in_order_of_failure, traceback_tail


def parse(*argv: str):
    return cli.build_parser().parse_args(["run", *argv])


def config(*argv: str, cpus: int = 8, gpus: int = 0, environ=None) -> LaunchConfig:
    return cli.config_from_args(parse(*argv, "train.py"), cpus=cpus, gpus=gpus,
                                environ=environ or {})


# ---------------------------------------------------------------- workers per node, threads

@pytest.mark.parametrize("value, cpus, gpus, expected", [
    ("3", 2, 0, 3), ("1", 64, 8, 1),
    ("auto", 2, 0, 2), ("auto", 1, 0, 1), ("auto", 64, 0, AUTO_MAX_CPU_WORKERS), ("auto", 16, 4, 4),
    ("cpu", 2, 0, 2), ("cpu", 64, 8, 64), ("gpu", 8, 2, 2), (" 4 ", 2, 0, 4),
])
def test_resolve_nproc(value, cpus, gpus, expected):
    assert resolve_nproc(value, cpus=cpus, gpus=gpus).nproc == expected


@pytest.mark.parametrize("value, needle", [
    ("0", "at least 1"), ("-1", "at least 1"), ("gpu", "no CUDA device"), ("xpu", "not supported"),
    ("", "not supported"),
])
def test_resolve_nproc_rejects(value, needle):
    with pytest.raises(ValueError, match=needle):
        resolve_nproc(value, cpus=2, gpus=0)


@pytest.mark.parametrize("nproc, cpus, expected", [(2, 2, 1), (1, 2, 2), (2, 16, 8), (8, 2, 1),
                                                   (3, 8, 2)])
def test_threads_share_the_cores(nproc, cpus, expected):
    assert threads_per_worker(nproc, cpus=cpus, environ={}) == expected
    assert nproc * expected <= max(cpus, nproc)  # never more threads than cores (1 each at least)


def test_user_threads_are_kept():
    assert threads_per_worker(2, cpus=16, environ={"OMP_NUM_THREADS": "3"}) is None
    cfg = config("--nproc-per-node", "2", environ={"OMP_NUM_THREADS": "3"})
    assert cfg.omp_num_threads is None and "OMP_NUM_THREADS" not in cfg.worker_env
    assert "as inherited" in cfg.describe()


def test_auto_on_a_cpu_machine_says_what_it_chose():
    cfg = config("--nproc-per-node", "auto", cpus=2)
    assert (cfg.nproc_per_node, cfg.omp_num_threads) == (2, 1)
    assert cfg.worker_env["OMP_NUM_THREADS"] == "1"
    line = cfg.describe()
    assert "2 worker(s)" in line and "2 CPU core(s), no GPU" in line and "OMP_NUM_THREADS=1" in line
    assert "\n" not in line


# ---------------------------------------------------------------- nodes and rendezvous

def test_parse_small_grammars():
    assert parse_nnodes("2") == (2, 2) and parse_nnodes("1:4") == (1, 4)
    assert parse_rank_list("0,2-3", flag="--ranks") == {0, 2, 3}
    assert parse_rdzv_conf("join_timeout=9, read_timeout=3") == (("join_timeout", "9"),
                                                                 ("read_timeout", "3"))
    for bad in ("0", "2:1", "a", "1:2:3"):
        with pytest.raises(ValueError, match="--nnodes"):
            parse_nnodes(bad)
    for bad in ("x", "3-1", "-1", ""):
        with pytest.raises(ValueError, match="--ranks"):
            parse_rank_list(bad, flag="--ranks")
    with pytest.raises(ValueError, match="key=value"):
        parse_rdzv_conf("join_timeout")


def test_one_node_gets_a_free_port_and_a_fresh_id():
    a, b = config(), config("--standalone")
    for cfg in (a, b):
        assert (cfg.rdzv_backend, cfg.rdzv_endpoint) == ("c10d", "localhost:0")
    assert a.rdzv_id != b.rdzv_id != config().rdzv_id


def test_static_rendezvous_from_master_flags():
    cfg = config("--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1",
                 "--master_port", "29400")
    assert (cfg.rdzv_backend, cfg.rdzv_endpoint, cfg.node_rank) == ("static", "10.0.0.1:29400", 1)
    assert cfg.rendezvous_options() == {"rank": 1, "timeout": 600}
    assert "waiting up to 600 s" in cfg.describe()


def test_endpoint_form_needs_no_node_rank():
    cfg = config("--nnodes", "2", "--rdzv-endpoint", "h:1234", "--rdzv-timeout", "7",
                 "--rdzv-conf", "read_timeout=5")
    assert (cfg.rdzv_backend, cfg.rdzv_endpoint, cfg.rdzv_id) == ("c10d", "h:1234", "none")
    assert cfg.rendezvous_options() == {"join_timeout": 7, "read_timeout": "5"}


@pytest.mark.parametrize("argv, needle", [
    (["--standalone", "--nnodes", "2"], "--standalone"),
    (["--nnodes", "2"], "needs a place to meet"),
    (["--nnodes", "2", "--master-port", "1", "--node-rank", "2"], "--node-rank 2"),
    (["--nnodes", "1:2", "--master-port", "1"], "fixed number"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--node-rank", "1"], "leave --node-rank out"),
    (["--rdzv-backend", "etcd"], "needs --rdzv-endpoint"),
    (["--max-restarts", "-1"], "--max-restarts -1"),
    (["--monitor-interval", "0"], "--monitor-interval"),
    (["--rdzv-timeout", "0"], "--rdzv-timeout"),
    (["--nnodes", "2", "--rdzv-backend", "static", "--rdzv-endpoint", "nohost"], "host:port"),
])
def test_contradictions_are_named(argv, needle):
    with pytest.raises(ValueError, match=needle):
        config(*argv)


def test_underscored_spellings_match_dashed_ones():
    dashed = parse("--nproc-per-node", "2", "--max-restarts", "3", "--monitor-interval", "0.5",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "j",
                   "--local-ranks-filter", "0", "--no-python", "train")
    under = parse("--nproc_per_node", "2", "--max_restarts", "3", "--monitor_interval", "0.5",
                  "--rdzv_backend", "c10d", "--rdzv_endpoint", "h:1", "--rdzv_id", "j",
                  "--local_ranks_filter", "0", "--no_python", "train")
    assert vars(dashed) == vars(under)


def test_script_arguments_are_left_alone():
    args = parse("--nproc-per-node", "2", "-m", "pkg.train", "--lr", "0.1", "--nproc-per-node", "9")
    assert (args.module, args.script, args.script_args) == (True, "pkg.train",
                                                            ["--lr", "0.1", "--nproc-per-node", "9"])



def test_a_scripts_flag_that_begins_like_ours_reaches_the_script():
    # argparse would take "--h" for an abbreviation of --hang-timeout (or --help) and
    # fail "ambiguous option"; and "--nproc" for --nproc-per-node.
    args = parse("--nproc-per-node", "2", "train.py", "--h", "3", "--nproc", "4")
    assert (args.nproc_per_node, args.script, args.script_args) == ("2", "train.py", ["--h", "3", "--nproc", "4"])


# ---------------------------------------------------------------- what the workers run

def test_worker_command_forms():
    py = "/usr/bin/python3"
    assert worker_command("t.py", ["-x"], python=py).args == ("-u", "t.py", "-x")
    m = worker_command("pkg.t", ["1"], module=True, python=py)
    assert (m.program, m.args, m.kind) == (py, ("-u", "-m", "pkg.t", "1"), TargetKind.MODULE)
    b = worker_command("./run.sh", ["a"], no_python=True, python=py)
    assert (b.program, b.args, b.kind) == ("./run.sh", ("a",), TargetKind.PROGRAM)
    with pytest.raises(ValueError, match="cannot be used together"):
        worker_command("x", [], module=True, no_python=True, python=py)


def test_check_target(tmp_path):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("raise SystemExit('must not be imported')")
    (tmp_path / "pkg" / "job.py").write_text("")
    ok = [worker_command("train.py", [], python="p"),
          worker_command("pkg.job", [], module=True, python="p"),
          worker_command("json.tool", [], module=True, python="p"),
          worker_command("true", [], no_python=True, python="p")]
    for cmd in ok:
        check_target(cmd, cwd=str(tmp_path))
    for cmd, needle in [(worker_command("nope.py", [], python="p"), "script 'nope.py' not found"),
                        (worker_command("pkg.nope", [], module=True, python="p"), "module 'pkg.nope'"),
                        (worker_command("no_such_tool_xyz", [], no_python=True, python="p"),
                         "program 'no_such_tool_xyz'")]:
        with pytest.raises(ValueError, match=needle):
            check_target(cmd, cwd=str(tmp_path))


# ---------------------------------------------------------------- output

def test_rank_prefix_and_lines():
    assert rank_prefix(3, 4) == "[rank 3] " and rank_prefix(3, 16) == "[rank  3] "
    assert split_lines(b"ab", b"c\nde\n\nf") == ([b"abc", b"de", b""], b"f")
    assert split_lines(b"", b"no newline") == ([], b"no newline")


def test_the_console_leaves_cpp_backtraces_to_the_log():
    """Note [C++ backtraces] in tandem/launch/output.py: a warning's first line stays,
    its backtrace (and the empty line closing it) goes, also across two reads."""
    warning = [b"[rank2]:[W1129 01:02:01.5 TCPStore.cpp:106] [c10d] sendBytes failed on SocketImpl(fd=11): "
               b"Broken pipe",
               b"Exception raised from sendBytes at torch/csrc/distributed/c10d/Utils.hpp:758 "
               b"(most recent call first):",
               b"frame #0: c10::Error::Error(c10::SourceLocation) + 0x9d (0x7f in libc10.so)",
               b"<omitting python frames>"]
    rest = [b"frame #23: _start + 0x21 (0x55 in python)", b"", b"tandem: rank 2 is cut off", b"", b"frame #1 is text"]
    kept, inside = without_backtraces(warning, False)
    assert kept == warning[:1] and inside
    assert without_backtraces(rest, inside) == ([b"tandem: rank 2 is cut off", b"", b"frame #1 is text"], False)
    plain = [b"step 1", b"", b"frame #0: not after an 'Exception raised from' line"]
    assert without_backtraces(plain, False) == (plain, False)


def _attempt_logs(tmp_path, world_size=2, restart=0):
    logs = WorkerLogs(tmp_path / "logs", worker_env={"OMP_NUM_THREADS": "4", "X": "1"})
    envs = {lr: {"RANK": str(10 + lr), "WORLD_SIZE": str(world_size),
                 "TORCHELASTIC_RESTART_COUNT": str(restart), "X": "agent"} for lr in range(2)}
    return logs, envs, logs.reify(envs)


def test_logs_layout_and_worker_env(tmp_path):
    logs, envs, dest = _attempt_logs(tmp_path, world_size=12)
    assert dest.stdouts[1] == str(tmp_path / "logs" / "attempt_0" / "rank_11" / "stdout.log")
    assert dest.error_files[0].endswith("rank_10/error.json") and dest.tee_stdouts == {}
    # The launcher's variables reach the workers; the agent's own win.
    assert envs[0]["OMP_NUM_THREADS"] == "4" and envs[0]["X"] == "agent"
    assert envs[1]["TORCHELASTIC_ERROR_FILE"] == dest.error_files[1]
    (attempt,) = logs.attempts
    assert (attempt.number, attempt.world_size, sorted(attempt.ranks)) == (0, 12, [10, 11])


def test_output_prefixes_whole_lines_and_filters(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    shown = RankOutput(out, err, ranks=frozenset({11}))
    logs = WorkerLogs(tmp_path / "logs", on_attempt=shown.follow)
    logs.reify({lr: {"RANK": str(10 + lr), "WORLD_SIZE": "12"} for lr in range(2)})
    shown.start()
    r10, r11 = logs.attempts[0].ranks[10], logs.attempts[0].ranks[11]
    r10.stdout.write_text("hidden\n")
    with open(r11.stdout, "w") as f:
        f.write("half a li")
        f.flush()
        time.sleep(0.3)  # the follower polls meanwhile: no line may be printed yet
        assert out.getvalue() == ""
        f.write("ne\nlast, unfinished")
    r11.stderr.write_text("oops\n")
    shown.stop()
    assert out.getvalue() == "[rank 11] half a line\n[rank 11] last, unfinished\n"
    assert err.getvalue() == "[rank 11] oops\n"


def test_output_follows_restarts(tmp_path):
    out = io.StringIO()
    shown = RankOutput(out, io.StringIO(), local_ranks=frozenset({0})).start()
    logs = WorkerLogs(tmp_path / "logs", on_attempt=shown.follow)
    for restart in range(2):
        logs.reify({lr: {"RANK": str(lr), "WORLD_SIZE": "2",
                         "TORCHELASTIC_RESTART_COUNT": str(restart)} for lr in range(2)})
        for rank in range(2):
            logs.attempts[-1].ranks[rank].stdout.write_text(f"attempt {restart}\n")
    shown.stop()
    assert out.getvalue() == "[rank 0] attempt 0\n[rank 0] attempt 1\n"


# ---------------------------------------------------------------- failure summary

TRACE = """some output
Traceback (most recent call last):
  File "train.py", line 3, in <module>
    main()
  File "train.py", line 2, in main
    raise ValueError("bad batch")
ValueError: bad batch
"""


def test_traceback_tail():
    assert traceback_tail(TRACE)[-1] == "ValueError: bad batch"
    assert traceback_tail(TRACE)[0].startswith("Traceback")
    long = "Traceback (most recent call last):\n" + "  frame\n" * 50 + "E: x\n"
    tail = traceback_tail(long, max_lines=5)
    assert tail == ("Traceback (most recent call last):", "  ...", "  frame", "  frame", "E: x")
    assert traceback_tail("python: can't open file 'x.py'\n\n") == ("python: can't open file 'x.py'",)


def _failure(rank, exitcode, last_write, text=""):
    return Failure(rank=rank, local_rank=rank, host="node7", exitcode=exitcode, text=text,
                   log=Path(f"/logs/rank_{rank}/stderr.log"), last_write=last_write)


def test_summary_names_the_first_failure():
    failures = [_failure(0, -signal.SIGTERM, 5.0), _failure(1, 1, 3.0, TRACE),
                _failure(2, 1, 4.0, "RuntimeError: Connection closed by peer"),
                _failure(3, -signal.SIGKILL, 9.0)]
    assert [f.rank for f in in_order_of_failure(failures)] == [1, 2, 3, 0]
    text = format_summary(failures, attempts=2, max_restarts=1, log_root="/logs")
    lines = text.splitlines()
    assert lines[0] == "rank 1 (local rank 1 on node7) failed first, with exit code 1"
    assert "    ValueError: bad batch" in lines
    assert "  full log: /logs/rank_1/stderr.log" in lines
    assert ("  then: rank 2 (exit code 1), rank 3 (signal SIGKILL), rank 0 (stopped by the "
            "launcher)") in lines
    assert "  gave up after 2 attempt(s) (--max-restarts 1)" in lines
    assert len(lines) < 20


def test_summary_reads_error_files_first(tmp_path):
    from tandem.launch.summary import collect_failures

    logs, _, _ = _attempt_logs(tmp_path)
    rank = logs.attempts[0].ranks[10]
    rank.stderr.write_text("noise\n")
    rank.error_file.write_text(json.dumps({"message": {"message": "KeyError: 'k'", "extraInfo": {
        "py_callstack": "Traceback (most recent call last):\n  File \"x\"\nKeyError: 'k'\n",
        "timestamp": "1"}}}))

    class PF:
        local_rank, exitcode = 0, 1

    (f,) = collect_failures({10: PF()}, logs.attempts[0], host="h")
    assert f.traceback[-1] == "KeyError: 'k'" and f.log == rank.stderr and f.last_write > 0


# ---------------------------------------------------------------- one store per attempt

class _FakeRendezvous:
    """A static-like handler: the same store every round, as torch's static one."""

    def __init__(self, store, rank):
        self.store, self.rank, self.rounds = store, rank, 0

    def get_backend(self):
        return "static"

    def next_rendezvous(self):
        from tandem._compat import rendezvous_info

        self.rounds += 1
        return rendezvous_info(self.store, self.rank, 2, "127.0.0.1", 1)

    def shutdown(self):
        return True


def test_every_attempt_gets_a_new_worker_store():
    timeout = datetime.timedelta(seconds=10)
    shared = dist.HashStore()
    node0 = FreshWorkerStore(_FakeRendezvous(shared, 0), timeout=timeout)
    node1 = FreshWorkerStore(_FakeRendezvous(shared, 1), timeout=timeout)
    ports = []
    for attempt in range(3):
        info0, info1 = node0.next_rendezvous(), node1.next_rendezvous()
        addr, port = info0.bootstrap_store_info.master_addr, info0.bootstrap_store_info.master_port
        assert (info1.bootstrap_store_info.master_port, info1.rank) == (port, 1)
        client = dist.TCPStore(addr, port, None, False, timeout)
        # A fresh store: nothing of the previous attempt's keys.
        assert client.check(["default_pg/barrier"]) is False
        client.set("default_pg/barrier", str(attempt))
        ports.append(port)
        del client
    assert len(set(ports)) == 3 and node0.use_agent_store and node0.get_backend() == "static"
    assert node0.shutdown() is True


# ---------------------------------------------------------------- command-line errors

@pytest.mark.parametrize("argv, needle", [
    (["--nproc-per-node", "0", "x.py"], "--nproc-per-node 0"),
    (["--nproc-per-node", "-2", "x.py"], "--nproc-per-node -2"),
    (["missing.py"], "script 'missing.py' not found"),
    (["-m", "no_such_pkg.train"], "module 'no_such_pkg.train' not found"),
])
def test_bad_input_fails_fast_with_one_line(argv, needle, tmp_path, monkeypatch, capsys):
    (tmp_path / "x.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", *argv]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert needle in err and err.startswith("tandem run: error:") and err.count("\n") == 1


def test_unknown_option_is_named_with_a_hint(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--nprocs-per-node", "2", "x.py"])
    assert info.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "unrecognized arguments: --nprocs-per-node" in err and "did you mean --nproc-per-node" in err


def test_output_does_not_hold_back_endless_lines(tmp_path):
    out = io.StringIO()
    shown = RankOutput(out, io.StringIO())
    logs = WorkerLogs(tmp_path / "logs", on_attempt=shown.follow)
    logs.reify({0: {"RANK": "0", "WORLD_SIZE": "1"}})
    logs.attempts[0].ranks[0].stdout.write_bytes(b"\r" + b"=" * 100_000)
    shown.start()
    time.sleep(0.3)
    assert out.getvalue().startswith("[rank 0] ===")  # printed before the job ends
    shown.stop()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
def test_output_shows_progress_bars_as_a_terminal_would(tmp_path, terminal):
    out = _Terminal() if terminal else io.StringIO()
    shown = RankOutput(out, io.StringIO())
    logs = WorkerLogs(tmp_path / "logs", on_attempt=shown.follow)
    logs.reify({0: {"RANK": "0", "WORLD_SIZE": "1"}})
    shown.start()
    with open(logs.attempts[0].ranks[0].stdout, "w") as f:
        # What tqdm writes: redraws, a message written over the bar, the final state.
        for text in ("\r 10%|#", "\r 50%|#####", "\r          \rnote\n", "\r 90%|#########"):
            f.write(text)
            f.flush()
            time.sleep(0.15)
        f.write("\r100%|##########\n")
    shown.stop()
    text = out.getvalue()
    if terminal:  # redraws shown in place, then each line replaces the bar
        assert "\r[rank 0]  10%|#\x1b[K" in text and "\r[rank 0] note\x1b[K\n" in text
        assert text.endswith("\r[rank 0] 100%|##########\x1b[K\n")
    else:  # logs and pipes get whole lines: what a terminal would finally show
        assert text == "[rank 0] note\n[rank 0] 100%|##########\n"


def test_an_elastic_job_counts_as_finished_only_the_workers_that_finished():
    """A worker lost on the way and not replaced is not among those that
    "finished" in the launcher's last line (it said "3 worker(s) ... finished"
    after one of the three was killed)."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import WorkerState

    from tandem.launch.elastic_agent import ElasticAgent

    def proc(code, pid):
        return SimpleNamespace(proc=SimpleNamespace(poll=lambda: code, pid=pid))

    lines = []
    agent = SimpleNamespace(_pcontext=SimpleNamespace(subprocess_handlers={0: proc(0, 10), 1: proc(-9, 11),
                                                                           2: proc(0, 12)},
                                                      error_files={0: "e0", 1: "e1", 2: "e2"}),
                            _dead={}, _crashed={}, _on_event=lines.append, _replacements_left=0,
                            _finished=lambda local: False, _watchdog=None,
                            _reports=SimpleNamespace(post=lambda *args: None))
    agent._failures = lambda group, codes: ElasticAgent._failures(agent, group, codes)
    group = SimpleNamespace(workers=[SimpleNamespace(global_rank=r) for r in (3, 4, 5)],
                            spec=SimpleNamespace(rdzv_handler=None))
    result = ElasticAgent._monitor_workers(agent, group)
    assert result.state is WorkerState.SUCCEEDED
    assert sorted(result.return_values) == [3, 5]
    assert sorted(result.failures) == [4] and result.failures[4].exitcode == -9  # torch's agent wants all
    assert lines == ["elastic: worker 4 (local 1, pid 11) exited with -9; the others go on"]
    config = LaunchConfig(nproc_per_node=3, elastic=True)
    assert cli._finished(config, result.return_values, "in 2.0 s") == \
        "2 of 3 worker(s) on this node finished in 2.0 s; 1 lost on the way and not replaced"
    assert cli._finished(config, {3: None, 4: None, 5: None}, "in 2.0 s") == \
        "3 worker(s) on this node finished in 2.0 s"
    assert cli._finished(LaunchConfig(nproc_per_node=3), {}, "in 2.0 s") == "3 worker(s) on this node finished in 2.0 s"
