"""A rank that ends right after :func:`tandem.shutdown` while its monitor's
last heartbeat still waits for the store's answer (Note [a beat in flight at
exit] in tandem/comm/monitor.py): the process exits 0, not with SIGABRT.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

TIMEOUT_S = 60.0

_SCRIPT = textwrap.dedent("""
    import datetime, threading, time
    import torch.distributed as dist
    from tandem.comm import monitor as monitor_module
    from tandem.comm.monitor import Monitor
    from tandem.comm.peers import Liveness

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    beating, waits = threading.Event(), {"n": 0}

    class SlowStore:
        # A beat that waits in torch, with the GIL released, for an answer that
        # comes in 0.5 s, as a loaded store's does.
        def set(self, key, value):
            waits["n"] += 1
            if waits["n"] > 1:   # the first beat is the one start() makes
                beating.set()
                try:
                    store.wait(["never"], datetime.timedelta(seconds=0.5))
                except Exception:
                    pass

        def check(self, keys):
            return True

    monitor = Monitor(rank=0, world_size=2, store=store, liveness=Liveness(beat_s=0.01))
    monitor._beat_store = SlowStore()
    monitor_module.JOIN_S = 0.05   # stop() gives up on the beat long before its answer
    monitor.start()
    assert beating.wait(30)
    monitor.stop(left=False)
    print("STOPPED", monitor_module.JOIN_S, flush=True)

    class Finalizing:
        def __del__(self, time=time):
            time.sleep(1.0)   # the interpreter finalizes while the beat comes back

    finalizing = Finalizing()
""")


def test_a_beat_in_flight_when_the_script_ends_is_let_return_before_the_interpreter_finalizes() -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=TIMEOUT_S)
    assert "STOPPED" in done.stdout, done.stdout[-3000:]
    assert done.returncode == 0 and "terminate called" not in done.stdout, (done.returncode, done.stdout[-3000:])
