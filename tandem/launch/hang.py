"""The hang report: where each rank is when a job stopped making progress.

Pure: it reads what the workers left (their progress snapshots, written by
:mod:`tandem.comm.monitor`, and the stacks ``faulthandler`` dumped on SIGUSR1)
and writes text. The watchdog (:mod:`tandem.launch.watchdog`) gathers the
inputs. The report groups ranks by what they are doing::

    no rank completed a collective or started a step for 10.4 s (--hang-timeout 10)
      rank 1: last completed #12 all_reduce 'bucket 0' (1024 x float32) of step 3;
        now in Python at train.py:41 in train_step
      ranks 0, 2, 3: waiting in #13 all_reduce 'bucket 1' (1024 x float32) of step 3
        (params: fc.weight, fc.bias) for 10.3 s
      the others wait for rank 1: it has not issued #13, which ranks 0, 2, 3 wait in

followed by each rank's main-thread stack. Ranks of other nodes (``remote``)
come from the progress they posted in the job's store and carry their host;
their stacks are in their own node's report.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Frame", "format_hang_report", "main_thread_stack", "stuck_ranks"]

STACK_FRAMES_SHOWN = 12
"""At most this many frames of each rank's main-thread stack (innermost first)."""

_THREAD_HEADER = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.func}"


def main_thread_stack(dump: str, main_thread: int | None) -> list[Frame]:
    """The main thread's frames, innermost first, from a ``faulthandler`` dump
    with every thread (the last dump in ``dump`` wins). With ``main_thread``
    unknown, the thread marked current (the one the signal interrupted)."""
    blocks: dict[int, list[Frame]] = {}
    current: int | None = None
    frames: list[Frame] | None = None
    for line in dump.splitlines():
        header = _THREAD_HEADER.match(line)
        if header:
            ident = int(header.group(1), 16)
            frames = blocks[ident] = []
            if line.startswith("Current thread"):
                current = ident
            continue
        frame = _FRAME.match(line)
        if frame and frames is not None:
            frames.append(Frame(frame["file"], int(frame["line"]), frame["func"].strip()))
    wanted = main_thread if main_thread in blocks else current
    return blocks.get(wanted, []) if wanted is not None else []


