"""A soak: an elastic job that loses a worker every few seconds, and the checks
that nothing was lost or counted twice (:func:`run_soak`).

# Note [soak]
``tandem run --elastic`` starts :mod:`tandem.testing.soak_job` on ``workers``
processes with a replacement for every failure. Failures come two ways: every
``every_s`` seconds (uniform in [0.5, 1.5] x ``every_s``) this process SIGKILLs
one of the launcher's live workers at random, rank 0 and replacements included,
wherever it is (forward, a reduction, the optimizer, a save, a regroup, a join);
and ``kills`` makes chosen members kill themselves at chosen points (the
job's docstring), so that a short run covers each point for sure.

What is measured, from the job's events (its docstring):

- step efficiency: steps committed / steps attempted (committed, plus the
  attempts the world changes dropped);
- training efficiency: time in committed steps / wall time of the training.
  A committed step's time runs from the previous commit when no world change
  came between them (so data loading and saves count as training), else from
  its own first forward; the rest of the wall time, from the first forward to
  the last commit, was lost to failures;
- sample efficiency: samples in committed steps / the samples the full world
  would have trained in the same wall time at its undisturbed pace: a step at
  world 3 of 4 trains 3/4 of a full step's samples, which time alone does not
  count. The undisturbed pace is the median, over windows of
  ``PACE_WINDOW_S``, of the mean time between commits at full size in each,
  of the windows with no kill and no world change in them or
  ``DISTURBED_AFTER_S`` before (a second before 2026-12-01: the next spare's
  import, since then a second after the change, slowed the steps by a fifth
  for about 4 s, and in the pace flattered the sample efficiency):
  a window's mean holds the job's saves and jitter (its pace, not a failure's
  cost), and the median leaves out both the windows a failure's wake slowed
  (counted as slower steps) and a run's odd start. (The median of single
  steps, used before 2026-11-29, left out the saves and so counted them as
  lost; the mean before the first failure, tried the same day, rested on a
  few seconds and moved the result by up to 20 points between runs);
- how long after a kill the members saw it (the world change's ``seen_at``):
  the first member, and every survivor (the last one's, from the records of
  the change that first saw it: the others wait for it in their regroup;
  quoted since 2026-12-01), and how long admitting a replacement stopped them: the time from the old
  world's last commit to the new world's first, less the undisturbed pace
  (the first step waits for the replacement, ready last; a member's own
  ``regroup_s``, quoted before 2026-12-01, left that wait out, and was
  whichever member's record came first);
- where the samples not trained went (:attr:`SoakResult.lost_s`), as the
  time the full world would have needed to train them, split so that the
  parts add up to what the sample efficiency misses: time with no step under
  way (a loss: seeing it and the step in flight, building the new group, the
  state rebuilt for the new world: shards recovered from buddy copies, laid
  out again, copies refreshed; an admission),
  steps at a smaller world (a step of 3 of 4 ranks misses a quarter of a full
  step's samples), and steps slower than the undisturbed one (a replacement
  starting beside the workers takes their cores);
- a replacement's start: from the kill it replaces to its Trainer built,
  ready to ask to join (a new process's imports, or a spare taken; the model),
  and from then to its first batch (waiting for the members' next step
  boundary, and the admission).

What is checked, each a line in :attr:`SoakResult.problems` when it fails:
the job exits 0; every worker that died was SIGKILLed (none crashed); every
step's committed attempt has a batch from every rank of its world; every
sample of an epoch is trained once (an epoch the job finished); the final
parameters equal one process that trains the committed global batches in order
(plain torch, nothing of tandem); no process of the job is left; the last
checkpoint loads and is of the last step.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.testing.soak_job import Indexed, loss_of, make_model, make_optimizer

__all__ = ["SoakPlan", "SoakResult", "run_soak"]


@dataclass(frozen=True, kw_only=True)
class SoakPlan:
    """One soak run."""

    directory: Path
    """Where the job writes its events, checkpoints and logs (made if missing)."""
    strategy: str = "ddp"
    """``ddp``, ``zero2`` or ``fsdp``."""
    workers: int = 4
    """Processes of the job's first world."""
    steps: int = 1_000_000
    """Optimizer steps the job trains at most: with failures, it stops instead
    soon after the last one (after ``every_s`` more, or a second)."""
    every_s: float | None = None
    """Kill a random worker about this often (None: only ``kills``)."""
    failures: int = 0
    """How many random kills, at most (they stop with the training)."""
    kills: list[dict[str, Any]] = field(default_factory=list)
    """Kills on purpose: the job's ``SOAK_KILLS``."""
    samples: int = 1536
    """Dataset size."""
    batch: int = 16
    """Samples per rank per step."""
    checkpoint_every: int = 25
    """Steps between checkpoints (saves are a point to be killed at, too)."""
    seed: int = 0
    """Of the random kills."""
    timeout_s: float = 600.0
    """The job is killed, and the soak fails, after this long."""
    replacements: int | None = None
    """Replacements the launcher may start (default: one per failure, and two spare)."""
    hidden: int = 256
    """The width of the job's MLP: what a step costs."""
    spare: bool = True
    """A spare worker becomes each replacement (Note [spare workers] in
    tandem/launch/spare.py); False: ``--no-spare``."""


