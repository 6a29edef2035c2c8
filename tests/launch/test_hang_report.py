"""The pure parts of "no hang": the ledger, the hang report, the watchdog's
decision, and the launcher flags, in one process."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from tandem.comm.fingerprint import debug_flags
from tandem.comm.ledger import Ledger
from tandem.launch.cli import build_parser, config_from_args
from tandem.launch.config import LaunchConfig
from tandem.launch.hang import format_hang_report, main_thread_stack
from tandem.launch.logs import Attempt, RankLogs
from tandem.launch.watchdog import FINISH_GRACE_S, STARTUP_GRACE_S, Watchdog

DUMP = """\
Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/lib/tandem/comm/monitor.py", line 120 in _run

Current thread 0x00007f0000000001 (most recent call first):
  File "/lib/tandem/comm/group.py", line 70 in wait
  File "/home/me/train.py", line 88 in train_step
  File "/home/me/train.py", line 120 in <module>
"""


def test_ledger_keeps_the_last_entries_numbers_every_collective_and_counts_progress():
    ledger = Ledger(capacity=3)
    entries = [ledger.issue("all_reduce", f"bucket {i}", 10, "float32", "world") for i in range(5)]
    assert [e.seq for e in ledger.entries()] == [3, 4, 5]
    before = ledger.last_progress
    time.sleep(0.01)
    ledger.complete(entries[3])
    ledger.complete(entries[3])
    assert ledger.completed == 1 and ledger.last_progress > before
    assert [e.seq for e in ledger.in_flight()] == [3, 5]
    ledger.mark_step()
    ledger.mark_step(7)
    assert ledger.step == 7
    snap = ledger.snapshot(last=1)
    # The last entry, and every kept entry still in flight, whatever `last` says.
    assert [e["seq"] for e in snap["entries"]] == [3, 5]
    ledger.describe_tag("bucket 4", "params: fc.weight")
    ledger.describe_tag("bucket 3", "params: fc.bias")  # completed: not shown
    assert ledger.snapshot()["descriptions"] == {"bucket 4": "params: fc.weight"}
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        Ledger(capacity=0)


def test_main_thread_stack_is_found_by_ident_or_as_the_current_thread():
    frames = main_thread_stack(DUMP, 0x7F0000000001)
    assert [str(f) for f in frames] == ["/lib/tandem/comm/group.py:70 in wait",
                                        "/home/me/train.py:88 in train_step",
                                        "/home/me/train.py:120 in <module>"]
    assert main_thread_stack(DUMP, None) == frames
    assert main_thread_stack(DUMP, 0x7F0000000002)[1].func == "_run"
    assert main_thread_stack("", 1) == []


def _entry(seq: int, tag: str, *, done: bool, step: int = 1207, issued: float = 100.0) -> dict:
    return {"seq": seq, "op": "all_reduce", "tag": tag, "numel": 4096, "dtype": "float32",
            "group": "world", "step": step, "issued_at": issued,
            "completed_at": issued + 0.01 if done else None}


def test_the_report_names_the_rank_that_left_and_groups_the_waiting_ones():
    behind = {"main_thread": 1, "entries": [_entry(5320, "bucket 2", done=True),
                                            _entry(5321, "bucket 3", done=True)]}
    waiting = {"main_thread": 1, "entries": [_entry(5321, "bucket 3", done=True),
                                             _entry(5322, "bucket 4", done=False),
                                             _entry(5323, "bucket 5", done=False)],
               "descriptions": {"bucket 4": "params: blocks.3.mlp.weight, blocks.3.mlp.bias"}}
    text = format_hang_report({0: waiting, 1: behind, 2: waiting, 3: None}, {1: DUMP},
                              now=164.0, stalled_s=64.2, timeout_s=60,
                              library_paths=("/lib/tandem",))
    lines = text.splitlines()
    assert lines[0] == ("no rank completed a collective or started a step for 64.2 s "
                        "(--hang-timeout 60)")
    assert lines[1] == ("  rank 1: last completed #5321 all_reduce 'bucket 3' (4096 x float32) of "
                        "step 1207; now in Python at /lib/tandem/comm/group.py:70 in wait, called "
                        "from /home/me/train.py:88 in train_step")
    assert lines[2].startswith("  rank 3: wrote no progress")
    assert lines[3] == ("  ranks 0, 2: waiting in #5322 all_reduce 'bucket 4' (4096 x float32) of "
                        "step 1207 (params: blocks.3.mlp.weight, blocks.3.mlp.bias) for 64.0 s")
    assert "main-thread Python stacks (innermost first):" in lines
    assert "    /home/me/train.py:88 in train_step" in lines


def _attempt(tmp_path: Path, number: int, ranks: int) -> Attempt:
    logs = {}
    for r in range(ranks):
        d = tmp_path / f"attempt_{number}" / f"rank_{r}"
        d.mkdir(parents=True, exist_ok=True)
        logs[r] = RankLogs(rank=r, local_rank=r, stdout=d / "stdout.log", stderr=d / "stderr.log",
                           error_file=d / "error.json", progress=d / "progress.json",
                           stacks=d / "stacks.txt")
    return Attempt(number=number, world_size=ranks, ranks=logs)


def test_the_watchdog_fires_when_the_newest_progress_is_older_than_the_timeout(tmp_path):
    dog = Watchdog(timeout_s=10)
    attempt = _attempt(tmp_path, 0, 2)
    t0 = time.time()
    assert dog.stalled_for(attempt, now=t0) is None
    # No progress file yet: the workers are starting; the attempt's start counts
    # after the start-up grace (the timeout when that is longer).
    assert dog.stalled_for(attempt, now=t0 + 10.5) is None
    starting = Watchdog(timeout_s=10)
    assert starting.stalled_for(attempt, now=t0) is None
    assert starting.stalled_for(attempt, now=t0 + STARTUP_GRACE_S + 1) == pytest.approx(STARTUP_GRACE_S + 1)
    patient = Watchdog(timeout_s=90)
    assert patient.stalled_for(attempt, now=t0) is None
    assert patient.stalled_for(attempt, now=t0 + 89) is None
    # A rank that progressed while another is still starting has not hung: its
    # peer may still be importing torch, before its first progress file or after
    # it (tandem.init writes one), before its first collective. After the grace it has.
    progressed, starting_file = json.dumps({"completed": 3, "step": 1}), json.dumps({"completed": 0, "step": 0})
    attempt.ranks[0].progress.write_text(progressed)
    os.utime(attempt.ranks[0].progress, (t0 + 1, t0 + 1))
    for peer in (None, starting_file):
        if peer is not None:
            attempt.ranks[1].progress.write_text(peer)
            os.utime(attempt.ranks[1].progress, (t0 + 1, t0 + 1))
        slow_start = Watchdog(timeout_s=10)
        assert slow_start.stalled_for(attempt, now=t0) is None
        assert slow_start.stalled_for(attempt, now=t0 + 30) is None, peer
        assert slow_start.stalled_for(attempt, now=t0 + STARTUP_GRACE_S + 1) == pytest.approx(STARTUP_GRACE_S)
    # A rank that progressed recently keeps the job alive; the newest file counts.
    os.utime(attempt.ranks[0].progress, (t0 + 20, t0 + 20))
    attempt.ranks[1].progress.write_text(progressed)
    os.utime(attempt.ranks[1].progress, (t0 + 5, t0 + 5))
    assert dog.stalled_for(attempt, now=t0 + 29) is None
    assert dog.stalled_for(attempt, now=t0 + 31) == pytest.approx(11)
    # A new attempt starts its own clock.
    assert dog.stalled_for(_attempt(tmp_path, 1, 2), now=t0 + 40) is None


def test_a_rank_that_finished_gives_the_attempt_the_finishing_grace(tmp_path):
    # Note [finishing]: both ranks progressed; once one has left (its last snapshot
    # is marked), the others' teardown without progress is not a hang before the grace.
    attempt = _attempt(tmp_path, 0, 2)
    t0 = time.time()
    dog = Watchdog(timeout_s=4)
    assert dog.stalled_for(attempt, now=t0) is None
    progressed = {"completed": 19, "step": 8, "entries": []}
    for r in (0, 1):
        attempt.ranks[r].progress.write_text(json.dumps(progressed))
        os.utime(attempt.ranks[r].progress, (t0 + 1, t0 + 1))
    # Without a finished rank the timeout holds (the control of this test).
    assert dog.stalled_for(attempt, now=t0 + 5.5) == pytest.approx(4.5)
    attempt.ranks[0].progress.write_text(json.dumps({**progressed, "finished_at": t0 + 1}))
    os.utime(attempt.ranks[0].progress, (t0 + 1, t0 + 1))
    finishing = Watchdog(timeout_s=4)
    assert finishing.stalled_for(attempt, now=t0) is None
    assert finishing.stalled_for(attempt, now=t0 + 5.5) is None
    assert finishing.stalled_for(attempt, now=t0 + 30) is None
    assert finishing.stalled_for(attempt, now=t0 + FINISH_GRACE_S + 2) == pytest.approx(FINISH_GRACE_S + 1)
    # The report says which rank left, and when.
    snaps = {0: {**progressed, "finished_at": t0 + 1,
                 "entries": [{"seq": 19, "op": "all_gather", "tag": "rng state", "numel": 1, "dtype": "int64",
                              "step": 8, "issued_at": t0, "completed_at": t0 + 0.5}]}, 1: None}
    text = format_hang_report(snaps, {}, now=t0 + 3, stalled_s=2, timeout_s=4)
    assert "rank 0: last completed #19 all_gather 'rng state' (1 x int64) of step 8; finished its work 2.0 s ago" \
        in text, text


def test_a_monitor_that_stops_writes_its_last_progress_marked_finished(tmp_path):
    from tandem.comm.monitor import Monitor
    path = tmp_path / "progress.json"
    monitor = Monitor(rank=0, world_size=1, store=None, progress_file=str(path), stacks_file=None,
                      debug=False, timeout_s=30.0)
    monitor.start()
    assert "finished_at" not in json.loads(path.read_text())
    monitor.ledger.mark_step(7)  # progress the periodic writer has not seen yet
    monitor.stop(left=False)  # replaced by another group's monitor: not finished
    assert "finished_at" not in json.loads(path.read_text())
    monitor.start()
    monitor.stop(left=True)
    last = json.loads(path.read_text())
    assert last["step"] == 7 and last["finished_at"] <= time.time()


def test_hang_flags_reach_the_config_and_the_workers():
    parser = build_parser()
    args = parser.parse_args(["run", "--hang-timeout", "30", "--debug-collectives", "x.py"])
    config = config_from_args(args, cpus=2, gpus=0, environ={})
    assert config.hang_timeout_s == 30 and config.debug_collectives
    assert config.worker_env["TANDEM_DEBUG"] == "collectives"
    assert "hang watchdog 30 s" in config.describe()
    assert debug_flags({"TANDEM_DEBUG": " Collectives, other"}) == {"collectives", "other"}
    with pytest.raises(ValueError, match="--hang-timeout 0 is invalid"):
        LaunchConfig(nproc_per_node=1, hang_timeout_s=0)


def test_a_dump_read_halfway_is_waited_for_until_the_main_thread_is_in_it(tmp_path):
    # Note [whole dumps]: faulthandler writes thread by thread; the watchdog must
    # not take the monitor thread's block alone for the rank's dump.
    from tandem.launch.watchdog import _await_stacks

    attempt = _attempt(tmp_path, 0, 1)
    main = 0x7F707626DB80
    monitor = "Thread 0x00007f7051d666c0 (most recent call first):\n  File \"m.py\", line 1 in _run\n\n"
    whole = monitor + (f"Current thread 0x{main:016x} (most recent call first):\n"
                       "  File \"train.py\", line 20 in forward\n")
    attempt.ranks[0].stacks.write_text(monitor)
    finish = threading.Timer(0.3, attempt.ranks[0].stacks.write_text, args=(whole,))
    finish.start()
    try:
        stacks = _await_stacks(attempt, {0: main})
    finally:
        finish.join()
    assert main_thread_stack(stacks[0], main)[0].func == "forward"
