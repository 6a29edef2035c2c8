"""Step directories on disk (Note [committed step directories] in commit.py):
where each step's checkpoint goes, the commit marker and what it records
(:class:`CommittedCheckpoint`, :class:`FileRecord`), which steps are committed,
and removing one. Reads and removes files; no communication."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tandem.checkpoint.atomic import fsync_directory, remove_quietly

__all__ = ["LOOP_FILE", "MARKER", "MARKER_FORMAT", "CheckpointError", "CommittedCheckpoint", "FileRecord",
           "committed_steps", "describe_root", "read_marker", "remove_step_directory", "step_directories",
           "step_directory", "step_of"]

logger = logging.getLogger(__name__)

MARKER = "COMMITTED.json"
"""The commit marker's file name, inside each committed step directory."""

MARKER_FORMAT = "tandem.checkpoint/1"
"""The marker's ``format``: a marker of another format is not read."""
LOOP_FILE = "trainer.pt"
"""The file of a Trainer's loop state (rank 0 writes it) in its step directories, sharded or per rank."""
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked: a failed write on some
    rank, ranks at different steps, missing, truncated or corrupt files. Raised
    on every rank with the same explanation."""


@dataclass(frozen=True)
class FileRecord:
    """One file of a committed checkpoint, as its writer measured it."""

    size: int
    """Bytes."""
    crc32: int
    """CRC-32 of the contents."""
    rank: int
    """The rank that wrote it."""


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A committed step directory, as its marker describes it."""

    directory: Path
    """The step directory."""
    step: int
    """The step it was saved at."""
    world_size: int
    """How many ranks saved it."""
    kind: str
    """What wrote it ("zero-shards", "dcp", or a caller's own name)."""
    files: Mapping[str, FileRecord]
    """Every file of the checkpoint, by name within ``directory``."""

    def path(self, name: str) -> Path:
        """The path of one of its files."""
        return self.directory / name


def step_of(directory: Path) -> int:
    """The step a step directory (``step-00000120``) holds.

    Raises:
        ValueError: ``directory`` is not named as a step directory.
    """
    try:
        return int(directory.name.removeprefix("step-"))
    except ValueError:
        raise ValueError(f"{directory} is not a step directory (step-NNNNNNNN)") from None


def step_directory(root: str | os.PathLike[str], step: int) -> Path:
    """Where the checkpoint of ``step`` goes under ``root``."""
    return Path(root) / f"step-{step:08d}"


def committed_steps(root: str | os.PathLike[str]) -> list[int]:
    """The steps under ``root`` with a readable commit marker, oldest first
    (unfinished saves are not listed). Reads only markers: no communication."""
    found = []
    for step, directory in step_directories(Path(root)):
        try:
            if read_marker(directory, step) is not None:
                found.append(step)
        except CheckpointError as e:
            logger.warning("skipping %s: %s", directory, e)
    return found

def remove_step_directory(directory: Path) -> None:
    """Remove a step directory, committed or not. Uncommit first, so that a removal
    cut short never leaves a committed checkpoint with files missing."""
    marker = directory / MARKER
    if marker.exists():
        remove_quietly(marker)
        fsync_directory(directory)
    shutil.rmtree(directory)


# ---------------------------------------------------------------- loading
def step_directories(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def read_marker(directory: Path, step: int) -> CommittedCheckpoint | None:
    """None when there is no marker (an unfinished save)."""
    path = directory / MARKER
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        m = json.loads(text)
        if m.get("format") != MARKER_FORMAT:
            raise ValueError(f"format {m.get('format')!r}, expected {MARKER_FORMAT!r}")
        if m["step"] != step:
            raise ValueError(f"it records step {m['step']}")
        files = {name: FileRecord(**r) for name, r in m["files"].items()}
        return CommittedCheckpoint(directory, int(m["step"]), int(m["world_size"]), str(m["kind"]), files)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"the commit marker {path} is unreadable ({e})") from e


def describe_root(root: Path) -> str:
    if not root.is_dir():
        return "the directory does not exist"
    entries = []
    for _step, directory in step_directories(root):
        entries.append(directory.name + ("" if (directory / MARKER).exists()
                                         else f" (no {MARKER}: an unfinished save)"))
    return f"it holds: {', '.join(entries)}" if entries else "it holds no step-N directories"