@dataclass
class SoakResult:
    wall_s: float = 0.0
    """The training's wall time: first forward to last commit."""
    steps: int = 0
    attempted: int = 0
    committed_s: float = 0.0
    kills: list[tuple[float, int]] = field(default_factory=list)
    """(time, pid) of each random kill."""
    changes: list[dict[str, Any]] = field(default_factory=list)
    """The world changes, by generation, as their members recorded them."""
    detect_s: list[float] = field(default_factory=list)
    """From each random kill to the first member seeing a loss."""
    detect_all_s: list[float] = field(default_factory=list)
    """From each random kill to every survivor seeing it (the last of them)."""
    admit_s: list[float] = field(default_factory=list)
    """How long each replacement's admission stopped the members."""
    admit_connect_s: list[float] = field(default_factory=list)
    """The part of each admission spent agreeing on the generation and building its group."""
    step_s: float = 0.0
    """The median time between commits in the same world."""
    full_step_s: float = 0.0
    """The median time between commits in the same world at its full size (``workers``)."""
    pace_s: float = 0.0
    """The undisturbed step (Note [soak]): the median over quiet windows of the
    mean time between commits at full size; the job's saves and jitter count."""
    samples: int = 0
    """Samples in the committed steps."""
    full_batch: int = 0
    """Samples a step of the full world trains (``workers`` x ``batch``)."""
    lost_s: dict[str, float] = field(default_factory=dict)
    """The samples not trained, as the time the full world would have needed
    for them, by cause (Note [soak]); they add up to ``wall_s`` x (1 - sample
    efficiency)."""
    start_s: list[float] = field(default_factory=list)
    """Each replacement's start: from the kill it replaces to its Trainer built."""
    join_s: list[float] = field(default_factory=list)
    """Each admitted replacement's wait: its Trainer built to its first batch."""
    problems: list[str] = field(default_factory=list)
    output: str = ""

    @property
    def step_efficiency(self) -> float:
        return self.steps / max(self.attempted, 1)

    @property
    def training_efficiency(self) -> float:
        return self.committed_s / max(self.wall_s, 1e-9)

    @property
    def sample_efficiency(self) -> float:
        """Samples trained / what the full world trains in the wall time undisturbed (Note [soak])."""
        return self.samples * self.pace_s / max(self.wall_s * self.full_batch, 1e-9)


