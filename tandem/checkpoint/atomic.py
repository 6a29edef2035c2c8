"""Single files that are either complete or absent: write to a temporary file,
fsync, rename, fsync the directory.

# Note [atomic save]
A file is first written in full to a temporary file in the same directory
(``.NAME.tmp-PID``), flushed and fsync'ed, then renamed over ``NAME`` with
``os.replace`` and the directory fsync'ed. A rename within one file system is
atomic: a reader sees the old file or the new one, never a mix. A save killed at
any point (SIGKILL, power loss after the fsyncs) therefore leaves the previous
file intact, at worst next to a stray temporary file, which the next save of
the same name removes.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

__all__ = ["atomic_save", "atomic_write_bytes", "file_crc32", "fsync_directory", "remove_quietly"]

_CHUNK = 1 << 22  # 4 MiB reads for checksums


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save(obj, path)`` so that a killed save never destroys the file
    that was at ``path``: the object is written in full to a temporary file in
    the same directory and then renamed over ``path``, so a reader sees the old
    file or the new one, never a mix. Creates missing directories.

    Returns:
        The path written.
    """
    return _atomic_write(Path(path), lambda f: torch.save(obj, f))  # Note [atomic save]


def atomic_write_bytes(data: bytes, path: str | os.PathLike[str]) -> Path:
    """Write ``data`` to ``path`` as :func:`atomic_save` writes: a killed write
    leaves the previous file intact."""
    return _atomic_write(Path(path), lambda f: f.write(data))  # Note [atomic save]


def file_crc32(path: str | os.PathLike[str]) -> tuple[int, int]:
    """The size in bytes and the CRC-32 of a file's contents, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make the creation, renaming or removal of the directory's entries durable
    (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_quietly(path: str | os.PathLike[str]) -> None:
    """Unlink a file that may already be gone."""
    try:
        Path(path).unlink()
    except FileNotFoundError:
        pass


def _atomic_write(path: Path, write: Callable[[IO[bytes]], Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        remove_quietly(stale)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise
    fsync_directory(path.parent)
    return path
