"""Step time of tandem.DistributedDataParallel against torch's, on gloo ranks (2 by default).

Run book::

    python benchmarks/bench_ddp.py                                   # all models, defaults
    python benchmarks/bench_ddp.py --models many --steps 20 --repeats 8
    python benchmarks/bench_ddp.py --ddp-kwargs gradient_as_bucket_view=True
    python benchmarks/bench_ddp.py --models many --profile 30        # + cProfile of rank 0
    python benchmarks/bench_ddp.py --hooks none,fp16,bf16,powersgd   # communication hooks
    python benchmarks/bench_ddp.py --models transformer --compile    # + both DDPs under torch.compile
    python benchmarks/bench_ddp.py --models transformer --world-size 4

The script launches its own ranks, 2 unless ``--world-size`` says otherwise
(tandem.testing.run_distributed: forkserver children, a gloo group, one
intra-op thread per rank) and prints two Markdown tables from rank 0's clocks:
wall-clock time per step, and the main thread's CPU time per step
(time.thread_time), which shows what each wrapper costs the training thread
even when other processes share the machine.

For each model, both wrappers are built once, on separate copies of the same
model, with the same keyword arguments. After ``--warmup`` steps of each, the
script runs ``--repeats`` rounds; a round is one block of ``--steps`` steps per
contender, the blocks in rotating order, each block started on a barrier:

* ``torch``   torch.nn.parallel.DistributedDataParallel
* ``tandem``  tandem.DistributedDataParallel
* ``compute`` the plain module: the same step with no DDP and no communication
* ``comm``    one dist.all_reduce of a flat fp32 tensor as large as all gradients

With ``--compile``, the transformer model also gets, compiled with
``torch.compile`` (inductor, the default backend):

* ``torch+compile``    torch.compile(torch's DDP)
* ``tandem+compile``   torch.compile(tandem's DDP)
* ``compute+compile``  torch.compile(the plain module), their compute baseline

Both DDPs have dynamo split the compiled graph at their buckets (dynamo's
DDPOptimizer, Note [torch.compile] in tandem/ddp/compile.py), so that their
reductions can overlap the compiled backward. Each compiles in one untimed step
when it is built, before the warm-up; the tables give them rows of their own
(``transformer+compile``), with the same columns against compute+compile.

A step is ``zero_grad(set_to_none=True)``, forward, MSE loss, backward, SGD step,
timed with time.perf_counter (and time.thread_time). Alternating blocks in one run spreads drift of the
machine (other processes, frequency, caches) over all contenders alike.

Wall-clock columns: median step time over all measured steps; in brackets the first and
third quartiles of the per-block medians (the spread across rounds); tandem/torch
is the ratio of the medians, with the quartiles of the per-round ratios (tandem's
block over torch's block of the same round) in brackets;
overlap = (compute + comm - step) / min(compute, comm): 1 means the reduction is
completely hidden behind backward, 0 means none of it is, negative means the
wrapper costs more than compute and communication one after the other.
floor = compute + comm of the same round (on 2 cores two gloo ranks cannot
overlap them); above = a DDP's step minus the floor of its round, medians over
rounds; tandem/torch above is the median of the per-round ratios [quartiles].
CPU columns: median main-thread CPU per step; overhead = DDP minus compute.

With ``--hooks``, the contenders are instead each DDP with each communication
hook (``none`` is no hook), plus ``compute`` and ``comm``, and the table gives
per hook the step time and the bytes each rank sends per step. tandem's bytes
are measured (``ddp.comm_stats``); torch's are what its hook hands to the
backend: all gradients at 4 bytes (none) or 2 (fp16), and for PowerSGD the
growth of its state's ``total_numel_after_compression`` at 4 bytes. torch's
equivalents: ``fp16_compress_hook``; ``bf16_compress_hook`` (torch's DDP refuses
it without NCCL: the refusal is reported); ``powerSGD_hook``, which aborts the
process on gloo with several buckets (a separate probe run checks, and reports,
whether it still does), so it is timed with one bucket (``bucket_cap_mb`` above
the model's size). Both PowerSGDs start compressing at step 2, inside warm-up.
"""