def run_soak(plan: SoakPlan) -> SoakResult:
    """Run ``plan``'s job with its failures, then measure and check it (Note [soak])."""
    out = plan.directory
    out.mkdir(parents=True, exist_ok=True)
    failures = plan.failures + len(plan.kills)
    replacements = plan.replacements if plan.replacements is not None else failures + 2
    env = {**os.environ, "SOAK_DIR": str(out), "SOAK_STRATEGY": plan.strategy, "SOAK_STEPS": str(plan.steps),
           "SOAK_KILLS": json.dumps(plan.kills), "SOAK_SAMPLES": str(plan.samples), "SOAK_BATCH": str(plan.batch),
           "SOAK_CHECKPOINT_EVERY": str(plan.checkpoint_every), "SOAK_WORKERS": str(plan.workers),
           "SOAK_HIDDEN": str(plan.hidden)}
    command = [sys.executable, "-m", "tandem", "run", "--nproc-per-node", str(plan.workers), "--elastic",
               "--max-restarts", str(replacements), "--log-dir", str(out / "logs"),
               *([] if plan.spare else ["--no-spare"]), "-m", "tandem.testing.soak_job"]
    result = SoakResult()
    with (out / "launcher.log").open("w") as log:
        launcher = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        deadline = time.monotonic() + plan.timeout_s
        try:
            result.kills = _kill_now_and_then(launcher, plan, out, deadline)
            launcher.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            result.problems.append(f"the job ran past {plan.timeout_s:.0f} s and was killed")
            result.problems.extend(_where_they_wait(out))
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
    result.output = (out / "launcher.log").read_text(errors="replace")
    if launcher.returncode != 0:
        result.problems.append(f"the launcher exited with {launcher.returncode}")
    for line in result.output.splitlines():
        # Every death is a SIGKILL, on purpose or at random: any other exit is a crash.
        if "the others go on" in line and "exited with -9;" not in line:
            result.problems.append(f"a worker crashed: {line.strip()}")
    if _killed_on_purpose(out) != len(plan.kills):
        result.problems.append(f"{_killed_on_purpose(out)} of the {len(plan.kills)} kills on purpose happened")
    _measure_and_check(result, plan, _read_events(out))
    left = _processes_with(f"SOAK_DIR={out}")
    if left:
        result.problems.append(f"processes of the job left running: {left}")
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    return result


def _kill_now_and_then(launcher: subprocess.Popen, plan: SoakPlan, out: Path,
                       deadline: float) -> list[tuple[float, int]]:
    """SIGKILL a random live worker about every ``every_s`` (Note [soak]) until
    ``failures``, the job's end or ``deadline`` (monotonic); returns when and whom."""
    kills: list[tuple[float, int]] = []
    rng = random.Random(plan.seed)

    def going() -> bool:
        return launcher.poll() is None and time.monotonic() < deadline

    while not any(out.glob("events-*.jsonl")) and going():
        time.sleep(0.1)  # the workers have started training
    while plan.every_s is not None and len(kills) < plan.failures and going():
        until = min(deadline, time.monotonic() + plan.every_s * rng.uniform(0.5, 1.5))
        while time.monotonic() < until and launcher.poll() is None:
            time.sleep(0.05)
        if _trained_all(out):
            break
        workers = _workers(launcher.pid, out)
        if not workers:
            continue
        pid = rng.choice(workers)
        try:
            os.kill(pid, signal.SIGKILL)
            kills.append((time.time(), pid))
        except ProcessLookupError:
            pass
    while plan.kills and going() and _killed_on_purpose(out) < len(plan.kills):
        time.sleep(0.1)
    if (kills or plan.kills) and going():
        _stop_soon(out, plan.every_s or 1.0)
    return kills


