"""The short soak (Note [soak] in tandem/testing/soak.py): ``tandem run
--elastic`` on 4 workers loses one at each point where a death could go wrong
(rank 0 in its forward, a rank in backward while the reductions run, one inside
a checkpoint save, one in the world's rebuild, a replacement as it is admitted,
a replacement after its optimizer step), replacements grow the world back each
time, and the job still ends with the parameters of one process that trained
the committed global batches (float64, to 1e-9), every sample once per epoch,
its last checkpoint loadable, and no process left. DDP covers every point;
ZeRO-2 and fully_shard the ones where their state differs (a reduction, a save,
a rebuild)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.testing.soak import SoakPlan, run_soak

POINTS = {
    "ddp": [{"member": "0", "phase": "forward", "step": 10},
            {"member": "1", "phase": "backward", "step": 30},
            {"member": "j1", "phase": "join", "step": 0},
            {"member": "2", "phase": "save", "step": 50},
            {"member": "3", "phase": "regroup", "step": 60},
            {"member": "j2", "phase": "step", "step": 0}],
    "zero2": [{"member": "1", "phase": "backward", "step": 10},
              {"member": "0", "phase": "save", "step": 25},
              {"member": "2", "phase": "regroup", "step": 30}],
    "fsdp": [{"member": "2", "phase": "backward", "step": 10},
             {"member": "0", "phase": "save", "step": 25},
             {"member": "1", "phase": "regroup", "step": 30}],
}


@pytest.mark.parametrize("strategy", sorted(POINTS))
def test_a_short_soak_loses_nothing_and_counts_nothing_twice(tmp_path: Path, strategy: str) -> None:
    result = run_soak(SoakPlan(directory=tmp_path, strategy=strategy, kills=POINTS[strategy], timeout_s=240))
    assert result.problems == [], (result.problems, result.output[-4000:])
    lost = [c for c in result.changes if c["lost_ranks"]]
    assert len(lost) >= len(POINTS[strategy]) - 1, result.changes  # the admitted-then-killed j1 may go unseen
    assert result.steps > 0 and result.attempted >= result.steps