from __future__ import annotations

import argparse
import ast
import copy
import cProfile
import io
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tandem
from tandem.testing import RankFailure, run_distributed

MODELS = ("mlp", "transformer", "many")
CONTENDERS = ("torch", "tandem", "compute", "comm")
COMPILED = ("torch+compile", "tandem+compile", "compute+compile")
COMPILED_MODELS = ("transformer",)  # --compile adds the COMPILED contenders for these
HOOKS = ("none", "fp16", "bf16", "powersgd")


# ---------------------------------------------------------------------- models
class ResidualStack(nn.Module):
    """Hundreds of small parameters: ``depth`` residual Linear(width, width) layers.

    The residual keeps activations and gradients out of the denormal range, which
    would otherwise make the step time depend on the numbers rather than the code.
    """

    def __init__(self, depth: int = 200, width: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + 0.1 * torch.tanh(layer(x))
        return x


@dataclass(frozen=True)
class Workload:
    model: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor


def build_workload(name: str, rank: int) -> Workload:
    """The model (identical on every rank) and this rank's batch."""
    torch.manual_seed(0)
    if name == "mlp":
        width, batch = 1600, 16
        model: nn.Module = nn.Sequential(
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
        in_shape, out_shape = (batch, width), (batch, width)
    elif name == "transformer":
        d_model, batch, seq = 384, 4, 16
        layer = nn.TransformerEncoderLayer(d_model, nhead=6, dim_feedforward=4 * d_model,
                                           dropout=0.0, batch_first=True)
        model = nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False)
        in_shape = out_shape = (batch, seq, d_model)
    elif name == "many":
        width, batch = 32, 32
        model = ResidualStack(depth=200, width=width)
        in_shape = out_shape = (batch, width)
    else:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    gen = torch.Generator().manual_seed(1000 + rank)
    return Workload(model, torch.randn(in_shape, generator=gen), torch.randn(out_shape, generator=gen))


# ---------------------------------------------------------------------- steps
def make_train_step(model: nn.Module, work: Workload) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(work.inputs), work.targets)
        loss.backward()
        opt.step()

    return step


def make_comm_step(numel: int) -> Callable[[], None]:
    flat = torch.zeros(numel)

    def step() -> None:
        dist.all_reduce(flat)

    return step


def time_block(step: Callable[[], None], steps: int) -> tuple[list[float], list[float]]:
    """Wall-clock and main-thread CPU seconds of each of ``steps`` steps, all ranks
    starting together."""
    dist.barrier()
    wall, cpu = [], []
    for _ in range(steps):
        c0, t0 = time.thread_time(), time.perf_counter()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return wall, cpu


def profile_steps(step: Callable[[], None], steps: int, rank: int, top: int = 30) -> str:
    """cProfile ``steps`` steps on rank 0 (every rank runs them: they communicate)."""
    dist.barrier()
    prof = cProfile.Profile()
    if rank == 0:
        prof.enable()
    for _ in range(steps):
        step()
    if rank != 0:
        return ""
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    return f"{steps} steps, per-step cost = tottime / {steps}\n" + out.getvalue()


# ---------------------------------------------------------------------- one rank
@dataclass(frozen=True)
class BenchConfig:
    models: tuple[str, ...]
    steps: int
    warmup: int
    repeats: int
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    profile: int = 0
    hooks: tuple[str, ...] = ()
    powersgd_rank: int = 1
    compile: bool = False