def _where_they_wait(out: Path) -> list[str]:
    """Each live worker's main thread, innermost frame first, from the
    ``faulthandler`` dump SIGUSR1 asks of it (``TANDEM_STACKS_FILE``): where a
    soak that ran past its time was waiting, for the test's message."""
    from tandem.launch.hang import main_thread_stack
    workers = {pid: Path(environ[b"TANDEM_STACKS_FILE"].decode()) for pid in _processes_with(f"SOAK_DIR={out}")
               if b"TANDEM_STACKS_FILE" in (environ := _environ(pid))}
    for pid in workers:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(2.0)
    found = []
    for pid, path in sorted(workers.items()):
        try:
            dump = path.read_text(errors="replace")
        except OSError:
            dump = ""
        frames = main_thread_stack(dump, None)[:12]  # the thread the signal interrupted: the main one
        found.append(f"pid {pid} ({path.parent.name}): " + (" <- ".join(map(str, frames)) or "no stack dump"))
    return found


def _killed_on_purpose(out: Path) -> int:
    return sum(p.read_text().count('"e": "killed"') for p in out.glob("events-*.jsonl"))


def _stop_soon(out: Path, every_s: float) -> None:
    """Tell the job to stop a little after now: at the step its commits reach in
    about ``every_s`` more seconds of training (Note [soak])."""
    commits = [e for e in _read_events(out) if e["e"] == "commit"]
    recent = [e for e in commits if e["t"] > time.time() - 5.0]
    rate = len({e["step"] for e in recent}) / 5.0
    last = max((e["step"] for e in commits), default=0)  # the failures may all come before a commit
    tmp = out / "stop.tmp"
    tmp.write_text(str(last + max(20, int(rate * every_s))))
    tmp.rename(out / "stop")


def _trained_all(out: Path) -> bool:
    return any('"e": "done"' in p.read_text() for p in out.glob("events-*.jsonl"))


def _workers(launcher: int, out: Path) -> list[int]:
    """The launcher's live workers: its children but a spare still waiting (Note
    [spare workers] in tandem/launch/spare.py: one that became a worker has
    written its events), which is not yet part of the job."""
    found = []
    for pid in _children(launcher):
        try:
            spare = b"tandem/launch/spare.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if not spare or (out / f"events-{pid}.jsonl").exists():
            found.append(pid)
    return found


