"""The report's page, drawn from plain data: :class:`RunData`, :func:`render`.

Pure: no file is read here, so a test can draw any run. Charts are inline
SVG with their numbers as text beside them, styles are attributes, and there
is no script: the page is the same in any browser, offline.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunData", "render"]

_PHASE_COLOURS = {"data": "#d95f02", "compute": "#1b9e77", "comm": "#7570b3", "optimizer": "#e7298a"}
_FONT = "font-family='sans-serif' font-size='12'"


@dataclass
class RunData:
    """What a run left: its records (``metrics.jsonl``), each rank's trace
    spans, restarts and hang reports."""

    name: str
    records: list[dict[str, Any]]
    traces: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    trace_files: list[str] = field(default_factory=list)
    attempts: int = 0
    hangs: list[tuple[str, str]] = field(default_factory=list)


def render(run: RunData) -> str:
    """The whole page, as HTML text."""
    train = [r for r in run.records if r.get("kind") == "train"]
    evals = [r for r in run.records if r.get("kind") == "eval"]
    changes = [r for r in run.records if r.get("kind") == "elastic"]
    named = [(r["step"], s) for r in train for s in r.get("stragglers") or []]
    parts = [f"<h1>tandem report</h1><p>{_e(run.name)}: {len(train)} training records"
             + (f", last at step {train[-1]['step']}, loss {train[-1]['loss']:.4f}" if train else "")
             + (f"; evaluation loss {evals[-1].get('loss', float('nan')):.4f}" if evals else "") + "</p>"]
    parts.append("<h2>Loss</h2>" + _line_chart(
        [("train", "#1f77b4", [(r["step"], r["loss"]) for r in train]),
         ("eval", "#d62728", [(r["step"], r["loss"]) for r in evals if "loss" in r])], "loss"))
    parts.append("<h2>Throughput</h2>" + _line_chart(
        [("samples/s", "#2ca02c", [(r["step"], r["samples_per_s"]) for r in train])], "samples/s"))
    parts.append("<h2>Stragglers</h2>" + (_table(["step", "named"], [[str(s), t] for s, t in named]) if named
                                          else "<p>No rank was named slow.</p>"))
    phased = [r for r in train if r.get("rank_phases")]
    if phased:
        last = phased[-1]
        parts.append(f"<h2>Each rank's step, by phase (mean over the window before step {last['step']})</h2>"
                     + _phase_bars(last["rank_phases"]))
    if run.traces:
        parts.append("<h2>One step: collectives against compute</h2>" + _timeline(run.traces))
        parts.append("<p>Traces (Chrome / Perfetto: open them at ui.perfetto.dev): "
                     + ", ".join(f"<a href='{_e(f)}'>{_e(f)}</a>" for f in run.trace_files) + "</p>")
    parts.append("<h2>World changes</h2>" + (_table(
        ["step", "world", "lost ranks", "joined", "seen after (s)", "regroup (s)"],
        [[str(c.get("step")), f"{c.get('previous_world_size')} -> {c.get('world_size')}",
          ", ".join(map(str, c.get("lost_ranks") or [])) or "-", ", ".join(c.get("joined") or []) or "-",
          f"{c.get('detect_s', 0):.2f}", f"{c.get('regroup_s', 0):.2f}"] for c in changes])
        if changes else "<p>The world never changed.</p>"))
    restarts = max(0, run.attempts - 1)
    parts.append(f"<h2>Restarts and hangs</h2><p>{restarts} restart(s).</p>"
                 + "".join(f"<h3>{_e(name)}</h3><pre>{_e(text)}</pre>" for name, text in run.hangs))
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>tandem report</title></head>"
            "<body style='font-family:sans-serif;max-width:1100px;margin:2em auto;line-height:1.4'>"
            + "\n".join(parts) + "</body></html>\n")


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _table(header: list[str], rows: list[list[str]]) -> str:
    cells = "".join(f"<th style='text-align:left;padding:2px 12px'>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td style='padding:2px 12px'>{_e(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table style='border-collapse:collapse'><tr>{cells}</tr>{body}</table>"


def _line_chart(series: list[tuple[str, str, list[tuple[float, float]]]], label: str) -> str:
    points = [p for _, _, pts in series for p in pts]
    if not points:
        return "<p>Nothing recorded.</p>"
    w, h, pad = 900, 260, 60
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)

    def at(x: float, y: float) -> str:
        return f"{pad + (x - x0) / (x1 - x0) * (w - 2 * pad):.1f},{h - pad - (y - y0) / (y1 - y0) * (h - 2 * pad):.1f}"

    out = [f"<svg width='{w}' height='{h}' xmlns='http://www.w3.org/2000/svg' role='img' aria-label='{_e(label)}'>",
           f"<line x1='{pad}' y1='{h - pad}' x2='{w - pad}' y2='{h - pad}' stroke='#888'/>",
           f"<line x1='{pad}' y1='{pad}' x2='{pad}' y2='{h - pad}' stroke='#888'/>",
           f"<text x='{pad}' y='{h - pad + 18}' {_FONT}>step {x0:g}</text>",
           f"<text x='{w - pad}' y='{h - pad + 18}' text-anchor='end' {_FONT}>step {x1:g}</text>",
           f"<text x='{pad - 4}' y='{pad + 4}' text-anchor='end' {_FONT}>{_number(y1)}</text>",
           f"<text x='{pad - 4}' y='{h - pad}' text-anchor='end' {_FONT}>{_number(y0)}</text>"]
    for i, (name, colour, pts) in enumerate(series):
        if not pts:
            continue
        out.append(f"<polyline fill='none' stroke='{colour}' stroke-width='2' points='"
                   + " ".join(at(x, y) for x, y in pts) + "'/>")
        out += [f"<circle cx='{at(x, y).split(',')[0]}' cy='{at(x, y).split(',')[1]}' r='3' fill='{colour}'/>"
                for x, y in pts] if len(pts) < 30 else []
        out.append(f"<text x='{w - pad}' y='{pad + 16 * i}' text-anchor='end' fill='{colour}' {_FONT}>{_e(name)}"
                   f" (last {_number(pts[-1][1], 4)})</text>")
    return "".join(out) + "</svg>"


def _number(value: float, digits: int = 3) -> str:
    """``1,260`` rather than ``1.26e+03``: an axis label that fits its margin."""
    return f"{value:,.0f}" if abs(value) >= 10 ** digits else f"{value:.{digits}g}"


def _phase_bars(rank_phases: list[list[float]]) -> str:
    w, bar, pad = 900, 22, 90
    longest = max(sum(p) for p in rank_phases) or 1.0
    h = 10 + bar * (2 * len(rank_phases) - 1) + 34
    out = [f"<svg width='{w}' height='{h}' xmlns='http://www.w3.org/2000/svg' role='img' aria-label='phases'>"]
    for r, phases in enumerate(rank_phases):
        y, x = 10 + 2 * bar * r, float(pad)
        out.append(f"<text x='{pad - 8}' y='{y + bar * 0.7}' text-anchor='end' {_FONT}>rank {r}</text>")
        for (name, colour), seconds in zip(_PHASE_COLOURS.items(), phases):
            width = seconds / longest * (w - pad - 420)
            out.append(f"<rect x='{x:.1f}' y='{y}' width='{width:.1f}' height='{bar}' fill='{colour}'>"
                       f"<title>{name} {1e3 * seconds:.2f} ms</title></rect>")
            x += width
        out.append(f"<text x='{x + 6:.1f}' y='{y + bar * 0.7}' {_FONT}>{1e3 * sum(phases):.1f} ms: "
                   + ", ".join(f"{n} {1e3 * s:.1f}" for n, s in zip(_PHASE_COLOURS, phases)) + "</text>")
    legend = "".join(f"<tspan fill='{c}'>■ {n}  </tspan>" for n, c in _PHASE_COLOURS.items())
    out.append(f"<text x='{pad}' y='{h - 8}' {_FONT}>{legend}</text>")
    return "".join(out) + "</svg>"


def _timeline(traces: dict[int, list[dict[str, Any]]]) -> str:
    steps = {r: [e for e in es if e.get("cat") == "step"] for r, es in traces.items()}
    if not all(steps.values()):
        return "<p>No rank's trace holds a step.</p>"
    step = min(max(e["args"]["step"] for e in spans) for spans in steps.values())  # the last every rank ended
    lanes = {}
    for rank in sorted(traces):
        phases = [e for e in steps[rank] if e["args"]["step"] == step]
        if not phases:
            return f"<p>Step {step} is not in rank {rank}'s trace.</p>"
        begin, end = min(e["ts"] for e in phases), max(e["ts"] + e["dur"] for e in phases)
        lanes[rank] = (phases, [e for e in traces[rank] if e.get("cat") != "step" and begin <= e["ts"] <= end])
    spans = [e for phases, colls in lanes.values() for e in phases + colls]
    t0, t1 = min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)
    w, lane, pad = 900, 46, 70
    h = 46 + lane * len(lanes)
    scale = (w - pad - 10) / max(t1 - t0, 1e-9)
    colours = {"data": _PHASE_COLOURS["data"], "forward and backward": _PHASE_COLOURS["compute"],
               "optimizer": _PHASE_COLOURS["optimizer"]}
    out = [f"<svg width='{w}' height='{h}' xmlns='http://www.w3.org/2000/svg' role='img' aria-label='timeline'>"]
    for i, (rank, (phases, colls)) in enumerate(lanes.items()):
        y = 4 + lane * i
        out.append(f"<text x='{pad - 8}' y='{y + 22}' text-anchor='end' {_FONT}>rank {rank}</text>")
        for e in phases:
            out.append(f"<rect x='{pad + (e['ts'] - t0) * scale:.1f}' y='{y}' width='{max(1.0, e['dur'] * scale):.1f}' "
                       f"height='16' fill='{colours.get(e['name'], '#999')}'><title>{_e(e['name'])} "
                       f"{e['dur'] / 1e3:.2f} ms</title></rect>")
        for e in colls:
            out.append(f"<rect x='{pad + (e['ts'] - t0) * scale:.1f}' y='{y + 19}' "
                       f"width='{max(1.0, e['dur'] * scale):.1f}' height='18' fill='{_PHASE_COLOURS['comm']}' "
                       f"fill-opacity='0.75' stroke='#3b3880'><title>#{e['args'].get('seq')} {_e(e['args'].get('op'))} "
                       f"{_e(e['name'])} "
                       f"({e['args'].get('numel')} x {e['args'].get('dtype')}) {e['dur'] / 1e3:.2f} ms</title></rect>")
    count = sum(len(colls) for _, colls in lanes.values())
    legend = "".join(f"<tspan fill='{c}'>■ {n}  </tspan>" for n, c in colours.items())
    out.append(f"<text x='{pad}' y='{h - 24}' {_FONT}>{legend}<tspan fill='{_PHASE_COLOURS['comm']}'>"
               "■ collective, issue to completion</tspan></text>")
    out.append(f"<text x='{pad}' y='{h - 6}' {_FONT}>step {step} on each rank: its phases above, its {count} "
               f"collectives below, over {(t1 - t0) / 1e3:.1f} ms of wall-clock time</text>")
    return "".join(out) + "</svg>"
