"""A straggler named with its phase (Note [naming a straggler] in
tandem/train/stragglers.py): the judgement on grids of made-up phases, the
confirmation over windows, and three real Trainer runs on three gloo ranks in
one spawned group: rank 2 sleeping in data loading, rank 2 sleeping in its
forward, nobody sleeping for 200 steps, and a prepared loop of the user's own
with rank 2 sleeping in data loading."""

from __future__ import annotations

import contextlib
import functools
import io
import re
import time
from typing import cast

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from tandem.testing import run_distributed
from tandem.train.stragglers import Slow, StepPhases, StragglerWatch, judge

# ---------------------------------------------------------------------- the judgement


def _about(x: float) -> float:
    """``pytest.approx(x)``, equal to the floats near ``x``, where a Slow takes a float."""
    return cast(float, pytest.approx(x))


def _found(pattern: str, text: str) -> str:
    """The first group of ``pattern``'s first match in ``text``."""
    match = re.search(pattern, text)
    assert match is not None, f"{pattern!r} not in {text[:200]!r}"
    return match[1]


def test_a_rank_slow_in_one_phase_is_named_with_that_phase() -> None:
    fast = (0.001, 0.010, 0.004, 0.002)
    assert judge([fast, (0.031, 0.010, 0.0, 0.002)]) == [Slow(1, "data", _about(31.0))]
    assert judge([fast, fast, (0.001, 0.040, 0.0, 0.002), fast]) == [Slow(2, "compute", _about(4.0))]
    assert judge([(0.001, 0.010, 0.0, 0.030), fast, fast]) == [Slow(0, "optimizer", _about(15.0))]
    assert Slow(2, "data", 3.14).describe() == "rank 2 slow: data 3.1x the median"


def test_nobody_is_named_for_noise_for_waiting_or_alone() -> None:
    fast = (0.001, 0.010, 0.004, 0.002)
    assert judge([fast, fast, fast]) == []
    assert judge([fast]) == []
    # Twice as long, but by less than the floor (a tenth of the step, at least 2 ms): noise.
    assert judge([fast, (0.002, 0.010, 0.004, 0.002)]) == []
    assert judge([(0.001, 0.100, 0.0, 0.002), (0.001, 0.100, 0.0, 0.002), (0.001, 0.109, 0.0, 0.002)]) == []
    # Waiting on the others is the symptom, never the cause.
    assert judge([fast, (0.001, 0.010, 0.300, 0.002)]) == []
    # Slower by the floor but not twice as slow.
    assert judge([fast, (0.001, 0.019, 0.004, 0.002)]) == []


def test_the_slowest_phase_of_a_rank_is_the_one_named() -> None:
    fast = (0.001, 0.010, 0.004, 0.002)
    assert judge([fast, (0.005, 0.080, 0.0, 0.002)]) == [Slow(1, "compute", _about(8.0))]


class _Gathered:
    """A gather that returns the windows it is given, one a gather started."""

    def __init__(self, windows: list[list[list[float]]]) -> None:
        self.windows = iter(windows)
        self.under_way: list[list[float]] | None = None

    def start(self, mine: list[float]) -> None:
        assert self.under_way is None, "a gather started before the one under way was finished"
        self.under_way = next(self.windows)

    def finish(self) -> list[list[float]] | None:
        done, self.under_way = self.under_way, None
        return done


def test_a_rank_is_named_after_confirm_windows_in_a_row_of_the_same_phase() -> None:
    fast, slow_data, slow_compute = [0.001, 0.01, 0.0, 0.002], [0.05, 0.01, 0.0, 0.002], [0.001, 0.06, 0.0, 0.002]
    windows = [[fast, slow_data], [fast, slow_data], [fast, slow_compute], [fast, slow_compute],
               [fast, slow_compute], [fast, slow_compute], [fast, fast]]
    watch = StragglerWatch(_Gathered(windows), every=2, confirm=3, min_window_s=0.0)  # type: ignore[arg-type]
    named: list[list[Slow] | None] = []
    for _ in range(2 * len(windows) + 1):
        named.append(watch.end_step(StepPhases(0.0, 0.0, 0.0, 0.0)))
    # Gathers start at every second step and are judged at the step after.
    assert named[0::2][0] is None and named[1::2] == [None] * len(windows)
    said = []
    for n in named[2::2]:
        assert n is not None
        said.append([s.describe() for s in n])
    assert said == [[], [], [], [], ["rank 1 slow: compute 6.0x the median"],
                    ["rank 1 slow: compute 6.0x the median"], []]


def test_a_window_of_short_steps_lasts_min_window_s() -> None:
    # Steps of 10 ms: the next window is 0.1 s, 10 steps; steps of 60 ms: ``every`` steps.
    short, long = [0.001, 0.007, 0.0, 0.002], [0.001, 0.057, 0.0, 0.002]
    watch = StragglerWatch(_Gathered([[short, short], [long, long], [short, short]]),  # type: ignore[arg-type]
                           every=4, confirm=3, min_window_s=0.1)
    judged_at = [step for step in range(1, 25) if watch.end_step(StepPhases(0.0, 0.0, 0.0, 0.0)) is not None]
    # Windows end at steps 4 (judged at 5: the next window runs to 14), 14 (judged at 15: every
    # again, to 18) and 18 (judged at 19).
    assert judged_at == [5, 15, 19] and watch.window == 10


# ---------------------------------------------------------------------- real runs

SLEEP_S = 0.03
RANKS = 3


class _Data(Dataset):
    """Samples whose loading takes SLEEP_S / 4 on rank 2 when ``slow``."""

    def __init__(self, n: int, slow: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y, self.slow = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g), slow

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.slow and torch.distributed.get_rank() == 2:
            time.sleep(SLEEP_S / 4)  # four samples a batch
        return self.x[i], self.y[i]


