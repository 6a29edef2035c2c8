"""What each worker runs: ``python -u script.py args``, ``python -u -m module args``,
or a program of its own (``--no-python``), as torchrun builds it.

:func:`worker_command` is pure. :func:`check_target` looks at the file system, so
that a misspelt script or module fails in the launcher with one clear line,
before any worker starts, rather than N times in the workers.
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TargetKind", "WorkerCommand", "check_target", "worker_command"]


class TargetKind(enum.Enum):
    SCRIPT = "script"   # a Python file: python -u script.py
    MODULE = "module"   # python -u -m package.module
    PROGRAM = "program"  # --no-python: any executable


@dataclass(frozen=True, kw_only=True)
class WorkerCommand:
    """The command line every worker of this node runs."""

    program: str
    """The executable: the Python interpreter, or the target itself with ``--no-python``."""
    args: tuple[str, ...]
    """Its arguments, the target's own arguments last."""
    target: str
    """The script, module or program as the user named it (for messages)."""
    kind: TargetKind
    """Which of the three forms this is."""


def worker_command(target: str, target_args: Sequence[str], *, module: bool = False,
                   no_python: bool = False, python: str) -> WorkerCommand:
    """Build the workers' command line.

    Args:
        target: the script, module (with ``module``) or program (with ``no_python``).
        target_args: the target's own arguments.
        module: run ``target`` as ``python -m target``.
        no_python: run ``target`` itself, not through Python.
        python: the interpreter (the launcher's own, or ``PYTHON_EXEC`` as torchrun).

    Raises:
        ValueError: both ``module`` and ``no_python``, or no target.
    """
    if not target:
        raise ValueError("no script given; pass the training script (or -m module) and its "
                         "arguments after the launcher's options")
    if module and no_python:
        raise ValueError("-m/--module and --no-python cannot be used together: a module is "
                         "run by Python")
    rest = tuple(str(a) for a in target_args)
    if no_python:
        return WorkerCommand(program=target, args=rest, target=target, kind=TargetKind.PROGRAM)
    # -u: unbuffered, so every line reaches the log (and the console) when printed.
    head = ("-u", "-m", target) if module else ("-u", target)
    return WorkerCommand(program=python, args=head + rest, target=target,
                         kind=TargetKind.MODULE if module else TargetKind.SCRIPT)


def check_target(command: WorkerCommand, *, cwd: str) -> None:
    """Fail early, in the launcher, if the workers could not start the target.

    Modules are looked up the way ``python -m`` in ``cwd`` would, without
    importing anything.

    Raises:
        ValueError: the script, module or program does not exist.
    """
    if command.kind is TargetKind.SCRIPT:
        path = os.path.join(cwd, command.target)
        if not os.path.isfile(path):
            raise ValueError(f"script {command.target!r} not found (looked in {cwd}); check the "
                             "path, or pass -m for a module")
    elif command.kind is TargetKind.MODULE:
        if not _module_exists(command.target, cwd):
            raise ValueError(f"module {command.target!r} not found (from {cwd} and the "
                             "interpreter's path); check the name and that its package is "
                             "installed")
    else:
        found = (shutil.which(command.target) if os.sep not in command.target
                 else command.target if os.access(os.path.join(cwd, command.target), os.X_OK)
                 else None)
        if not found:
            raise ValueError(f"program {command.target!r} not found or not executable "
                             "(--no-python runs it directly)")


def _module_exists(name: str, cwd: str) -> bool:
    # Nothing is imported: the top-level package is found as ``python -m`` in ``cwd``
    # would (cwd first, then the interpreter's finders, editable installs included),
    # its submodules by path, so no package __init__ runs in the launcher.
    top, *rest = name.split(".")
    if not top or not all(rest):
        return False
    spec = importlib.machinery.PathFinder.find_spec(top, [cwd])
    if spec is None:
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            return False
    for part in rest:
        search = spec.submodule_search_locations if spec is not None else None
        if search is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(part, list(search))
    return spec is not None
