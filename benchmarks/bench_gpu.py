"""tandem on one GPU against torch: DDP's overhead over the bare model, fully_shard
against FSDP2 (step time and peak memory), and host synchronisations per step.

Run book (a machine with one CUDA GPU; about a minute)::

    python benchmarks/bench_gpu.py                       # GPT-2 small (124M), bf16 autocast
    python benchmarks/bench_gpu.py --layers 24 --width 1024 --rounds 12
    python benchmarks/bench_gpu.py --only ddp --profile bare,torch-ddp,tandem-reducer
    python benchmarks/bench_gpu.py --only ddp --host-profile tandem-reducer

A world of one on NCCL (tandem.init()). The model is the GPT example's
(tandem/examples/gpt_model.py, no activation checkpointing), batch x sequence
tokens of random ids, AdamW; a step is zero_grad(set_to_none=True), forward
under bf16 autocast (DDP rows) or with bf16 parameters through
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) (FSDP rows),
cross-entropy, backward, optimizer step.

Contenders, each on its own copy of the same model:

    bare            the model alone
    torch-ddp       torch's DistributedDataParallel
    tandem-ddp      tandem.DistributedDataParallel as users get it: a world of
                    one has nothing to reduce, so tandem builds no reducer
    tandem-reducer  tandem's DDP with its reducer built anyway (buckets, hooks,
                    the NCCL all-reduce of one rank): the cost a world of N pays
                    on the host
    torch-fsdp      torch.distributed.fsdp.fully_shard on each block, then the model
    tandem-fsdp     tandem.fsdp.fully_shard, the same calls (min_unit_bytes=0)

Time: contenders of a table run in interleaved rounds (a block of --steps steps
each, order rotating per round, torch.cuda.synchronize() around each block);
the median over rounds of each block's mean step, [q1..q3] over rounds, and
the ratio to the baseline (DDP rows: bare; FSDP rows: torch-fsdp) as the
median of the per-round ratios [q1..q3]. Peak memory:
torch.cuda.max_memory_allocated over two steps of a contender built alone
(every other contender freed), minus what was allocated before it was built:
parameters, gradients, optimizer state and activations. Host synchronisations:
torch.cuda.set_sync_debug_mode("warn") over 3 steps after 3 warm-up steps,
counting the warnings CUDA raises.

``--host-profile``: the Python time of the autograd engine's thread during
backward (where DDP's gradient hooks run on a GPU; the main thread only waits
there), by cProfile over 20 steps: started by a hook on every parameter the
first time it runs on that thread in a backward, stopped by a callback at the
end of that backward (after the reducer's own). Its thread CPU time per
backward comes with it.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem
from tandem.examples.gpt_model import GPT, GPTConfig

DDP_ROWS = ("bare", "torch-ddp", "tandem-ddp", "tandem-reducer")
FSDP_ROWS = ("torch-fsdp", "tandem-fsdp")


def build(name: str, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.width // 64,
                    n_embd=args.width, activation_checkpointing=False)
    model: nn.Module = GPT(cfg).cuda()
    if name == "torch-ddp":
        model = TorchDDP(model, device_ids=[0])
    elif name.startswith("tandem-ddp") or name.startswith("tandem-reducer"):
        model = tandem.DistributedDataParallel(model, device_ids=[0],
                                               gradient_as_bucket_view=name.endswith("-view"))
        if name.startswith("tandem-reducer"):
            model._make_reducer()
    elif name in FSDP_ROWS:
        if name == "torch-fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            kwargs: dict[str, Any] = {"mesh": init_device_mesh("cuda", (1,))}
        else:
            from tandem.fsdp import MixedPrecisionPolicy, fully_shard
            kwargs = {"min_unit_bytes": 0}
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def make_step(name: str, model: nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace
              ) -> Callable[[], None]:
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=g)
    target = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=g)
    autocast = name not in FSDP_ROWS

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens)
        F.cross_entropy(logits.float().view(-1, args.vocab), target.view(-1)).backward()
        opt.step()
    return step


def peak_bytes(name: str, args: argparse.Namespace) -> int:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model, opt = build(name, args)
    step = make_step(name, model, opt, args)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del model, opt, step
    gc.collect()
    return peak


def count_syncs(step: Callable[[], None]) -> int:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(3):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in seen)


def timed_rounds(steps: dict[str, Callable[[], None]], args: argparse.Namespace
                 ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    names = list(steps)
    for name in names:
        for _ in range(args.warmup):
            steps[name]()
    torch.cuda.synchronize()
    per_step: dict[str, list[float]] = {n: [] for n in names}
    host: dict[str, list[float]] = {n: [] for n in names}  # the Python thread's CPU per step
    collections = GcTime()
    gc.callbacks.append(collections)
    try:
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                torch.cuda.synchronize()
                collections.owner = name
                start, cpu = time.perf_counter(), time.thread_time()
                for _ in range(args.steps):
                    steps[name]()
                host[name].append((time.thread_time() - cpu) / args.steps)
                torch.cuda.synchronize()
                per_step[name].append((time.perf_counter() - start) / args.steps)
                collections.owner = None
    finally:
        gc.callbacks.remove(collections)
    total = args.rounds * args.steps
    print("Python's garbage collector during the timed blocks, per step (ms; full collections in all): "
          + "; ".join(f"{n} {collections.seconds.get(n, 0.0) / total * 1e3:.3f} ({collections.full.get(n, 0)})"
                      for n in names) + "\n")
    return per_step, host


class GcTime:
    """A gc callback that sums collection time (any thread) by the contender being timed."""

    def __init__(self) -> None:
        self.owner: str | None = None
        self.seconds: dict[str, float] = {}
        self.full: dict[str, int] = {}
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if self.owner is None:
            return
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.seconds[self.owner] = self.seconds.get(self.owner, 0.0) + time.perf_counter() - self._started
        if info.get("generation") == 2:
            self.full[self.owner] = self.full.get(self.owner, 0) + 1


def profile(name: str, step: Callable[[], None], steps: int = 5) -> str:
    """Time by operator and kernel over ``steps`` steps (torch.profiler); the
    table's last line, "Self CUDA time total", is the GPU's kernel and copy time
    over those steps: against the wall time it shows how long the GPU idled."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    table = events.table(sort_by=key, row_limit=14, max_name_column_width=60)
    return f"### {name}: {wall * 1e3:.2f} ms/step under the profiler, {steps} steps\n\n```\n{table}\n```\n"


