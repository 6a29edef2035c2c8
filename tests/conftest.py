"""What every test process shares.

# Note [one compiled-code cache per kernel family]
torch's inductor keeps the code it compiles in a cache directory keyed by the
graph, not by ``ATEN_CPU_CAPABILITY``: after a run with the native kernels
(AVX2 vectors here), a run with ``ATEN_CPU_CAPABILITY=default`` takes the
cached AVX2 code and fails to build it ("'at::vec' has not been declared").
The suite is meant to pass under each kernel family (docs/development.md), so
each family gets a cache of its own; the spawned ranks inherit it.
"""

from __future__ import annotations

import getpass
import os
import tempfile

if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    family = os.environ.get("ATEN_CPU_CAPABILITY", "native")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{family}")