def format_hang_report(snapshots: Mapping[int, Mapping[str, Any] | None], stacks: Mapping[int, str],
                       *, now: float, stalled_s: float, timeout_s: float,
                       library_paths: Sequence[str] = (), remote: Collection[int] = ()) -> str:
    """The report (see the module docstring).

    Args:
        snapshots: global rank to its last progress snapshot, None when it wrote none.
        stacks: global rank to its ``faulthandler`` dump ("" when none came).
        now: wall-clock time of the report.
        stalled_s: how long nothing progressed.
        timeout_s: the watchdog's timeout.
        library_paths: path prefixes of library code (torch, tandem, the
            standard library): "now in Python at" names the innermost frame
            outside them, too, when the innermost one is inside.
        remote: the ranks of other nodes (their snapshots came from the store).
    """
    lines = [f"no rank completed a collective or started a step for {stalled_s:.1f} s "
             f"(--hang-timeout {timeout_s:g})"]
    waiting: dict[tuple[int, str], list[int]] = {}
    waiting_text: dict[tuple[int, str], str] = {}
    behind: list[int] = []
    for rank in sorted(snapshots):
        snap = snapshots[rank]
        if snap is None:
            lines.append(f"  rank {rank}: wrote no progress (it has not reached tandem.init(), "
                         "or does not use tandem)")
            continue
        entries = snap.get("entries", [])
        flying = [e for e in entries if e.get("completed_at") is None]
        if flying:
            e = min(flying, key=lambda e: e["seq"])
            key = (e["seq"], f"{e['op']} {e['tag']}")
            waiting.setdefault(key, []).append(rank)
            params = snap.get("descriptions", {}).get(e["tag"])
            detail = f" ({params})" if params else ""
            waiting_text[key] = (f"waiting in {_entry(e)} of step {e['step']}{detail} for "
                                 f"{max(0.0, now - e['issued_at']):.1f} s")
            continue
        done = [e for e in entries if e.get("completed_at") is not None]
        last = (f"last completed {_entry(max(done, key=lambda e: e['seq']))} of step "
                f"{max(done, key=lambda e: e['seq'])['step']}" if done
                else "has completed no collective")
        behind.append(rank)
        if "finished_at" in snap:  # Note [finishing] in watchdog.py
            lines.append(f"  rank {rank}: {last}; finished its work "
                         f"{max(0.0, now - snap['finished_at']):.1f} s ago and is leaving")
            continue
        if rank in remote:
            lines.append(f"  rank {rank} ({_node(snap)}): {last}; not in a collective (its stack is in "
                         "its node's report)")
            continue
        frames = main_thread_stack(stacks.get(rank, ""), snap.get("main_thread"))
        lines.append(f"  rank {rank}: {last}; {_where(frames, library_paths)}")
    for key, ranks in sorted(waiting.items()):
        lines.append(f"  {_ranks(ranks)}: {waiting_text[key]}")
    if waiting:
        # The collective the most ranks wait in; the ranks that have not issued it hold them up.
        (seq, _), waiters = max(waiting.items(), key=lambda kv: (len(kv[1]), -kv[0][0]))
        late = [r for r in behind if _issued(snapshots[r] or {}) < seq]
        if late:
            who = ", ".join(f"rank {r}" + (f" ({_node(snapshots[r] or {})})" if r in remote else "")
                            for r in late)
            lines.append(f"  the others wait for {who}: {'it has' if len(late) == 1 else 'they have'} not "
                         f"issued #{seq}, which {_ranks(waiters)} wait{'s' if len(waiters) == 1 else ''} in")
    shown = [(rank, main_thread_stack(stacks.get(rank, ""), (snapshots[rank] or {}).get("main_thread")))
             for rank in sorted(snapshots)]
    if any(frames for _, frames in shown):
        lines.append("main-thread Python stacks (innermost first):")
        for rank, frames in shown:
            if not frames:
                continue
            lines.append(f"  rank {rank}:")
            lines += [f"    {f}" for f in frames[:STACK_FRAMES_SHOWN]]
            if len(frames) > STACK_FRAMES_SHOWN:
                lines.append(f"    ... {len(frames) - STACK_FRAMES_SHOWN} more")
    return "\n".join(lines)


def stuck_ranks(snapshots: Mapping[int, Mapping[str, Any] | None]) -> list[int]:
    """The ranks that hold the others up: in no collective, and not finished,
    while another rank waits in one. Under ``--elastic`` these are treated as
    lost (Note [a hung rank under --elastic] in elastic_agent.py); none when
    every rank waits (a mismatch), or none does."""
    waiting = [r for r, s in snapshots.items()
               if s is not None and any(e.get("completed_at") is None for e in s.get("entries", []))]
    if not waiting:
        return []
    return sorted(r for r, s in snapshots.items()
                  if s is not None and r not in waiting and "finished_at" not in s)


def _node(snap: Mapping[str, Any]) -> str:
    """``node 1 on host7``: where a rank of another node runs."""
    node = snap.get("node")
    return f"{'node ' + str(node) + ' ' if node is not None else 'another node '}on {snap.get('host', '?')}"


def _issued(snap: Mapping[str, Any]) -> int:
    """The last collective a rank issued (its counter, or its newest entry)."""
    if "issued" in snap:
        return int(snap["issued"])
    return max((int(e["seq"]) for e in snap.get("entries", [])), default=0)


def _entry(e: Mapping[str, Any]) -> str:
    tag = f" '{e['tag']}'" if e.get("tag") else ""
    return f"#{e['seq']} {e['op']}{tag} ({e['numel']} x {e['dtype']})"


def _where(frames: Sequence[Frame], library_paths: Sequence[str]) -> str:
    if not frames:
        return "no Python stack came back"
    inner = frames[0]
    text = f"now in Python at {inner}"
    if any(inner.file.startswith(p) for p in library_paths):
        user = next((f for f in frames if not any(f.file.startswith(p) for p in library_paths)), None)
        if user is not None:
            text += f", called from {user}"
    return text


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
