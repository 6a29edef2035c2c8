"""Committed step directories: a checkpoint of several files, written by several
ranks, that is loaded only if every one of its files was written.

# Note [committed step directories]
Each save goes into a directory of its own, named after the step::

    root/
      step-00000120/            committed: COMMITTED.json lists every file
        zero-shard-0-of-2.pt
        zero-shard-1-of-2.pt
        COMMITTED.json
      step-00000130/            unfinished (the save was killed): never loaded,
        zero-shard-0-of-2.pt    and removed by the next successful save

Save (:func:`save_committed`, a collective of four small gathers):

1. step: the ranks gather their step; different steps raise on every rank
   before anything is touched.
2. prepare: rank 0 removes what an earlier, unfinished or replaced, save left in
   ``step-N`` and creates it empty, and the ranks gather whether it could. No
   rank writes before this gather, so rank 0's clean-up cannot race another
   rank's files.
3. write: every rank writes its files (fsync'ed) and reads them back for their
   size and CRC-32; the ranks gather their outcomes (the files, or the error). A
   failure anywhere raises on every rank, and no marker is written.
4. commit: rank 0 fsyncs the directory, then writes ``COMMITTED.json`` (step,
   world size, every file's size, CRC-32 and writer) atomically (Note [atomic
   save] in atomic.py): the last write of the save. The ranks gather whether it
   succeeded. Then rank 0 removes the unfinished directories and, with
   ``keep=K``, the committed ones older than the newest K (marker first, so a
   removal cut short leaves an unfinished directory, never a committed one with
   files missing).

A save killed at any point before the marker's rename leaves ``step-N`` without
a marker, so the previous committed step is still the newest one.

Load (:func:`load_committed`, a collective of one gather): each rank picks the
newest step whose marker reads back (or the step asked for) and checks the files
against it: every file present with the recorded size (every rank stats every
file), and each file's CRC-32 (file i read by rank i mod world, so a large
checkpoint is read once in all, not once per rank). The ranks gather their step
and their findings: different steps, or any missing, truncated or corrupt file,
raise the same :class:`CheckpointError` on every rank, naming the files. A
damaged checkpoint is not skipped in favour of an older one, which would
silently throw training away; the error says how to fall back.

``root`` must be on a file system that every rank sees: rank 0 commits the
files of every rank, and every rank checks all of them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tandem.checkpoint.agree import attempt, describe, gather, group_comm, raise_failures
from tandem.checkpoint.atomic import atomic_write_bytes, file_crc32, fsync_directory
# tandem/zero/optimizer.py imports CheckpointError and committed_steps from here.
from tandem.checkpoint.steps import MARKER, MARKER_FORMAT, CheckpointError, CommittedCheckpoint, FileRecord, \
    committed_steps, describe_root, read_marker, remove_step_directory, step_directories, step_directory

__all__ = ["Writer", "load_committed", "save_committed"]

logger = logging.getLogger(__name__)

Writer = Callable[[Path], Iterable[str]]
"""Writes this rank's files into the step directory it is given and returns their
names (relative to it). Each file must be named by exactly one rank."""



def save_committed(root: str | os.PathLike[str], step: int, write: Writer, *, kind: str,
                   keep: int | None = None, group: dist.ProcessGroup | None = None) -> Path:
    """Save a checkpoint of several files into ``root/step-{step:08d}/`` and commit
    it: a marker listing every file is written last, so a save killed midway
    leaves a directory that is never loaded, and the previous committed step
    stays the newest. ``root`` must be on a file system every rank sees. A
    collective: call it on every rank.

    Args:
        root: the directory that holds the step directories (created if missing).
        step: the training step saved; the newest committed step is the one loaded.
        write: ``write(directory)`` writes this rank's files there and returns
            their names. It must not issue collectives that another rank might
            skip (torch.distributed.checkpoint's save is fine: it reports a
            failure on any rank to every rank; a rank that dies in it is seen
            by the others when it is watched, as tandem's DCP writer does).
        kind: a name for what wrote the files, checked by :func:`load_committed`.
        keep: keep the newest ``keep`` committed steps, removing older ones
            (None: keep all).
        group: the process group (default: the default group; none needed in a
            process without torch.distributed).

    Returns:
        The committed step directory.

    Raises:
        ValueError: ``step`` or ``keep`` is out of range (on every rank).
        CheckpointError: on every rank, when the ranks passed different steps or
            another rank failed; a rank that failed raises its own exception.

    Warning:
        Saving a step that is already committed replaces it: until the
        new save commits, that step is absent and a load picks the one before.
    """
    # Note [committed step directories]: the four gathers of a save.
    root = Path(root)
    comm = group_comm(group)
    rank = comm.rank if comm else 0
    world = comm.size if comm else 1
    # Agree first: a bad value on one rank must not leave the others in the gather.
    steps = [o["step"] for o in gather(comm, {"step": step}, "checkpoint step")]
    if len(set(map(repr, steps))) > 1:
        raise CheckpointError(f"rank {rank}: the ranks save different steps into {root} "
                              f"({_per_rank(steps)}); every rank must pass the same step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"rank {rank}: step must be an int >= 0, got {step!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"rank {rank}: keep must be None or an int >= 1, got {keep!r}")
    directory = step_directory(root, step)

    error = attempt(lambda: _prepare(directory)) if rank == 0 else None
    outcomes = gather(comm, {"error": describe(error)}, "checkpoint prepare")
    raise_failures(rank, outcomes, error, f"could not create {directory}", CheckpointError)

    files: dict[str, dict[str, int]] = {}
    error = attempt(lambda: files.update(_write_and_measure(write, directory, rank)))
    outcomes = gather(comm, {"files": files, "error": describe(error)}, "checkpoint write")
    raise_failures(rank, outcomes, error, f"could not write its files of {directory}", CheckpointError)
    records = _merge_files(rank, directory, [o["files"] for o in outcomes])

    manifest = {"format": MARKER_FORMAT, "step": step, "world_size": world, "kind": kind,
                "files": {name: asdict(r) for name, r in sorted(records.items())}}
    error = attempt(lambda: _write_marker(directory, manifest)) if rank == 0 else None
    outcomes = gather(comm, {"error": describe(error)}, "checkpoint commit")
    raise_failures(rank, outcomes, error, f"could not write {directory / MARKER}", CheckpointError)
    logger.info("checkpoint committed: %s (%d files from %d ranks)", directory, len(records), world)
    if rank == 0:
        _clean_up(root, step, keep)
    return directory


def load_committed(root: str | os.PathLike[str], *, step: int | None = None, kind: str | None = None,
                   group: dist.ProcessGroup | None = None) -> CommittedCheckpoint:
    """Find the newest committed checkpoint under ``root`` (or ``step``'s) and check
    its files against the marker on every rank: each file present, with the
    size and CRC-32 recorded when it was saved. A damaged checkpoint raises
    rather than being skipped for an older one. A collective: call it on every
    rank. Reads nothing but the marker and the checksums; the caller loads the
    files.

    Args:
        root: the directory :func:`save_committed` wrote into.
        step: load this step rather than the newest.
        kind: the ``kind`` it must have been saved with (None: any).
        group: the process group (as for :func:`save_committed`).

    Returns:
        The checkpoint, checked.

    Raises:
        FileNotFoundError: on every rank, when ``root`` holds no committed step
            (or not ``step``); the message lists what it does hold.
        CheckpointError: on every rank, naming the files, when a file is missing,
            truncated or corrupt; when the ranks found different steps; when the
            checkpoint is of another ``kind``.
    """
    # Note [committed step directories]: the load's one gather.
    root = Path(root)
    comm = group_comm(group)
    rank = comm.rank if comm else 0
    world = comm.size if comm else 1
    found: CommittedCheckpoint | None = None
    problems: list[str] = []

    def check() -> None:
        nonlocal found, problems
        found = _choose(root, step)
        if found is None:
            return
        if kind is not None and found.kind != kind:
            raise CheckpointError(f"{found.directory} holds a '{found.kind}' checkpoint, "
                                  f"expected '{kind}'")
        problems = _check_files(found, rank, world)

    error = attempt(check)
    outcomes = gather(comm, {"step": None if found is None else found.step, "problems": problems,
                              "error": describe(error)}, "checkpoint load")
    raise_failures(rank, outcomes, None, f"cannot load a checkpoint from {root}", CheckpointError)
    steps = [o["step"] for o in outcomes]
    if len(set(steps)) > 1:
        raise CheckpointError(
            f"rank {rank}: the ranks would load different steps from {root} "
            f"({_per_rank(steps, none='none committed')}); pass the same step= on every rank, "
            "and make sure every rank sees the same file system")
    if found is None:
        asked = "" if step is None else f" for step {step}"
        raise FileNotFoundError(f"rank {rank}: no committed checkpoint{asked} in {root} "
                                f"({describe_root(root)})")
    seen_by: dict[str, list[int]] = {}
    for r, o in enumerate(outcomes):
        for p in o["problems"]:
            seen_by.setdefault(p, []).append(r)
    if seen_by:
        older = [s for s in committed_steps(root) if s < found.step]
        fallback = (f"move {found.directory} away to load step {older[-1]}, the previous committed one"
                    if older else "there is no older committed step to fall back to")
        lines = "\n".join(f"  {p} (seen by rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                          for p, rs in sorted(seen_by.items()))
        raise CheckpointError(f"rank {rank}: the checkpoint {found.directory} (step {found.step}) is "
                              f"damaged and was not loaded:\n{lines}\nRestore those files, or {fallback}")
    return found


# ---------------------------------------------------------------- saving
def _prepare(directory: Path) -> None:
    if directory.exists():
        if (directory / MARKER).exists():
            logger.warning("replacing the committed checkpoint %s", directory)
        remove_step_directory(directory)
    directory.mkdir(parents=True)
    fsync_directory(directory.parent)


def _write_and_measure(write: Writer, directory: Path, rank: int) -> dict[str, dict[str, int]]:
    files = {}
    for name in write(directory):
        if not isinstance(name, str) or Path(name).name != name or name in (MARKER, "", ".", ".."):
            raise ValueError(f"rank {rank}: the writer returned {name!r}; it must return the plain "
                             f"names of the files it wrote in {directory} (not {MARKER})")
        size, crc = file_crc32(directory / name)
        files[name] = {"size": size, "crc32": crc, "rank": rank}
    return files


def _merge_files(rank: int, directory: Path, per_rank: list[dict[str, dict[str, int]]]) -> dict[str, FileRecord]:
    records: dict[str, FileRecord] = {}
    for files in per_rank:
        for name, r in files.items():
            if name in records:
                raise CheckpointError(f"rank {rank}: ranks {records[name].rank} and {r['rank']} both "
                                      f"report writing {directory / name}; each file needs one writer")
            records[name] = FileRecord(**r)
    return records


def _write_marker(directory: Path, manifest: dict[str, Any]) -> None:
    fsync_directory(directory)  # every rank's files are in the directory before the marker is
    atomic_write_bytes(json.dumps(manifest, indent=1).encode(), directory / MARKER)


def _clean_up(root: Path, step: int, keep: int | None) -> None:
    """Best effort: a failure here is logged, the save has committed."""
    try:
        for s, directory in step_directories(root):
            if s != step and not (directory / MARKER).exists():
                logger.info("removing the unfinished checkpoint %s", directory)
                shutil.rmtree(directory)
        if keep is not None:
            for s in committed_steps(root)[:-keep]:
                if s != step:  # the step just saved stays, even below newer ones
                    remove_step_directory(step_directory(root, s))
        newer = [s for s in committed_steps(root) if s > step]
        if newer:
            logger.warning("committed step %d under %s, but steps %s are newer and load first",
                           step, root, newer)
    except OSError as e:
        logger.warning("could not clean up old checkpoints in %s: %s", root, e)


def _choose(root: Path, step: int | None) -> CommittedCheckpoint | None:
    if step is not None:
        return read_marker(step_directory(root, step), step)
    for s, directory in reversed(step_directories(root)):
        try:
            found = read_marker(directory, s)
        except CheckpointError as e:
            logger.warning("skipping %s: %s", directory, e)
            continue
        if found is not None:
            return found
    return None


def _check_files(ckpt: CommittedCheckpoint, rank: int, world: int) -> list[str]:
    problems = []
    for i, (name, record) in enumerate(sorted(ckpt.files.items())):
        path = ckpt.path(name)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            continue
        if size < record.size:
            problems.append(f"{path}: truncated: {size} of {record.size} bytes")
        elif size > record.size:
            problems.append(f"{path}: {size} bytes, but {record.size} were written")
        elif i % world == rank:
            crc = file_crc32(path)[1]
            if crc != record.crc32:
                problems.append(f"{path}: corrupt: CRC-32 {crc:08x}, but {record.crc32:08x} was written")
    return problems


def _per_rank(values: list[Any], none: str = "none") -> str:
    return ", ".join(f"rank {r}: {none if v is None else v}" for r, v in enumerate(values))
