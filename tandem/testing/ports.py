"""The TCP ports processes listen on, read from ``/proc`` (Linux):
:func:`listening_ports`, :func:`descendants`.

``/proc/<pid>/net/tcp`` is the table of the network namespace ``pid`` lives
in, so a process of a :class:`~tandem.testing.Cluster` node is read from the
host as it sees itself. Used by the tests that check where a job's stores and
listeners are reachable (Note [a store on the job's address] in
tandem/store/listening_store.py).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterable

__all__ = ["descendants", "listening_ports"]

_LISTEN = "0A"


def listening_ports(pids: Iterable[int]) -> dict[int, list[tuple[str, int]]]:
    """``{pid: [(address, port), ...]}``: the TCP sockets each process
    listens on (an address of ``0.0.0.0`` or ``::`` is every interface); a
    process that has ended is left out."""
    out: dict[int, list[tuple[str, int]]] = {}
    for pid in pids:
        try:
            inodes = _socket_inodes(pid)
            table = _listening(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue
        out[pid] = sorted(table[i] for i in inodes if i in table)
    return out


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, ()))
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _listening(pid: int) -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of the listening sockets in ``pid``'s network namespace."""
    table: dict[str, tuple[str, int]] = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] != _LISTEN:
                continue
            raw, port = fields[1].split(":")
            table[fields[9]] = (_address(raw, family), int(port, 16))
    return table


def _address(raw: str, family: socket.AddressFamily) -> str:
    data = bytes.fromhex(raw)
    # the kernel prints each 32-bit word in host order
    words = struct.unpack(f"<{len(data) // 4}I", data)
    packed = struct.pack(f">{len(words)}I", *words)
    return str(ipaddress.ip_address(packed)) if family == socket.AF_INET6 or len(packed) == 4 else raw