def host_profile(name: str, model: nn.Module, step: Callable[[], None], steps: int = 20,
                 main: int | None = None) -> str:
    """cProfile of the autograd engine's thread over ``steps`` backwards (see the module's docstring)."""
    prof = cProfile.Profile()
    state = {"on": False, "cpu": 0.0, "started": 0.0, "backwards": 0}
    main = threading.get_ident() if main is None else main  # on CPU backward runs on the caller's thread

    def stop() -> None:
        prof.disable()
        state["cpu"] += time.thread_time() - state["started"]
        state["backwards"] += 1
        state["on"] = False

    def start(_: torch.Tensor) -> None:
        if state["on"] or threading.get_ident() == main:
            return
        state["on"] = True
        state["started"] = time.thread_time()
        torch.autograd.Variable._execution_engine.queue_callback(stop)
        prof.enable()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    handles = [p.register_post_accumulate_grad_hook(start) for p in model.parameters() if p.requires_grad]
    try:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(20)
    per = state["cpu"] / max(1, state["backwards"]) * 1e3
    return (f"### {name}: the autograd thread, {state['backwards']} backwards, {per:.2f} ms of its CPU per "
            f"backward from its first parameter hook\n\n```\n{out.getvalue()}\n```\n")


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def table(per_step: dict[str, list[float]], host: dict[str, list[float]], baseline: str,
          peaks: dict[str, int], syncs: dict[str, int]) -> str:
    lines = [f"| contender | ms/step [q1..q3] | / {baseline} [q1..q3] | host CPU ms/step | peak memory "
             "| syncs/step |", "| --- | --- | --- | --- | --- | --- |"]
    for name, times in per_step.items():
        ms = [t * 1e3 for t in times]
        q1, q3 = quartiles(ms)
        ratios = [a / b for a, b in zip(times, per_step[baseline])]
        r1, r3 = quartiles(ratios)
        lines.append(f"| {name} | {statistics.median(ms):.2f} [{q1:.2f}..{q3:.2f}] | "
                     f"{statistics.median(ratios):.3f} [{r1:.3f}..{r3:.3f}] | "
                     f"{statistics.median(host[name]) * 1e3:.2f} | "
                     f"{peaks[name] / 2**30:.2f} GiB | {syncs[name] / 3:g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768, help="n_embd, a multiple of 64")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--only", choices=("ddp", "fsdp"), default=None)
    parser.add_argument("--ddp-rows", default=",".join(DDP_ROWS), metavar="NAMES",
                        help="the DDP table's contenders (also: tandem-reducer-view, the reducer with "
                             "gradient_as_bucket_view=True)")
    parser.add_argument("--profile", default="", metavar="NAMES",
                        help="comma-separated contenders to profile after the tables (torch.profiler)")
    parser.add_argument("--host-profile", default="", metavar="NAMES",
                        help="comma-separated contenders whose autograd thread to profile (cProfile)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA device")
    world = tandem.init()
    try:
        props = torch.cuda.get_device_properties(0)
        print(f"{props.name}, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, CUDA "
              f"{torch.version.cuda}, Python {sys.version.split()[0]}; backend {world.backend}, world 1; "
              f"GPT {args.layers} layers x {args.width}, vocab {args.vocab}, batch {args.batch} x "
              f"{args.seq} tokens; {args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up\n")
        groups = []
        if args.only in (None, "ddp"):
            groups.append(("DDP, bf16 autocast", tuple(args.ddp_rows.split(",")), "bare"))
        if args.only in (None, "fsdp"):
            groups.append(("fully_shard, bf16 parameters", FSDP_ROWS, "torch-fsdp"))
        for title, rows, baseline in groups:
            started = time.perf_counter()
            peaks = {name: peak_bytes(name, args) for name in rows}
            built = {name: build(name, args) for name in rows}
            steps = {name: make_step(name, *built[name], args) for name in rows}
            syncs = {name: count_syncs(steps[name]) for name in rows}
            per_step, host = timed_rounds(steps, args)
            print(f"## {title} ({time.perf_counter() - started:.0f} s)\n")
            print(table(per_step, host, baseline, peaks, syncs) + "\n", flush=True)
            for name in (n for n in args.profile.split(",") if n in rows):
                print(profile(name, steps[name]), flush=True)
            for name in (n for n in args.host_profile.split(",") if n in rows):
                print(host_profile(name, built[name][0], steps[name]), flush=True)
            del built, steps
            gc.collect()
            torch.cuda.empty_cache()
    finally:
        tandem.shutdown()


if __name__ == "__main__":
    main()
