"""What a worker loads when it starts: each process of a job imports torch (about
1.8 s of CPU here) and then tandem; tandem's DDP, the Trainer, the elastic loop,
ZeRO and the test helpers add torch's dynamo, DTensor, FSDP2 or distributed
checkpoint (0.6 to 1.5 s each) only where a script uses them (compiles, shards,
saves a sharded checkpoint). A job's start and every elastic replacement pay
for what is imported, so a module that imports one of them at its top is a
regression this test names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint")
CODE = f"""
import sys
import tandem
from tandem.train import Trainer, TrainerConfig, prepare
from tandem.elastic import run
from tandem.zero import ZeroOptimizer
from tandem.checkpoint import load_committed
import tandem.testing, tandem.data, tandem.examples.digits
tandem.DistributedDataParallel
print(sorted(m for m in {HEAVY!r} if m in sys.modules))
"""


def test_a_worker_that_neither_compiles_nor_shards_loads_none_of_the_heavy_parts() -> None:
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
