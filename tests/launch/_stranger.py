"""The stranger of tests/launch/test_cluster_faults.py: a process on a third
node of the cluster, without the job secret, that knows every port the job
listens on and tries what an attacker on the network would:

(a) to join as a replacement, with tandem's own code, at every store;
(b) forged values under the keys the launchers and workers read or used to
    read without a secret, among them pickles whose unpickling would create
    the marker file (torch's c10d rendezvous state is a pickle);
(c) raw bytes, a pickle among them, to every port.

Arguments: a JSON list of ``[address, port, kind]`` (kind ``store``: a port of
a launcher; ``listener``: a worker's), the marker's path, the job's run id.
Prints one JSON line: what each attempt was told.
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

import torch.distributed as dist

from tandem.comm.membership import ElasticConfig, Membership

WORLD = 4


class Marker:
    """Unpickled, it creates the marker file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.path, "w"))


def join(store: dist.Store, where: str, told: dict[str, str]) -> None:
    try:
        Membership.joining(store, ElasticConfig(regroup_timeout_s=4.0))
        told[where] = "admitted"
    except Exception as e:  # noqa: BLE001 - what it was told is the result
        told[where] = f"{type(e).__name__}: {e}"


def forge(store: dist.Store, run_id: str, pickled: bytes, me: str) -> None:
    store.set(f"torch.rendezvous.{run_id}", base64.b64encode(pickled))
    for round_ in range(4):
        store.set(f"torch.rendezvous.{run_id}.{round_}/tandem/worker_store_port", "1")
    store.set(f"tandem/nodes/{run_id}/workers", f"{me}:1")
    for rank in range(WORLD):
        store.set(f"tandem/progress/{rank}", pickled)
        for prefix in ("default_pg/", *(f"tandem/elastic/gen/{g}/pg/default_pg/" for g in range(4))):
            store.set(f"{prefix}tandem/alive/{rank}", "exited")
            store.set(f"{prefix}tandem/waiting/{rank}", pickled)
    store.set("tandem/elastic/latest", "1")
    store.set("tandem/elastic/gen/1/members", json.dumps(["stranger"]))
    for g in range(4):
        for step in range(64):
            store.set(f"tandem/elastic/gen/{g}/step/{step}/decision", "abort")


def main() -> None:
    ports = [tuple(p) for p in json.loads(sys.argv[1])]
    marker, run_id = sys.argv[2], sys.argv[3]
    pickled = pickle.dumps(Marker(marker))
    me = socket.gethostbyname(socket.gethostname())
    result: dict[str, dict[str, str]] = {"raw": {}, "join": {}, "forged": {}}
    for address, port, _ in ports:  # (c) first: gloo closes some of its listeners soon
        for data in (pickled, os.urandom(256), b"\xff" * 4096):
            try:
                with socket.create_connection((address, port), timeout=2) as s:
                    s.sendall(data)
                result["raw"][f"{address}:{port}"] = "sent"
            except OSError as e:
                result["raw"][f"{address}:{port}"] = f"{type(e).__name__}: {e}"
    stores: dict[str, dist.Store] = {}
    for address, port, kind in ports:
        if kind == "store":
            stores[f"{address}:{port}"] = dist.TCPStore(address, port, None, False, datetime.timedelta(seconds=3),
                                                         wait_for_workers=False)
    threads = [threading.Thread(target=join, args=(store, where, result["join"])) for where, store in stores.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for where, store in stores.items():
        try:
            forge(store, run_id, pickled, me)
            result["forged"][where] = "written"
        except Exception as e:  # noqa: BLE001 - the job may have ended meanwhile
            result["forged"][where] = f"{type(e).__name__}: {e}"
    print(json.dumps(result), flush=True)
    os._exit(0)  # the joins' beat threads and the store clients: nothing to wait for


if __name__ == "__main__":
    main()
