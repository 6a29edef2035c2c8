"""A script that ends while one of tandem's daemon threads still waits in a
store call that its ``stop`` gave up on (Note [a store call in flight at exit]
in tandem/comm/thread_exit.py): the process exits 0, not with SIGABRT.

Each case runs in a subprocess whose store call returns from torch 0.5 s after
the thread was given up on, while its interpreter finalizes (an object's
``__del__`` holds the finalization for 1 s). Without the join at exit both
abort with exit -6 and "terminate called without an active exception" (checked).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

TIMEOUT_S = 60.0

_STORE = """
    import datetime, threading, time
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def slow_call():
        # A call that waits in torch, with the GIL released, for an answer that
        # comes in 0.5 s, as a loaded store's does.
        try:
            store.wait(["never"], datetime.timedelta(seconds=0.5))
        except Exception:
            pass
"""

_FINALIZING = """
    class Finalizing:
        def __del__(self, time=time):
            time.sleep(1.0)   # the interpreter finalizes while the call comes back

    finalizing = Finalizing()
"""

_THREAD = """
    from tandem.comm.thread_exit import join_before_exit

    started = threading.Event()

    def run():
        started.set()
        slow_call()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(30)
    join_before_exit(thread, 0.05)
    print("STOPPED", thread.is_alive(), flush=True)
"""

_MONITOR = """
    from tandem.comm import monitor as monitor_module
    from tandem.comm.monitor import Monitor
    from tandem.comm.peers import Liveness

    beating, beats = threading.Event(), {"n": 0}

    class SlowStore:
        def set(self, key, value):
            beats["n"] += 1
            if beats["n"] > 1:   # the first beat is the one start() makes
                beating.set()
                slow_call()

        def check(self, keys):
            return True

    monitor = Monitor(rank=0, world_size=2, store=store, liveness=Liveness(beat_s=0.01))
    monitor._beat_store = SlowStore()
    monitor_module.JOIN_S = 0.05   # stop() gives up on the beat long before its answer
    monitor.start()
    assert beating.wait(30)
    monitor.stop(left=False)
    print("STOPPED", flush=True)
"""


@pytest.mark.parametrize("body", [_THREAD, _MONITOR], ids=["a_thread", "the_monitor"])
def test_a_store_call_in_flight_when_the_script_ends_is_let_return_before_the_interpreter_finalizes(
        body: str) -> None:
    script = textwrap.dedent(_STORE) + textwrap.dedent(body) + textwrap.dedent(_FINALIZING)
    done = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=TIMEOUT_S)
    assert "STOPPED" in done.stdout, done.stdout[-3000:]
    assert done.returncode == 0 and "terminate called" not in done.stdout, (done.returncode, done.stdout[-3000:])


_STUCK = """
    import datetime, logging, threading
    import torch.distributed as dist
    from tandem.comm import thread_exit
    from tandem.comm.thread_exit import join_before_exit

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    thread_exit.EXIT_JOIN_S = 1.0
    logging.basicConfig()   # tandem's warnings shown, as a job that configures logging sees them

    def stuck():
        try:   # a store that does not answer for a minute
            store.wait(["never"], datetime.timedelta(seconds=60))
        except Exception:
            pass

    for name in ("first", "second", "third"):
        thread = threading.Thread(target=stuck, name=name, daemon=True)
        thread.start()
        join_before_exit(thread, 0.01)
    print("EXITING", flush=True)
"""


def test_threads_that_never_return_hold_the_exit_for_the_bound_in_all_and_are_named() -> None:
    """Three threads whose store calls outlast the exit: the process waits
    EXIT_JOIN_S for all of them together, not for each, and names them in one
    warning when it gives up."""
    script = textwrap.dedent(_STUCK)
    done = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0 and "terminate called" not in done.stdout, (done.returncode, done.stdout[-3000:])
    assert "first, second, third still wait(s) for the job's store after 1 s at exit" in done.stdout, done.stdout
