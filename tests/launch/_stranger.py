"""The stranger of tests/launch/test_cluster_faults.py: a process on a third
node of the cluster, without the job secret, that knows every port the job
listens on and, for as long as it is told, tries what an attacker on the
network would, in rounds:

(a) to open a store session at every port (torch's ``TCPStore`` client);
    where one opens: list every key, read each, overwrite each with junk and
    with a pickle whose unpickling would create the marker file, add to each
    (huge numbers too), write the names the launchers and workers read or
    used to read, and ask to join as a replacement with tandem's own code;
(b) raw bytes, a pickle among them, to every port.

A session still connecting after 3 s is given up (gloo's listener accepts
torch's store client and never answers it).

Arguments: a JSON list of ``[address, port]``, the marker's path, the job's
run id, and how many seconds to go on. Prints one JSON line: the sessions it
opened and what each refused attempt was told.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import pickle
import socket
import sys
import threading
import time

import torch.distributed as dist

from tandem.control.generation import ElasticConfig
from tandem.control.membership import Membership

WORLD = 4
JUNK = (b"\xff" * 64, b"not a number", b"-1")


class Marker:
    """Unpickled, it creates the marker file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.path, "w"))


def guessed_keys(run_id: str) -> list[str]:
    keys = [f"torch.rendezvous.{run_id}", "tandem/elastic/latest", "tandem/elastic/joiners",
            "tandem/elastic/gen/1/members", f"tandem/nodes/{run_id}/workers", f"tandem/nodes/{run_id}/nodes"]
    keys += [f"torch.rendezvous.{run_id}.{r}/tandem/worker_store_port" for r in range(4)]
    for rank in range(WORLD):
        keys += [f"tandem/progress/{rank}", f"tandem/elastic/beat/{rank}"]
        for prefix in ("default_pg/", *(f"tandem/elastic/gen/{g}/pg/default_pg/" for g in range(4))):
            keys += [f"{prefix}tandem/alive/{rank}", f"{prefix}tandem/waiting/{rank}", f"{prefix}{rank}"]
    keys += [f"tandem/elastic/gen/{g}/step/{s}/decision" for g in range(4) for s in range(64)]
    return keys


def attack(store: dist.Store, run_id: str, pickled: bytes) -> None:
    """Everything a session allows: list, read, overwrite, add, and ask to join."""
    listed = [str(k) for k in store.list_keys()] if hasattr(store, "list_keys") else []
    writes = [("get", None), ("set", pickled), ("set", base64.b64encode(pickled)), ("add", 2**62), ("add", 20000),
              *(("set", j) for j in JUNK)]
    for key in listed + guessed_keys(run_id):
        for call, value in writes:
            try:
                getattr(store, call)(key, *(() if value is None else (value,)))
            except Exception:  # noqa: BLE001, S112 - a counter refuses a set, a value an add: go on
                continue
    try:
        Membership.joining(store, ElasticConfig(regroup_timeout_s=2.0))
    except Exception:  # noqa: BLE001, S110 - refused, as it should be
        pass


def session(address: str, port: int, run_id: str, pickled: bytes, told: dict[str, str]) -> None:
    where = f"{address}:{port}"
    try:
        store = dist.TCPStore(address, port, None, False, datetime.timedelta(seconds=1), wait_for_workers=False)
    except Exception as e:  # noqa: BLE001 - what it was told is the result
        told.setdefault(where, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return
    told[where] = "opened"
    attack(store, run_id, pickled)


def raw(address: str, port: int, pickled: bytes) -> None:
    for data in (pickled, os.urandom(256), b"\xff" * 4096):
        try:
            with socket.create_connection((address, port), timeout=1) as s:
                s.sendall(data)
        except OSError:
            pass


def main() -> None:
    ports = [tuple(p) for p in json.loads(sys.argv[1])]
    marker, run_id, seconds = sys.argv[2], sys.argv[3], float(sys.argv[4])
    pickled = pickle.dumps(Marker(marker))
    told: dict[str, str] = {}
    rounds = 0
    deadline = time.monotonic() + seconds
    while rounds == 0 or time.monotonic() < deadline:
        for address, port in ports:
            raw(address, port, pickled)
        threads = {f"{a}:{p}": threading.Thread(target=session, args=(a, p, run_id, pickled, told), daemon=True)
                   for a, p in ports}
        for t in threads.values():
            t.start()
        # A store client connected to a port that is not a store's (gloo's listener)
        # waits for an answer that never comes, past its timeout: such a session
        # opened nothing, and the next round goes on without it.
        round_ends = time.monotonic() + 3
        for where, t in threads.items():
            t.join(max(0.0, round_ends - time.monotonic()))
            if t.is_alive():
                told.setdefault(where, "no answer in 3 s (not a store)")
        rounds += 1
    print(json.dumps({"told": told, "rounds": rounds}), flush=True)
    os._exit(0)  # a join's beat thread and the store clients: nothing to wait for


if __name__ == "__main__":
    main()