class _Model(nn.Module):
    def __init__(self, slow: bool) -> None:
        super().__init__()
        self.net, self.slow = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)), slow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow and torch.distributed.get_rank() == 2:
            time.sleep(SLEEP_S)
        return self.net(x)


def _fit(rank: int, where: str, steps: int, out: str) -> dict:
    import tandem

    torch.manual_seed(0)
    config = tandem.TrainerConfig(batch_size=4, epochs=1, log_every=4, progress=True, plot=False,
                                  resume=False, output_dir=out)
    model = _Model(where == "compute")
    trainer = tandem.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05),
                             _Data(steps * 4 * RANKS, where == "data"), lambda o, y: ((o - y) ** 2).mean(),
                             config=config)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = trainer.fit()
    return {"records": [r for r in result.history if r["kind"] == "train"], "printed": printed.getvalue(), "out": out}


def _own_loop(rank: int, steps: int) -> str:
    """A loop of the user's own, prepared, rank 2 sleeping in data loading; what rank 0 said on stderr."""
    import tandem

    torch.manual_seed(0)
    model = _Model(False)
    loader = torch.utils.data.DataLoader(_Data(steps * 4 * RANKS, True), batch_size=4)
    model, optimizer, loader = tandem.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05), loader)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        for x, y in loader:
            ((model(x) - y) ** 2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return said.getvalue()


def _three_runs(rank: int, world_size: int, tmp: str) -> dict:
    runs: dict = {where: _fit(rank, where, steps, f"{tmp}/{where}")
                  for where, steps in (("data", 20), ("compute", 20), ("none", 200))}
    runs["own loop"] = _own_loop(rank, 20)
    return runs


@functools.cache
def _runs(tmp: str) -> list[dict]:
    return run_distributed(_three_runs, RANKS, args=(tmp,), timeout=240)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _runs(str(tmp_path_factory.mktemp("stragglers")))


@pytest.mark.parametrize("where", ["data", "compute"])
def test_a_sleeping_rank_is_named_with_its_phase_within_20_steps(runs: list[dict], where: str) -> None:
    for run in runs:
        named = [(r["step"], r.get("stragglers")) for r in run[where]["records"]]
        first = next(step for step, said in named if said)
        assert first <= 20, named
        said = dict(named)[first]
        assert len(said) == 1 and re.fullmatch(rf"rank 2 slow: {where} [\d.]+x the median", said[0]), named
    # The progress line of rank 0, which prints for the job, says it too.
    assert re.search(rf"step 20 .*straggler rank 2 slow: {where} [\d.]+x the median", runs[0][where]["printed"]), \
        runs[0][where]["printed"]


def test_a_run_without_a_straggler_names_none_over_200_steps(runs: list[dict]) -> None:
    records = runs[0]["none"]["records"]
    assert records[-1]["step"] == 200 and len(records) == 50
    assert [r for r in records if r.get("stragglers")] == [], [r["stragglers"] for r in records]
    # The ranks did compare: windows of 4 steps, or of 0.1 s where steps are short.
    judged = [r["step"] for r in records if "stragglers" in r]
    assert len(judged) >= 5, (judged, [r["samples_per_s"] for r in records])
    assert "straggler" not in runs[0]["none"]["printed"]


def test_a_prepared_loop_names_the_straggler_on_rank_0s_stderr(runs: list[dict]) -> None:
    said = runs[0]["own loop"]
    assert re.search(r"^tandem: rank 2 slow: data [\d.]+x the median "
                     r"\(the ranks compare their steps every 4 or more, 0\.1 s at least\)$",
                     said, re.M), said
    assert said.count("tandem: rank 2 slow") == 1  # said when it changes, not at every window
    assert runs[1]["own loop"] == runs[2]["own loop"] == ""  # rank 0 says it for the job


def test_the_report_of_a_run_with_a_straggler_names_it_and_draws_its_phases(runs: list[dict]) -> None:
    from pathlib import Path

    from tandem.launch.cli import main

    out = Path(runs[0]["data"]["out"])
    assert sorted(p.name for p in (out / "traces").iterdir()) == ["rank-0.json", "rank-1.json", "rank-2.json"]
    assert main(["report", str(out)]) == 0  # `tandem report RUN_DIR`
    page = (out / "report.html").read_text()
    assert re.search(r"<td[^>]*>rank 2 slow: data [\d.]+x the median</td>", page)
    assert page.count("<svg") == 4  # loss, throughput, phases, one step's collectives against compute
    assert "aria-label='phases'" in page and "aria-label='timeline'" in page
    for rank in range(RANKS):
        assert f">rank {rank}</text>" in page
    # The timeline: on each rank's lane the last step's phases, and its collectives (the DDP
    # all-reduce); rank 2's wait for its batch is long (30 ms asleep), the others' short.
    timeline = page[page.index("aria-label='timeline'"):]
    lanes = re.split(r">rank \d</text>", timeline[:timeline.index("</svg>")])[1:]
    data_ms = [float(_found(r"<title>data ([\d.]+) ms</title>", lane)) for lane in lanes]
    assert len(lanes) == RANKS and data_ms[2] >= 25 and max(data_ms[:2]) < 10, data_ms
    for lane in lanes:
        assert "<title>forward and backward" in lane and "<title>optimizer" in lane
        assert re.search(r"<title>#\d+ all_reduce bucket 0 \(162 x float32\)", lane), lane
    assert "<script" not in page and "src=" not in page and "stylesheet" not in page  # nothing fetched
    assert "href='traces/rank-2.json'" in page
    assert "The world never changed." in page