def bench_rank(rank: int, world_size: int, cfg: BenchConfig) -> list[dict[str, Any]]:
    """Runs on each rank (module-level, for the harness); returns one record per model."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    if cfg.hooks:
        return [bench_hooks_model(name, rank, cfg) for name in cfg.models]
    return [bench_model(name, rank, cfg) for name in cfg.models]


def run_rounds(steps: dict[str, Callable[[], None]], cfg: BenchConfig,
               ) -> tuple[dict[str, list[list[float]]], dict[str, list[float]]]:
    """Warm up each contender, then ``cfg.repeats`` rounds of one block each, in
    rotating order; returns the wall-clock blocks and CPU times per contender."""
    names = tuple(steps)
    for c in names:
        time_block(steps[c], cfg.warmup)
    blocks: dict[str, list[list[float]]] = {c: [] for c in names}
    cpu: dict[str, list[float]] = {c: [] for c in names}
    for r in range(cfg.repeats):
        shift = r % len(names)
        for c in names[shift:] + names[:shift]:
            wall, block_cpu = time_block(steps[c], cfg.steps)
            blocks[c].append(wall)
            cpu[c] += block_cpu
    return blocks, cpu


def bench_model(name: str, rank: int, cfg: BenchConfig) -> dict[str, Any]:
    work = build_workload(name, rank)
    params = [p for p in work.model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    torch_ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(work.model), **cfg.ddp_kwargs)
    tandem_ddp = tandem.DistributedDataParallel(copy.deepcopy(work.model), **cfg.ddp_kwargs)
    steps = {
        "torch": make_train_step(torch_ddp, work),
        "tandem": make_train_step(tandem_ddp, work),
        "compute": make_train_step(copy.deepcopy(work.model), work),
        "comm": make_comm_step(numel),
    }
    if cfg.compile and name in COMPILED_MODELS:
        steps.update(compiled_steps(work, cfg))
    blocks, cpu = run_rounds(steps, cfg)

    record: dict[str, Any] = {"model": name, "numel": numel, "tensors": len(params),
                              "blocks": blocks, "cpu": cpu}
    if cfg.profile:
        record["profile"] = {c: profile_steps(steps[c], cfg.profile, rank)
                             for c in ("torch", "tandem")}
    return record


def compiled_steps(work: Workload, cfg: BenchConfig) -> dict[str, Callable[[], None]]:
    """The COMPILED contenders, each on its own copy of the model, compiled by one
    untimed step here (every rank runs it: the DDPs communicate)."""
    models = {
        "torch+compile": nn.parallel.DistributedDataParallel(copy.deepcopy(work.model), **cfg.ddp_kwargs),
        "tandem+compile": tandem.DistributedDataParallel(copy.deepcopy(work.model), **cfg.ddp_kwargs),
        "compute+compile": copy.deepcopy(work.model),
    }
    steps = {}
    for contender, model in models.items():
        steps[contender] = make_train_step(torch.compile(model), work)
        steps[contender]()
    return steps


# ---------------------------------------------------------------------- hooks
POWERSGD_START = 2  # torch's minimum with error feedback; inside the warm-up steps
PROBE_STEPS = 20


def tandem_with_hook(model: nn.Module, hook: str, cfg: BenchConfig) -> tandem.DistributedDataParallel:
    """tandem's DDP reducing with ``hook`` (a name from HOOKS)."""
    from tandem import comm_hooks

    ddp = tandem.DistributedDataParallel(model, **cfg.ddp_kwargs)
    if hook == "fp16":
        ddp.register_comm_hook(None, comm_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(None, comm_hooks.bf16_compress_hook)
    elif hook == "powersgd":
        config = comm_hooks.PowerSGDConfig(matrix_rank=cfg.powersgd_rank, start_iter=POWERSGD_START)
        ddp.register_comm_hook(comm_hooks.PowerSGDState(config), comm_hooks.powersgd_hook)
    return ddp


def torch_with_hook(model: nn.Module, hook: str, cfg: BenchConfig, numel: int, *,
                    one_bucket: bool) -> tuple[nn.Module | None, Callable[[], int] | None, str]:
    """torch's DDP with the hook equivalent to tandem's ``hook``; returns the DDP
    (None if torch refuses the hook), a function giving the bytes of the step just
    taken, and a note for the table."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    kwargs = dict(cfg.ddp_kwargs)
    note = ""
    if one_bucket:
        kwargs["bucket_cap_mb"] = numel * 4 / 2**20 + 1
        note = "1 bucket"
    ddp = nn.parallel.DistributedDataParallel(model, **kwargs)
    if hook == "none":
        return ddp, lambda: numel * 4, note
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp, lambda: numel * 2, note
    if hook == "bf16":
        try:
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        except (TypeError, RuntimeError) as e:  # torch: "requires CUDA 11+ and NCCL 2.10+"
            return None, None, f"n/a: torch's DDP refuses it ({str(e).splitlines()[0]})"
        return ddp, lambda: numel * 2, note
    assert hook == "powersgd", hook
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=cfg.powersgd_rank,
                                        start_powerSGD_iter=POWERSGD_START)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    seen = [0]

    def step_bytes() -> int:
        # Elements the hook sent since the last call: P, Q and the uncompressed
        # tensors (its counter only moves once compression has started).
        sent = state.total_numel_after_compression - seen[0]
        seen[0] = state.total_numel_after_compression
        return (sent or numel) * 4

    return ddp, step_bytes, note


def make_counted_step(ddp: nn.Module, work: Workload, step_bytes: Callable[[], int],
                      record: list[int]) -> Callable[[], None]:
    """A training step that appends the bytes it sent to ``record``."""
    train = make_train_step(ddp, work)

    def step() -> None:
        train()
        record.append(step_bytes())

    return step


def bench_hooks_model(name: str, rank: int, cfg: BenchConfig) -> dict[str, Any]:
    work = build_workload(name, rank)
    params = [p for p in work.model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    steps: dict[str, Callable[[], None]] = {
        "compute": make_train_step(copy.deepcopy(work.model), work),
        "comm": make_comm_step(numel),
    }
    sent: dict[str, list[int]] = {}
    notes: dict[str, str] = {}
    for hook in cfg.hooks:
        ddp, step_bytes, notes[f"torch {hook}"] = torch_with_hook(
            copy.deepcopy(work.model), hook, cfg, numel, one_bucket=hook == "powersgd")
        if ddp is not None and step_bytes is not None:
            sent[f"torch {hook}"] = []
            steps[f"torch {hook}"] = make_counted_step(ddp, work, step_bytes, sent[f"torch {hook}"])
        ours = tandem_with_hook(copy.deepcopy(work.model), hook, cfg)
        sent[f"tandem {hook}"] = []
        steps[f"tandem {hook}"] = make_counted_step(
            ours, work, lambda ddp=ours: ddp.comm_stats.bytes, sent[f"tandem {hook}"])
    blocks, cpu = run_rounds(steps, cfg)
    measured = cfg.repeats * cfg.steps
    return {"model": name, "numel": numel, "tensors": len(params), "blocks": blocks, "cpu": cpu,
            "bytes": {c: statistics.median(b[-measured:]) for c, b in sent.items()},
            "notes": notes}


def probe_torch_powersgd(rank: int, world_size: int, name: str, cfg: BenchConfig) -> int:
    """A few steps of torch's DDP with powerSGD_hook and its default buckets."""
    torch.set_num_threads(1)
    work = build_workload(name, rank)
    numel = sum(p.numel() for p in work.model.parameters())
    ddp, _, _ = torch_with_hook(work.model, "powersgd", cfg, numel, one_bucket=False)
    assert ddp is not None
    step = make_train_step(ddp, work)
    for _ in range(PROBE_STEPS):
        step()
    logging_data = getattr(ddp, "_get_ddp_logging_data", dict)()  # private, informative only
    return int(logging_data.get("num_buckets_reduced", 0))


def probe_torch_powersgd_all(cfg: BenchConfig, world_size: int) -> dict[str, str]:
    """Per model: whether torch's powerSGD_hook survives its default buckets on
    gloo (in separate processes: when it fails, gloo aborts the process)."""
    verdicts = {}
    for name in cfg.models:
        try:
            buckets = run_distributed(probe_torch_powersgd, world_size=world_size, args=(name, cfg),
                                      timeout=600)[0]
            verdicts[name] = (f"with its default buckets ({buckets or '?'}) it ran {PROBE_STEPS} "
                              "steps this time")
        except RankFailure as e:
            reports = "\n".join(e.tracebacks.values())
            why = ("a rank was killed by SIGABRT; gloo's reason is on stderr"
                   if "code -6" in reports else e.tracebacks[e.rank].strip().splitlines()[-1])
            verdicts[name] = f"with its default buckets it aborted ({why})"
        except TimeoutError:
            verdicts[name] = "hung with its default buckets (killed after 600 s)"
    return verdicts


def summarise_hooks(record: dict[str, Any], hooks: tuple[str, ...]) -> list[dict[str, Any]]:
    blocks = record["blocks"]
    med = {c: statistics.median(t for b in blocks[c] for t in b) for c in blocks}
    base = record["bytes"].get("tandem none")
    rows = []
    for hook in hooks:
        t, d = f"torch {hook}", f"tandem {hook}"
        rows.append({
            "model": record["model"], "numel": record["numel"], "tensors": record["tensors"],
            "hook": hook, "torch_ms": med.get(t), "tandem_ms": med[d],
            "torch_bytes": record["bytes"].get(t), "tandem_bytes": record["bytes"][d],
            "fewer": None if base is None else base / record["bytes"][d],
            "note": record["notes"].get(t, ""), "compute_ms": med["compute"], "comm_ms": med["comm"]})
    return rows


def _mb(n: float | None) -> str:
    if n is None:
        return "n/a"
    mb = n / 1e6
    return f"{mb:.1f} MB" if mb >= 10 else f"{mb:.2f} MB" if mb >= 0.1 else f"{mb * 1e3:.1f} kB"


def format_hooks_table(rows: list[dict[str, Any]], probes: dict[str, str]) -> str:
    lines = [
        "| model | hook | torch step ms | tandem step ms | tandem/torch | torch bytes/step "
        "| tandem bytes/step | tandem bytes vs none | torch note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        torch_ms = "n/a" if row["torch_ms"] is None else _ms(row["torch_ms"])
        ratio = "" if row["torch_ms"] is None else f"{row['tandem_ms'] / row['torch_ms']:.2f}"
        fewer = "" if row["fewer"] is None else f"÷{row['fewer']:.3g}"
        note = row["note"]
        if row["hook"] == "powersgd" and row["model"] in probes:
            note = f"{note}; {probes[row['model']]}" if note else probes[row["model"]]
        lines.append(
            f"| {row['model']} | {row['hook']} | {torch_ms} | {_ms(row['tandem_ms'])} | {ratio} "
            f"| {_mb(row['torch_bytes'])} | **{_mb(row['tandem_bytes'])}** | {fewer} | {note} |")
    lines.append("")
    for row in rows:
        if row["hook"] == rows[0]["hook"]:
            lines.append(f"- {row['model']}: {row['numel'] / 1e6:.2f}M parameters in {row['tensors']} "
                         f"tensors; compute alone {_ms(row['compute_ms'])} ms per step, one fp32 "
                         f"all-reduce of all gradients {_ms(row['comm_ms'])} ms")
    return "\n".join(lines)


# ---------------------------------------------------------------------- report
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}" if seconds >= 0.01 else f"{seconds * 1e3:.2f}"


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def summarise(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One table row per variant the record holds: eager, and ``+compile`` where
    the COMPILED contenders ran (their row reads them under the eager names)."""
    rows = []
    for suffix in ("", "+compile"):
        if f"tandem{suffix}" not in record["blocks"]:
            continue
        names = {c: c if c == "comm" else c + suffix for c in CONTENDERS}
        blocks = {c: record["blocks"][n] for c, n in names.items()}
        row = summarise_blocks(blocks, {c: record["cpu"][n] for c, n in names.items()})
        rows.append({"model": record["model"] + suffix, "numel": record["numel"],
                     "tensors": record["tensors"], **row})
    return rows


def summarise_blocks(blocks: dict[str, list[list[float]]], cpu: dict[str, list[float]]) -> dict[str, Any]:
    med = {c: statistics.median(t for b in blocks[c] for t in b) for c in CONTENDERS}
    block_med = {c: [statistics.median(b) for b in blocks[c]] for c in CONTENDERS}
    round_ratio = [a / b for a, b in zip(block_med["tandem"], block_med["torch"])]
    compute, comm = med["compute"], med["comm"]

    def overlap(step: float) -> float:
        return (compute + comm - step) / min(compute, comm)

    # The floor (issue 33): on 2 cores two gloo ranks cannot overlap communication with
    # compute, so compute + comm of the same round is what no wrapper goes below.
    floors = [a + b for a, b in zip(block_med["compute"], block_med["comm"])]
    above = {c: [step - floor for step, floor in zip(block_med[c], floors)] for c in ("torch", "tandem")}
    above_ratio = [d / t for d, t in zip(above["tandem"], above["torch"]) if t > 0]
    return {"median": med, "block_iqr": {c: _quartiles(v) for c, v in block_med.items()},
            "ratio": med["tandem"] / med["torch"], "ratio_iqr": _quartiles(round_ratio),
            "overlap": {c: overlap(med[c]) for c in ("torch", "tandem")},
            "floor": statistics.median(floors),
            "above": {c: statistics.median(v) for c, v in above.items()},
            "above_ratio": statistics.median(above_ratio) if above_ratio else float("nan"),
            "above_ratio_iqr": _quartiles(above_ratio) if above_ratio else (float("nan"), float("nan")),
            "cpu": {c: statistics.median(cpu[c]) for c in CONTENDERS}}


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(row: dict[str, Any], c: str) -> str:
        q1, q3 = row["block_iqr"][c]
        return f"{_ms(row['median'][c])} [{_ms(q1)}–{_ms(q3)}]"

    lines = [
        "| model | params (tensors) | torch DDP step ms | tandem DDP step ms | tandem/torch "
        "| compute ms | comm ms | overlap torch | overlap tandem "
        "| floor ms | torch above ms | tandem above ms | tandem/torch above |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} | {row['numel'] / 1e6:.2f}M ({row['tensors']}) "
            f"| {cell(row, 'torch')} | {cell(row, 'tandem')} "
            f"| **{row['ratio']:.3f}** [{row['ratio_iqr'][0]:.2f}–{row['ratio_iqr'][1]:.2f}] "
            f"| {cell(row, 'compute')} | {cell(row, 'comm')} "
            f"| {row['overlap']['torch']:.2f} | {row['overlap']['tandem']:.2f} "
            f"| {_ms(row['floor'])} | {_ms(row['above']['torch'])} | {_ms(row['above']['tandem'])} "
            f"| **{row['above_ratio']:.2f}** [{row['above_ratio_iqr'][0]:.2f}–{row['above_ratio_iqr'][1]:.2f}] |")
    return "\n".join(lines)


def format_cpu_table(rows: list[dict[str, Any]]) -> str:
    """Main-thread CPU per step: what each wrapper costs the training thread itself,
    whatever else the machine is running (waiting for a reduction costs none)."""
    lines = [
        "| model | torch DDP CPU ms | tandem DDP CPU ms | compute CPU ms "
        "| torch overhead ms | tandem overhead ms | tandem/torch CPU |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        t, d, c = (row["cpu"][k] for k in ("torch", "tandem", "compute"))
        lines.append(f"| {row['model']} | {_ms(t)} | {_ms(d)} | {_ms(c)} | {_ms(t - c)} "
                     f"| {_ms(d - c)} | {d / t:.3f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- command line
def parse_ddp_kwargs(text: str) -> dict[str, Any]:
    """``"a=True,b=10"`` -> ``{"a": True, "b": 10}`` (values are Python literals)."""
    kwargs: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected key=value, got {item!r}")
        try:
            kwargs[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise argparse.ArgumentTypeError(
                f"value of {key.strip()!r} is not a Python literal: {value!r}") from None
    return kwargs


def name_list(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: a comma-separated, non-empty list of names from ``choices``."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(s.strip() for s in text.split(",") if s.strip())
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {unknown or text!r}; choose from {','.join(choices)}")
        return names

    return parse


parse_models = name_list(MODELS)
parse_hooks = name_list(HOOKS)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks, one intra-op thread each (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="steps per block (default 5)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="unmeasured steps per contender before the rounds (default 3)")
    parser.add_argument("--repeats", type=int, default=16,
                        help="rounds of one block per contender (default 16)")
    parser.add_argument("--models", type=parse_models, default=MODELS,
                        help=f"comma-separated, from {','.join(MODELS)} (default all)")
    parser.add_argument("--ddp-kwargs", type=parse_ddp_kwargs, default={},
                        help="keyword arguments for both wrappers, e.g. "
                             "gradient_as_bucket_view=True,bucket_cap_mb=10")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after measuring, cProfile N steps of each DDP on rank 0")
    parser.add_argument("--hooks", type=parse_hooks, default=(),
                        help=f"comma-separated communication hooks to compare, from {','.join(HOOKS)} "
                             "(none = no hook); prints step time and bytes per step per hook")
    parser.add_argument("--powersgd-rank", type=int, default=1,
                        help="matrix rank of PowerSGD with --hooks (default 1)")
    parser.add_argument("--compile", action="store_true",
                        help=f"also time torch.compile of both DDPs (and of the plain module) on "
                             f"{', '.join(COMPILED_MODELS)}: rows '<model>+compile'")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or args.warmup < 0 or args.world_size < 1:
        parser.error("--steps, --repeats and --world-size must be >= 1, --warmup >= 0")
    if args.compile and args.hooks:
        parser.error("--compile and --hooks do not combine")
    if args.compile and not set(args.models) & set(COMPILED_MODELS):
        parser.error(f"--compile times {', '.join(COMPILED_MODELS)} only; add it to --models")

    cfg = BenchConfig(models=args.models, steps=args.steps, warmup=args.warmup,
                      repeats=args.repeats, ddp_kwargs=args.ddp_kwargs, profile=args.profile,
                      hooks=args.hooks, powersgd_rank=args.powersgd_rank, compile=args.compile)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    records = run_distributed(bench_rank, world_size=args.world_size, args=(cfg,), timeout=3600)[0]
    probes = probe_torch_powersgd_all(cfg, args.world_size) if "powersgd" in cfg.hooks else {}
    elapsed = time.perf_counter() - started

    print(f"torch {torch.__version__}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, {args.world_size} gloo ranks x 1 intra-op thread; "
          f"ddp kwargs {cfg.ddp_kwargs or '(defaults)'}; "
          f"{cfg.repeats} rounds x {cfg.steps} steps per contender after {cfg.warmup} warm-up; "
          f"ran {elapsed:.0f} s; 1-min load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after\n")
    if cfg.hooks:
        print(f"Communication hooks (PowerSGD rank {cfg.powersgd_rank}, compressing from step "
              f"{POWERSGD_START}): wall-clock median per step and bytes each rank sends per step, "
              "rank 0\n")
        print(format_hooks_table([row for r in records for row in summarise_hooks(r, cfg.hooks)],
                                 probes))
        sys.stdout.flush()
        return
    rows = [row for r in records for row in summarise(r)]
    print("Wall-clock time per step, rank 0 (median [quartiles of the per-block medians])\n")
    print(format_table(rows))
    print("\nMain-thread CPU time per step, rank 0 (median)\n")
    print(format_cpu_table(rows))
    for r in records:
        for contender, text in r.get("profile", {}).items():
            print(f"\n## cProfile, {r['model']}, {contender} (rank 0)\n\n{text}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
