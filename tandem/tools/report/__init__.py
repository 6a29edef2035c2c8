"""``tandem report RUN_DIR``: one self-contained HTML page of a run.

What the Trainer leaves in its ``output_dir`` (``metrics.jsonl``: losses,
throughput, the ranks' step phases and the stragglers named, world changes;
``traces/rank-<r>.json``: each rank's last collectives), and what ``tandem
run --log-dir`` leaves (attempts, hang reports), drawn as one HTML file with
inline SVG: no script, no style sheet, nothing fetched, so that it opens
anywhere, offline, and can be mailed. Reading is here; drawing is the pure
:func:`tandem.tools.report.page.render`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from tandem.tools.report.page import RunData, render

__all__ = ["main", "read_run", "render"]


def read_run(run_dir: Path, logs: Path | None = None) -> RunData:
    """What ``run_dir`` (a Trainer's output_dir) and ``logs`` (tandem run's log dir) hold.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``metrics.jsonl``; the message names it.
    """
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: give the Trainer's output_dir "
                                "(TrainerConfig.output_dir) of a run that logged at least one record")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    traces: dict[int, list[dict]] = {}
    for path in sorted((run_dir / "traces").glob("rank-*.json")):
        rank = int(path.stem.split("-", 1)[1])
        traces[rank] = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    hangs: list[tuple[str, str]] = []
    attempts = 0
    if logs is not None:
        attempts = len([p for p in logs.glob("attempt_*") if p.is_dir()])
        hangs = [(p.name, p.read_text()) for p in sorted(logs.glob("hang-report-attempt_*.txt"))]
    return RunData(name=str(run_dir), records=records, traces=traces,
                   trace_files=[f"traces/rank-{r}.json" for r in sorted(traces)], attempts=attempts, hangs=hangs)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem report", description="Draw a run as one self-contained HTML page.")
    p.add_argument("run_dir", type=Path, help="the Trainer's output_dir (metrics.jsonl, traces/)")
    p.add_argument("--logs", type=Path, default=None, help="tandem run's --log-dir: restarts and hang reports")
    p.add_argument("--out", type=Path, default=None, help="where to write the page (default RUN_DIR/report.html)")
    args = p.parse_args(argv)
    try:
        run = read_run(args.run_dir, args.logs)
    except FileNotFoundError as e:
        print(f"tandem report: error: {e}", file=sys.stderr)
        return 2
    out = args.out or args.run_dir / "report.html"
    out.write_text(render(run))
    print(f"tandem report: {out}")
    return 0