def _children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (the launcher's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def _processes_with(marker: str) -> list[int]:
    """The processes (not this one) whose environment holds ``marker`` (``KEY=value``)."""
    key, _, value = marker.encode().partition(b"=")
    return [int(e.name) for e in Path("/proc").iterdir()
            if e.name.isdigit() and int(e.name) != os.getpid() and _environ(int(e.name)).get(key) == value]


def _environ(pid: int) -> dict[bytes, bytes]:
    """Process ``pid``'s environment (empty when it is gone or not readable)."""
    try:
        items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(item.split(b"=", 1) for item in items if b"=" in item)


def _read_events(out: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted(out.glob("events-*.jsonl")):
        pid = int(path.stem.split("-")[1])
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # the last line of a killed process
            event["pid"] = pid
            events.append(event)
    return sorted(events, key=lambda e: e["t"])


def _measure_and_check(result: SoakResult, plan: SoakPlan, events: list[dict[str, Any]]) -> None:
    problems = result.problems
    done = [e for e in events if e["e"] == "done"]
    if not done:
        problems.append("no process finished the job")
        return
    last = max(done, key=lambda e: (e["world"], -e["rank"]))
    result.steps = last["step"]
    by_generation: dict[int, dict[str, Any]] = {}
    seen_by: dict[int, list[float]] = collections.defaultdict(list)  # each member's seen_at, by generation
    for e in events:  # every member writes the changes it saw: one each, by generation
        if e["e"] == "change":
            by_generation.setdefault(e["generation"], {k: v for k, v in e.items() if k not in ("e", "t", "pid")})
            seen_by[e["generation"]].append(e["seen_at"])
    for e in done:
        for change in e["changes"]:
            by_generation.setdefault(change["generation"], change)
    result.changes = [by_generation[g] for g in sorted(by_generation)]
    result.attempted = result.steps + sum(c["steps_lost"] for c in result.changes)
    commits: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["e"] == "commit" and (e["step"] not in commits or commits[e["step"]]["gen"] != e["gen"]):
            # The first process to commit it in the last generation that did: a state read
            # back from a checkpoint redoes the steps after it, and those redos count.
            commits[e["step"]] = e
    starts = {(e["gen"], e["step"]): e["t"] for e in reversed(events) if e["e"] == "forward"}
    if sorted(commits) != list(range(result.steps)):
        problems.append(f"steps committed: {len(commits)}, not 0..{result.steps - 1}")
        return
    worlds = {(e["gen"], e["step"]): e["world"] for e in events if e["e"] == "batch"}
    intervals, full_intervals, spans = [], [], []
    for step in range(result.steps):
        c = commits[step]
        previous = commits.get(step - 1)
        world = worlds.get((c["gen"], step), plan.workers)
        if previous is not None and previous["gen"] == c["gen"]:
            span = c["t"] - previous["t"]
            intervals.append(span)
            if world == plan.workers:
                full_intervals.append(span)
        else:
            span = c["t"] - starts.get((c["gen"], step), c["t"])
        spans.append((span, world))
    first = starts.get((commits[0]["gen"], 0), commits[0]["t"])
    result.wall_s = commits[result.steps - 1]["t"] - first
    result.committed_s = sum(span for span, _ in spans)
    result.step_s = statistics.median(intervals) if intervals else 0.0
    result.full_step_s = statistics.median(full_intervals) if full_intervals else result.step_s
    result.pace_s = _undisturbed_step(commits, worlds, plan.workers, result.kills, result.changes) or \
        result.full_step_s
    result.full_batch = plan.workers * plan.batch
    trained = {e["pid"]: e["t"] for e in reversed(events) if e["e"] == "batch"}  # a pid's first batch
    for at, pid in result.kills:
        if trained.get(pid, at) >= at:
            continue  # a replacement killed before it trained: no member was lost
        seen = [c for c in result.changes if c["lost_ranks"] and c["seen_at"] >= at]
        if seen:
            earliest = min(seen, key=lambda c: c["seen_at"])
            result.detect_s.append(earliest["seen_at"] - at)
            result.detect_all_s.append(max(seen_by[earliest["generation"]] or [earliest["seen_at"]]) - at)
    admissions = [c for c in result.changes if c["joined"] and not c["lost_ranks"]]
    result.admit_s = _admission_stops(commits, admissions, result.pace_s)
    result.admit_connect_s = [c.get("connect_s", 0.0) for c in admissions]
    result.lost_s = _lost(result, spans, plan.workers)
    _replacements_start(result, events, first)
    batches = _committed_batches(events, commits, problems)
    if batches is None:
        return
    result.samples = sum(len(idx) for _, idx in batches)
    _check_each_sample_once(batches, plan, problems)
    _check_parameters(batches, plan, problems, commits)
    _check_checkpoint(plan, result.steps, problems)


def _admission_stops(commits: dict[int, dict[str, Any]], admissions: list[dict[str, Any]],
                     pace_s: float) -> list[float]:
    """How long each admission stopped the members (Note [soak]): from the old
    world's last commit to the new world's first, less the undisturbed step.
    The new world's first step waits for the replacement, which is ready last
    (it receives the state after the members have rebuilt), so no member's own
    rebuild time (``regroup_s``) tells this. An admission another change
    followed before its first step is left out."""
    stops = []
    for change in admissions:
        before, after = commits.get(change["step"] - 1), commits.get(change["step"])
        if before is not None and after is not None and after["gen"] == change["generation"]:
            stops.append(after["t"] - before["t"] - pace_s)
    return stops


PACE_WINDOW_S = 2.0
"""The windows the undisturbed pace is the median over (Note [soak])."""
DISTURBED_AFTER_S = 5.0
"""How long after a kill or a world change the steps are not undisturbed: the
replacement's imports, or the next spare's (Note [spare workers] in
tandem/launch/spare.py), take the workers' cores (DDP steps 29 ms before and
35 ms from 1 to 5 s after a change, 2 cores; Note [soak])."""


def _undisturbed_step(commits: dict[int, dict[str, Any]], worlds: dict[tuple[int, int], int], full: int,
                      kills: list[tuple[float, int]], changes: list[dict[str, Any]]) -> float | None:
    """The median over ``PACE_WINDOW_S`` windows of the mean time between commits
    at full size, of the windows with no kill and no world change (Note [soak])."""
    start = commits[0]["t"]
    marks = [at for at, _ in kills] + [c["seen_at"] for c in changes]
    spans: dict[int, list[float]] = {}
    for s in sorted(commits):
        previous, c = commits.get(s - 1), commits[s]
        if previous is None or previous["gen"] != c["gen"] or worlds.get((c["gen"], s)) != full:
            continue
        spans.setdefault(int((c["t"] - start) // PACE_WINDOW_S), []).append(c["t"] - previous["t"])
    quiet = [statistics.fmean(v) for w, v in spans.items()
             if len(v) >= 2 and not any(start + w * PACE_WINDOW_S - DISTURBED_AFTER_S <= at
                                        < start + (w + 1) * PACE_WINDOW_S
                                        for at in marks)]
    return statistics.median(quiet) if quiet else None


def _lost(result: SoakResult, spans: list[tuple[float, int]], full: int) -> dict[str, float]:
    """Where the samples not trained went (Note [soak]): the time the full world
    would have needed for them, by cause. A committed step of span s at world
    w trains what the full world trains in ``pace_s * w / full``; its
    excess, ``s * (full - w) / full`` (the smaller world) plus
    ``(s - pace_s) * w / full`` (a slower step), and the wall time in no
    committed step add up to ``wall_s * (1 - sample_efficiency)``."""
    step = result.pace_s
    changes = [c for c in result.changes if c["step"] < result.steps]
    admitted = sum(c["regroup_s"] for c in changes if c["joined"] and not c["lost_ranks"])
    regroups = sum(c["regroup_s"] for c in changes if c["lost_ranks"])
    groups = sum(c.get("connect_s", 0.0) for c in changes if c["lost_ranks"])
    stopped = result.wall_s - result.committed_s
    return {"seeing a loss and the step in flight": stopped - admitted - regroups,
            "a new group after a loss": groups,
            "the state rebuilt after a loss": regroups - groups,
            "admitting a replacement": admitted,
            "a smaller world": sum(s * (full - w) / full for s, w in spans),
            "slower steps": sum((s - step) * w / full for s, w in spans)}


def _replacements_start(result: SoakResult, events: list[dict[str, Any]], first: float) -> None:
    """Each replacement's start, from the kill it replaces, and its wait to be
    admitted (Note [soak]). A kill is paired with the first replacement whose
    script started after it (a spare starts its script when it is taken)."""
    started = sorted((e["t"], e["pid"]) for e in events if e["e"] == "start" and e["t"] > first)
    ready = {e["pid"]: e["t"] for e in events if e["e"] == "ready"}
    trained = {e["pid"]: e["t"] for e in reversed(events) if e["e"] == "batch"}
    for at, _ in sorted(result.kills):
        later = [(t, pid) for t, pid in started if t > at and pid in ready]
        if not later:
            continue
        started.remove(later[0])
        pid = later[0][1]
        result.start_s.append(ready[pid] - at)
        if pid in trained:
            result.join_s.append(trained[pid] - ready[pid])


def _committed_batches(events: list[dict[str, Any]], commits: dict[int, dict[str, Any]],
                       problems: list[str]) -> list[tuple[int, list[int]]] | None:
    """Each step's (epoch, global batch in rank order), from its committed attempt."""
    by_attempt: dict[tuple[int, int], dict[int, dict[str, Any]]] = collections.defaultdict(dict)
    for e in events:
        if e["e"] == "batch":
            by_attempt[(e["gen"], e["step"])][e["rank"]] = e  # a redo in the same world: the last
    out = []
    for step in sorted(commits):
        ranks = by_attempt.get((commits[step]["gen"], step), {})
        world = next(iter(ranks.values()))["world"] if ranks else 0
        if world == 0 or sorted(ranks) != list(range(world)):
            problems.append(f"step {step}: batches of ranks {sorted(ranks)} in generation "
                            f"{commits[step]['gen']}, not of every rank of its world ({world})")
            return None
        out.append((ranks[0]["epoch"], [i for r in range(world) for i in ranks[r]["idx"]]))
    return out


def _check_each_sample_once(batches: list[tuple[int, list[int]]], plan: SoakPlan, problems: list[str]) -> None:
    epochs: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for epoch, idx in batches:
        epochs[epoch].update(idx)
    last = max(epochs)
    for epoch, counts in sorted(epochs.items()):
        twice = sorted(i for i, n in counts.items() if n > 1)
        missing = sorted(set(range(plan.samples)) - set(counts)) if epoch != last else []
        if twice or missing:
            problems.append(f"epoch {epoch}: {len(twice)} sample(s) trained more than once "
                            f"(first: {twice[:5]}), {len(missing)} never (first: {missing[:5]})")


def _check_parameters(batches: list[tuple[int, list[int]]], plan: SoakPlan, problems: list[str],
                      commits: dict[int, dict[str, Any]]) -> None:
    """One process, plain torch, the committed global batches in order; with the
    parameters' sums the job recorded, the first step where they part."""
    data = Indexed(plan.samples)
    model = make_model(plan.hidden)
    optimizer = make_optimizer(model.parameters())
    parted = None
    for step, (_, idx) in enumerate(batches):
        index = torch.tensor(idx)
        optimizer.zero_grad()
        loss_of(model(data.x[index]), data.y[index]).backward()
        optimizer.step()
        recorded = commits[step].get("sum")
        if parted is None and recorded is not None:
            expected = float(sum(p.detach().sum() for p in model.parameters()))
            if abs(recorded - expected) > 1e-9 * max(1.0, abs(expected)):
                parted = step
                problems.append(f"the parameters part from one process's at step {step} (generation "
                                f"{commits[step]['gen']}): sum {recorded!r} against {expected!r}")
    final = plan.directory / "final.pt"
    if not final.exists():
        problems.append("no final export")
        return
    saved = torch.load(final, weights_only=False)["model"]
    for name, expected in model.state_dict().items():
        got = saved[name]
        if not torch.allclose(got, expected, rtol=1e-9, atol=1e-11):
            problems.append(f"parameter {name} differs from one process on the committed batches by "
                            f"{(got - expected).abs().max().item():.3g}")


def _check_checkpoint(plan: SoakPlan, steps: int, problems: list[str]) -> None:
    from tandem.checkpoint.one_rank import latest_checkpoint
    latest = latest_checkpoint(plan.directory / "run" / "checkpoints")
    if latest is None:
        problems.append("no checkpoint")
        return
    try:
        if latest.is_dir():
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
            dcp_to_torch_save(latest, plan.directory / "checkpoint-as-one.pt")
            state = {"shards": torch.load(plan.directory / "checkpoint-as-one.pt", weights_only=False),
                     **({"trainer": torch.load(latest / "trainer.pt", weights_only=False)}
                        if (latest / "trainer.pt").exists() else {})}
        else:
            state = torch.load(latest, weights_only=False)
    except Exception as e:  # noqa: BLE001 - reported, whatever it is
        problems.append(f"the last checkpoint {latest} does not load: {type(e).__name__}: {e}")
        return
    step = _find_step(state)
    if step != steps:
        problems.append(f"the last checkpoint {latest} is of step {step}, not {steps}")


def _find_step(state: Any) -> int | None:
    if isinstance(state, dict):
        if isinstance(state.get("step"), int):
            return state["step"]
        for value in state.values():
            found = _find_step(value)
            if found is not None:
                return found
    return None
