"""What every test process shares.

# Note [one compiled-code cache per kernel family]
torch's inductor keeps the code it compiles in a cache directory keyed by the
graph, not by ``ATEN_CPU_CAPABILITY``: after a run with the native kernels
(AVX2 vectors here), a run with ``ATEN_CPU_CAPABILITY=default`` takes the
cached AVX2 code and fails to build it ("'at::vec' has not been declared").
The suite is meant to pass under each kernel family (docs/development.md), so
each family gets a cache of its own; the spawned ranks inherit it.

# Note [tandem's code compiled once]
Where the environment sets PYTHONDONTWRITEBYTECODE (this machine's does), each
new interpreter would compile tandem's sources again as it imports them: 0.1
to 0.25 s of CPU a process, and the suite starts about 200 (the launchers and
workers of ``tandem run``, the nodes' launchers, spares, scripts). So the
controller compiles them once at the start of a run; imports read the cached
code whatever the variable says (the spawned ranks fork from a server that
imported it already).
"""

from __future__ import annotations

import compileall
import getpass
import os
import tempfile
from pathlib import Path

import pytest

if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    family = os.environ.get("ATEN_CPU_CAPABILITY", "native")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{family}")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):   # a worker of pytest-xdist: its controller did it
        return
    root = Path(__file__).resolve().parents[1]
    for tree in ("tandem", "tests", "benchmarks"):   # Note [tandem's code compiled once]
        compileall.compile_dir(root / tree, quiet=1)


# Note [the quick subset]
# The test files and tests listed in tests/slow.txt (the ones that take longest on the
# 2-core machine) are marked `slow`: `pytest -m "not slow"` runs the rest, a
# contributor's quick check (docs/development.md); CI runs everything.
_SLOW = frozenset(line.strip() for line in open(os.path.join(os.path.dirname(__file__), "slow.txt"))
                  if line.strip() and not line.startswith("#"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.split("::")[0] in _SLOW or item.nodeid.split("[")[0] in _SLOW:
            item.add_marker(pytest.mark.slow)
