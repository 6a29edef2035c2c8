"""Entry points named on a command line: ``"package.module:function"``.

``tandem plan`` and ``tandem check`` take the user's own model, batch and data
as factories named this way, import them, and call them. Errors name the entry
point and what was wrong with it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["load_entry"]


def load_entry(spec: str, *, what: str, cwd: str | Path | None = None) -> Callable[..., Any]:
    """Import ``"module:attr"`` (``attr`` may be dotted) and return it.

    The current directory (or ``cwd``) is put first on ``sys.path``, as
    ``python -m`` does, so that a project's own modules are found.

    Raises:
        ValueError: ``spec`` is not ``module:attr``, the module cannot be
            imported, it has no such attribute, or the attribute is not callable.
    """
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"{what} {spec!r} must name a callable as 'package.module:function'")
    module_name, attr = spec.split(":")
    root = str(Path(cwd) if cwd is not None else Path.cwd())
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import {module_name!r} ({e})") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {spec!r} is a {type(obj).__name__}, not a callable")
    return obj
