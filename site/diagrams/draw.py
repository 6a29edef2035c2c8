"""Draw the docs' timelines from a real run: ``python docs/diagrams/draw.py``.

Two gloo ranks on this machine train a small model for a few steps, under
tandem's DDP and then under ``fully_shard``. Rank 0 keeps what happened in its
last step: when each parameter's gradient became final (a post-accumulate-grad
hook), when each unit's forward and backward ran (module hooks), and, from
tandem's collective ledger (``tandem.comm.ledger``: every collective tandem
issues, with the time it was issued and the time this rank saw it complete),
each bucket's all-reduce and each unit's all-gather and reduce-scatter. The
pictures are drawn from those times, nothing by hand:

- ``ddp_buckets.svg``: a gradient's way through buckets and collectives in backward;
- ``fsdp_timeline.svg``: fully_shard's gather / compute / reduce-scatter timeline.

matplotlib is in the ``test`` extra. The times differ from run to run and machine to
machine; the order of events, which is what the pictures show, does not.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
STEPS = 4  # the last one is drawn: the buckets have been re-planned in arrival order by then


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.Tanh())], nn.Linear(256, 8))


def _last_step(ledger, since: float) -> list[dict]:
    return [e.to_dict() for e in ledger.entries() if e.issued_at >= since]


def ddp_rank(rank: int, world_size: int) -> dict:
    import tandem
    from tandem.comm.monitor import current_monitor

    tandem.init()
    ledger = current_monitor().ledger
    ledger.resize(4096)
    model = _mlp()
    ready: dict[str, float] = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: ready.__setitem__(name, time.time()))
    ddp = tandem.DistributedDataParallel(model, bucket_cap_mb=0.5)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(256, 256), torch.randn(256, 8)
    for _ in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        start = time.time()
        loss.backward()
        end = time.time()
        opt.step()
    plan = [(b.index, list(b.names)) for b in ddp.reducer.buckets]
    return {"start": start, "end": end, "ready": ready, "plan": plan, "collectives": _last_step(ledger, start)}


def fsdp_rank(rank: int, world_size: int) -> dict:
    import tandem
    from tandem.comm.monitor import current_monitor

    tandem.init()
    ledger = current_monitor().ledger
    ledger.resize(4096)
    model = _mlp()
    blocks = [model[i] for i in range(0, 12, 2)]
    spans: list[tuple[str, str, float, float]] = []
    opened: dict[tuple[str, str], float] = {}
    for i, block in enumerate(blocks):
        name = f"{2 * i}"
        block.register_forward_pre_hook(lambda m, a, name=name: opened.__setitem__(("forward", name), time.time()))
        block.register_forward_hook(lambda m, a, o, name=name: spans.append(
            ("forward", name, opened[("forward", name)], time.time())))
        block.register_full_backward_pre_hook(lambda m, g, name=name: opened.__setitem__(("backward", name),
                                                                                         time.time()))
        block.register_full_backward_hook(lambda m, gi, go, name=name: spans.append(
            ("backward", name, opened[("backward", name)], time.time())))
        tandem.fully_shard(block, min_unit_bytes=0)
    tandem.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # The input asks for a gradient only so that the first block's backward hook fires (and is drawn).
    x, y = torch.randn(256, 256, requires_grad=True), torch.randn(256, 8)
    for _ in range(STEPS):
        spans.clear()
        start = time.time()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        end = time.time()
        opt.step()
        opt.zero_grad()
    return {"start": start, "end": end, "spans": spans, "collectives": _last_step(ledger, start)}


def _ms(t: float, t0: float) -> float:
    return (t - t0) * 1e3


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, ax, path: Path) -> None:
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None} if path.suffix == ".svg" else None)
    fig.clf()


def draw_ddp(run: dict, path: Path) -> None:
    plt = _pyplot()
    t0 = run["start"]
    bucket_of = {name: index for index, names in run["plan"] for name in names}
    colors = plt.get_cmap("tab10")
    reduces = [c for c in run["collectives"] if c["tag"].startswith("bucket")]
    names = sorted(run["ready"], key=lambda n: run["ready"][n])
    fig, ax = plt.subplots(figsize=(8, 0.3 * (len(names) + len(reduces)) + 1.8))
    rows = []
    for name in names:  # one row per parameter: the moment its gradient is final
        y = len(rows)
        b = bucket_of.get(name, -1)
        ax.plot([_ms(run["ready"][name], t0)], [y], "o", color=colors(b % 10), markersize=6)
        rows.append(f"{name} (bucket {b})")
    for c in reduces:  # one row per bucket's all-reduce: launched, then seen complete
        y = len(rows)
        b = int(c["tag"].split()[1])
        left = _ms(c["issued_at"], t0)
        right = _ms(c["completed_at"] or run["end"], t0)
        ax.barh(y, max(right - left, 0.05), left=left, height=0.6, color=colors(b % 10), alpha=0.8)
        ax.plot([left], [y], "|", color="black", markersize=12)
        rows.append(f"{c['op']} '{c['tag']}' ({c['numel']} x {c['dtype']})")
    ax.axvline(_ms(run["end"], t0), color="grey", linestyle="--", linewidth=1)
    ax.text(_ms(run["end"], t0), -0.9, "backward returns ", color="grey", fontsize=8, va="top", ha="right")
    ax.set_yticks(range(len(rows)), rows, fontsize=9)
    ax.set_ylim(len(rows) - 0.4, -1.2)
    ax.set_xlim(left=0)
    ax.set_xlabel("ms since loss.backward() was called (rank 0 of 2, gloo)")
    ax.set_title("DDP backward: each gradient lands in its bucket (dots);\na full bucket's all-reduce "
                 "starts at once (|) and runs while backward goes on", fontsize=10)
    _save(fig, ax, path)


def draw_fsdp(run: dict, path: Path) -> None:
    plt = _pyplot()
    t0 = run["start"]
    lanes = {"compute": 0, "all_gather": 1, "reduce_scatter": 2}
    colors = {"forward": "tab:blue", "backward": "tab:orange", "all_gather": "tab:green",
              "reduce_scatter": "tab:red"}
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for kind, name, a, b in run["spans"]:
        ax.barh(0, max(_ms(b, t0) - _ms(a, t0), 0.05), left=_ms(a, t0), height=0.6, color=colors[kind],
                edgecolor="white")
        ax.text((_ms(a, t0) + _ms(b, t0)) / 2, 0, name, ha="center", va="center", fontsize=8, color="white")
    count = {"all_gather": 0, "reduce_scatter": 0}
    for c in run["collectives"]:
        op = c["op"].replace("_into", "").replace("_tensor", "")
        lane = "all_gather" if "gather" in op else "reduce_scatter" if "scatter" in op else None
        if lane is None:
            continue
        left, right = _ms(c["issued_at"], t0), _ms(c["completed_at"] or run["end"], t0)
        y = lanes[lane] + (0.18 if count[lane] % 2 else -0.18)  # alternate: collectives in flight overlap
        count[lane] += 1
        ax.barh(y, max(right - left, 0.05), left=left, height=0.34, color=colors[lane], alpha=0.8,
                edgecolor="white")
        unit = c["tag"].removeprefix("unit ")
        ax.text((left + right) / 2, y, unit if unit != "<root>" else "root", ha="center", va="center",
                fontsize=8)
    ax.set_yticks(range(3), ["compute (units)", "all-gather", "reduce-scatter"])
    ax.set_ylim(2.6, -0.6)
    ax.set_xlim(left=0)
    ax.set_xlabel("ms since the step's forward began (rank 0 of 2, gloo)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.28))
    ax.set_title("fully_shard, one step: each unit is gathered before its forward and its backward;\n"
                 "its gradients are reduce-scattered while the earlier units' backward runs", fontsize=10)
    _save(fig, ax, path)


def main() -> None:
    import argparse

    from tandem.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=HERE, help="where to write (default: docs/diagrams/)")
    parser.add_argument("--format", default="svg", help="svg (what the docs use) or png")
    args = parser.parse_args()
    ddp = run_distributed(ddp_rank, 2)[0]
    fsdp = run_distributed(fsdp_rank, 2)[0]
    paths = args.out / f"ddp_buckets.{args.format}", args.out / f"fsdp_timeline.{args.format}"
    draw_ddp(ddp, paths[0])
    draw_fsdp(fsdp, paths[1])
    print(f"wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
