"""Debug mode: the ranks compare each collective before issuing it.

``TANDEM_DEBUG=collectives`` (or ``tandem run --debug-collectives``) turns it on.
Before each collective of a group, every rank posts a fingerprint (its sequence
number, op, tag, shape, dtype) in the job's store under the group's call
counter, and reads the other ranks' fingerprints for the same call. Any
difference raises :class:`CollectiveMismatchError` on every rank, naming each
side, before the collective runs: a rank that skipped an all-reduce, or sent
another shape, is caught where gloo would hang, abort, or silently reduce
mismatched buffers.

It costs one store write and one read per peer per collective, so it is for
finding a bug, not for production runs. A rank that leaves (``tandem.shutdown``)
posts a ``shutdown`` fingerprint, so a peer still issuing collectives learns
that too instead of waiting.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from tandem.comm.ledger import LedgerEntry
from tandem.comm.peers import PeerLostError, PeerWatch

__all__ = ["CollectiveMismatchError", "FingerprintCheck", "debug_flags"]

_WAIT_SLICE = datetime.timedelta(seconds=0.5)


def debug_flags(environ: Mapping[str, str]) -> frozenset[str]:
    """The comma-separated flags of ``TANDEM_DEBUG`` (``collectives``, ...)."""
    raw = environ.get("TANDEM_DEBUG", "")
    return frozenset(f.strip().lower() for f in raw.split(",") if f.strip())


class CollectiveMismatchError(RuntimeError):
    """The ranks were about to issue different collectives (debug mode).

    Attributes:
        fingerprints: global rank to the fingerprint that rank posted.
    """

    def __init__(self, rank: int, group: str, call: int, fingerprints: dict[int, dict[str, Any]]) -> None:
        self.fingerprints = dict(fingerprints)
        sides: dict[str, list[int]] = {}
        for r, fp in sorted(fingerprints.items()):
            sides.setdefault(_describe(fp), []).append(r)
        listed = "; ".join(f"{_ranks(rs)} issued {what}" for what, rs in sides.items())
        super().__init__(
            f"rank {rank}: collective mismatch at call {call} of group {group!r}: {listed}. "
            "Every rank must issue the same collectives, with the same shapes, in the same "
            "order: look for a branch on the rank or on data (an early exit, a skipped "
            "backward, an uneven last batch) before this point")


class FingerprintCheck:
    """Compares each collective's fingerprint across the ranks of its group.

    Args:
        store: the job's c10d store.
        rank: this process's global rank.
        watch: the peers' heartbeats, so that a peer that died is named rather
            than waited for.
        timeout_s: how long to wait for a peer's fingerprint at most.
    """

    def __init__(self, store: dist.Store, rank: int, watch: PeerWatch, timeout_s: float) -> None:
        self.store = store
        self.rank = rank
        self.watch = watch
        self.timeout_s = timeout_s
        self._calls: dict[str, int] = {}
        self._members: dict[str, tuple[int, ...]] = {}

    def check(self, group: str, ranks: Sequence[int], entry: LedgerEntry,
              shape: Sequence[int]) -> None:
        """Post this rank's fingerprint for ``entry`` and compare it with the
        other ranks' for the same call of ``group``.

        Raises:
            CollectiveMismatchError: a peer posted a different one.
            PeerLostError: a peer died before posting.
            TimeoutError: a peer posted nothing within the timeout.
        """
        call = self._calls.get(group, 0) + 1
        self._calls[group] = call
        self._members[group] = tuple(ranks)
        mine = {"seq": entry.seq, "op": entry.op, "tag": entry.tag, "shape": list(shape),
                "dtype": entry.dtype}
        theirs = self._exchange(group, call, ranks, mine)
        if any(_key(fp) != _key(mine) for fp in theirs.values()):
            raise CollectiveMismatchError(self.rank, group, call, {**theirs, self.rank: mine})

    def post_shutdown(self) -> None:
        """Tell peers still issuing collectives that this rank has left."""
        for group, call in self._calls.items():
            try:
                self.store.set(_fp_key(group, call + 1, self.rank),
                               json.dumps({"op": "shutdown", "tag": "", "shape": [], "dtype": ""}))
            except Exception:  # noqa: BLE001 - best effort on the way out
                return

    def _exchange(self, group: str, call: int, ranks: Sequence[int],
                  mine: dict[str, Any]) -> dict[int, dict[str, Any]]:
        self.store.set(_fp_key(group, call, self.rank), json.dumps(mine))
        others = [r for r in ranks if r != self.rank]
        keys = [_fp_key(group, call, r) for r in others]
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                self.store.wait(keys, _WAIT_SLICE)
                break
            except RuntimeError as e:
                if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                    raise
            lost = self.watch.observe(others)
            if lost:
                raise PeerLostError(self.rank, lost, f"the fingerprint check of call {call} "
                                    f"of group {group!r} ({_describe(mine)})")
            if time.monotonic() > deadline:
                missing = [r for r, k in zip(others, keys) if not self.store.check([k])]
                raise TimeoutError(
                    f"rank {self.rank}: {_ranks(missing)} did not reach call {call} of group "
                    f"{group!r} ({_describe(mine)}) within {self.timeout_s:g} s")
        theirs = {r: json.loads(self.store.get(k)) for r, k in zip(others, keys)}
        if call > 2:
            # Every peer has posted call `call`, so all have read this rank's call - 2.
            try:
                self.store.delete_key(_fp_key(group, call - 2, self.rank))
            except Exception:  # noqa: BLE001 - some stores cannot delete; keys are small
                pass
        return theirs


def _fp_key(group: str, call: int, rank: int) -> str:
    return f"tandem/fp/{group}/{call}/{rank}"


def _key(fp: Mapping[str, Any]) -> tuple[Any, ...]:
    return fp["op"], fp["tag"], tuple(fp["shape"]), fp["dtype"]


def _describe(fp: Mapping[str, Any]) -> str:
    if fp["op"] == "shutdown":
        return "tandem.shutdown() (it has left)"
    tag = f" '{fp['tag']}'" if fp["tag"] else ""
    seq = f"#{fp['seq']} " if "seq" in fp else ""
    return f"{seq}{fp['op']}{tag} of shape {list(fp['shape'])} {fp['dtype']}"


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
