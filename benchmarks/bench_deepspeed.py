"""ZeRO against DeepSpeed, side by side on gloo: step time by phase, bytes per rank, equal parameters.

Run book::

    pip install deepspeed                                  # a benchmark dependency only (0.19 tested)
    python benchmarks/bench_deepspeed.py                   # both models, 2 ranks
    python benchmarks/bench_deepspeed.py --models mlp --rounds 5

DeepSpeed runs on the CPU (``DS_ACCELERATOR=cpu``) over the same gloo group as
tandem (``deepspeed.init_distributed`` takes the group the harness made); the
first run compiles one small op of DeepSpeed's with the system compiler.

Contenders, all fp32 with ``torch.optim.AdamW`` (lr 1e-3, weight decay 0.01) on
the same model, seed and batches, one intra-op thread per rank:

    torch-ddp  torch's DistributedDataParallel (the reference parameters)
    zero1      tandem DDP(zero_stage=1) + tandem.ZeroOptimizer(AdamW)
    zero2      tandem DDP(zero_stage=2) + tandem.ZeroOptimizer(AdamW)
    fsdp       tandem.fsdp.fully_shard on each block, then on the model
    ds1        deepspeed.initialize, zero_optimization.stage 1
    ds2        stage 2
    ds3        stage 3

DeepSpeed's bucket sizes (``reduce_bucket_size``, ``allgather_bucket_size``,
``stage3_prefetch_bucket_size``) are set to tandem's bucket cap, 25 MiB of fp32
elements, and its other settings are its defaults; its own default buckets are
500M elements, which it reserves whole for stage 3 (2 GB, mostly never touched).

Models: ``mlp``, bench_zero.py's (4 x Linear(1024, 1024), 4.2M parameters,
batch 16 per rank), and ``resmlp``, bench_fsdp.py's residual MLP (width 512, 4
blocks of LayerNorm, Linear(512, 2048), GELU, Linear(2048, 512), 8.9M
parameters, 256 rows per rank).

Time: a step is forward (and the MSE loss), backward (tandem: ``loss.backward()``;
DeepSpeed: ``engine.backward(loss)``, which also finishes its reductions) and
step (tandem: ``optimizer.step()``, ``zero_grad(set_to_none=True)``; DeepSpeed:
``engine.step()``, which zeroes too). Steps run in interleaved rounds: every
contender runs a block of steps per round, starting on a barrier, the order
rotating from round to round. Each phase: the median over rounds of the block's
mean, rank 0's clock, quartiles over rounds in brackets.

Equal: after the timed rounds every contender has taken the same steps on the
same batches; its full parameters are compared with torch-ddp's (the largest
absolute difference).

Bytes: each contender alone in a spawned group of its own (so that no other
contender's tensors are counted), after two steps:

    parameters   the storages of the model's parameters (sharded: this rank's shard)
    optimizer    every tensor in AdamW's state
    masters      the copies of parameters a ZeRO optimizer steps (tandem's
                 shard masters; DeepSpeed's fp32 partitions)
    gradients    every other tensor alive: gradients, gradient shards and buffers,
                 found by the garbage collector (so tensors held only in C++, as
                 torch's DDP buckets, are not counted)
    held         the sum, between steps
    peak         held plus the largest rise of allocated bytes within one step,
                 from torch.profiler's allocation events (the calling thread's)
    RSS          the process's peak resident set (ru_maxrss) less its resident
                 set before the model was built
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import resource
import statistics
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_ddp import name_list  # noqa: E402  (the sibling script, on sys.path when run)
from bench_fsdp import Net, per_rank  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import tandem  # noqa: E402
from tandem.fsdp import fully_shard  # noqa: E402
from tandem.testing import run_distributed  # noqa: E402

CONTENDERS = ("torch-ddp", "zero1", "zero2", "fsdp", "ds1", "ds2", "ds3")
COUNTERPART = {"zero1": "ds1", "zero2": "ds2", "fsdp": "ds3"}
PHASES = ("forward", "backward", "step")
BUCKET_ELEMENTS = 25 * 2**20 // 4  # tandem's bucket cap, 25 MiB, in fp32 elements
LR, WEIGHT_DECAY = 1e-3, 0.01


def build(model: str, rank: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if model == "mlp":
        net: nn.Module = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())][:-1])
        rows, width = 16, 1024
    else:
        net, rows, width = Net(512, 4), 256, 512
    gen = torch.Generator().manual_seed(1000 + rank)
    return net, torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen)


def units(net: nn.Module) -> list[nn.Module]:
    """The modules fully_shard wraps before the root: the residual blocks, or the Linears."""
    layers = getattr(net, "layers", None)
    return list(layers) if layers is not None else [m for m in net if isinstance(m, nn.Linear)]


class Contender:
    """One way to train ``model``: its three phases, what it holds, its full parameters."""

    def __init__(self, name: str, model: str, rank: int) -> None:
        self.name = name
        self.net, self.x, self.y = build(model, rank)
        self.engine: Any = None
        self.masters: Callable[[], list[torch.Tensor]] = list
        if name.startswith("ds"):
            import deepspeed
            config = {"train_micro_batch_size_per_gpu": self.x.shape[0], "gradient_accumulation_steps": 1,
                      "zero_allow_untested_optimizer": True,
                      "zero_optimization": {"stage": int(name[-1]), "reduce_bucket_size": BUCKET_ELEMENTS,
                                            "allgather_bucket_size": BUCKET_ELEMENTS,
                                            "stage3_prefetch_bucket_size": BUCKET_ELEMENTS}}
            opt = torch.optim.AdamW(self.net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            self.engine, self.opt, _, _ = deepspeed.initialize(model=self.net, optimizer=opt, config=config)
            self.wrapped: Any = self.engine
            inner = self.engine.optimizer
            self.inner_state = lambda: inner.optimizer.state
            if name == "ds3":
                self.masters = lambda: list(inner.fp32_partitioned_groups_flat)
            else:
                self.masters = lambda: list(inner.single_partition_of_fp32_groups)
            return
        if name == "torch-ddp":
            self.wrapped = TorchDDP(self.net)
            self.opt = torch.optim.AdamW(self.net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            self.inner_state = lambda: self.opt.state
        elif name == "fsdp":
            for unit in units(self.net):
                fully_shard(unit, min_unit_bytes=0)
            self.wrapped = fully_shard(self.net)
            self.opt = torch.optim.AdamW(self.net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            self.inner_state = lambda: self.opt.state
        else:
            self.wrapped = tandem.DistributedDataParallel(self.net, zero_stage=int(name[-1]))
            self.opt = tandem.ZeroOptimizer(self.wrapped, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
            self.inner_state = lambda: self.opt.optim.state
            self.masters = lambda: list(self.opt.shards.masters)

    def forward(self) -> torch.Tensor:
        return F.mse_loss(self.wrapped(self.x), self.y)

    def backward(self, loss: torch.Tensor) -> None:
        if self.engine is not None:
            self.engine.backward(loss)
        else:
            loss.backward()

    def step(self) -> None:
        if self.engine is not None:
            self.engine.step()
        else:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def train_step(self) -> None:
        self.step_after(self.forward())

    def step_after(self, loss: torch.Tensor) -> None:
        self.backward(loss)
        self.step()

    def params(self) -> list[torch.Tensor]:
        """The local storage of every parameter (a shard where sharded)."""
        found = []
        for p in self.net.parameters():
            if isinstance(p, DTensor):
                found.append(p.to_local())
            elif hasattr(p, "ds_tensor"):
                found.append(p.ds_tensor)
            found.append(p)
        return found

    def full_params(self) -> torch.Tensor:
        """Every parameter, whole and flattened, in the model's order (a collective under sharding)."""
        params = list(self.net.parameters())
        if self.name == "ds3":
            import deepspeed
            with deepspeed.zero.GatheredParameters(params):
                return torch.cat([p.detach().reshape(-1).clone() for p in params])
        full = [p.full_tensor() if isinstance(p, DTensor) else p for p in params]
        if hasattr(self.opt, "finish_param_gather"):
            self.opt.finish_param_gather()
        return torch.cat([p.detach().reshape(-1) for p in full])

    def holdings(self) -> dict[str, int]:
        """Bytes this rank holds, by kind (see the module's docstring); counts the whole process."""
        gc.collect()
        seen: dict[int, int] = {}

        def claim(tensors: Iterable[torch.Tensor]) -> int:
            total = 0
            for ptr, nbytes in _storages(tensors):
                if ptr not in seen:
                    seen[ptr] = nbytes
                    total += nbytes
            return total

        held = {"params": claim(self.params()),
                "optimizer": claim(t for s in self.inner_state().values() for t in s.values() if torch.is_tensor(t)),
                "masters": claim(self.masters())}
        held["inputs"] = claim([self.x, self.y])
        held["gradients"] = claim(o for o in gc.get_objects() if isinstance(o, torch.Tensor))
        held.pop("inputs")
        held["held"] = sum(held.values())
        return held


def _storages(tensors: Iterable[torch.Tensor]) -> Iterable[tuple[int, int]]:
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if type(t) not in (torch.Tensor, nn.Parameter) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            yield storage.data_ptr(), storage.nbytes()


def _quiet() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _init(world_size: int) -> None:
    _quiet()
    torch.set_num_threads(1)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")  # the harness's group
    deepspeed.utils.logger.setLevel(logging.ERROR)
    init_device_mesh("cpu", (world_size,))


def time_rank(rank: int, world_size: int, args: argparse.Namespace, model: str) -> dict[str, Any]:
    _init(world_size)
    names = args.contenders
    runs = {name: Contender(name, model, rank) for name in names}
    for c in runs.values():
        for _ in range(args.warmup):
            c.train_step()
    times: dict[str, dict[str, list[float]]] = {n: {p: [] for p in PHASES} for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            c = runs[name]
            spent = dict.fromkeys(PHASES, 0.0)
            torch.distributed.barrier()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                loss = c.forward()
                t1 = time.perf_counter()
                c.backward(loss)
                t2 = time.perf_counter()
                c.step()
                t3 = time.perf_counter()
                for phase, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
                    spent[phase] += dt
            for phase in PHASES:
                times[name][phase].append(spent[phase] / args.steps)
    reference = runs["torch-ddp"].full_params() if "torch-ddp" in runs else None
    diffs = {}
    for name, c in runs.items():
        full = c.full_params()
        diffs[name] = None if reference is None else float((full - reference).abs().max())
    return {"times": times, "diffs": diffs}


def memory_rank(rank: int, world_size: int, name: str, model: str) -> dict[str, Any]:
    _init(world_size)
    rss_before = _rss_bytes()
    c = Contender(name, model, rank)
    for _ in range(2):
        c.train_step()
    held = c.holdings()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("measured step"):
            c.train_step()
    held["peak"] = held["held"] + _largest_rise(prof)
    held["rss"] = peak_rss
    return held


def _largest_rise(prof: Any) -> int:
    """The largest rise of allocated bytes over the measured step, from the profiler's events."""
    events = prof.profiler.kineto_results.events()
    window = next(e for e in events if e.name() == "measured step")
    start, end = window.start_ns(), window.start_ns() + window.duration_ns()
    running = rise = 0
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        if start <= e.start_ns() <= end:
            running += e.nbytes()
            rise = max(rise, running)
    return rise


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def time_table(result: dict[str, Any]) -> str:
    times, diffs = result["times"], result["diffs"]
    rows = ["| contender | forward ms | backward ms | step ms | total ms | vs DeepSpeed "
            "| max abs diff vs torch-ddp |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, phases in times.items():
        cells = [f"{statistics.median(phases[p]) * 1e3:.1f} {_bracket(phases[p])}" for p in PHASES]
        totals = [sum(x) for x in zip(*phases.values())]
        versus = ""
        other = COUNTERPART.get(name)
        if other in times:
            theirs = [sum(x) for x in zip(*times[other].values())]
            per_round = [a / b for a, b in zip(totals, theirs)]
            versus = f"{statistics.median(per_round):.2f}x {_bracket(per_round, scale=1, fmt='.2f')}"
        diff = "" if diffs[name] is None else f"{diffs[name]:.1e}" if diffs[name] else "0.0"
        rows.append(f"| {name} | {' | '.join(cells)} | {statistics.median(totals) * 1e3:.1f} "
                    f"{_bracket(totals)} | {versus} | {diff} |")
    return "\n".join(rows)


def memory_table(held: dict[str, list[dict[str, int]]]) -> str:
    kinds = ("params", "optimizer", "masters", "gradients", "held", "peak", "rss")
    rows = ["| contender | parameters | optimizer | masters | gradients & buffers | held | peak in a step "
            "| RSS growth |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, ranks in held.items():
        cells = [per_rank([h[k] for h in ranks]) for k in kinds]
        rows.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(rows)


def _bracket(values: list[float], scale: float = 1e3, fmt: str = ".1f") -> str:
    if len(values) < 2:
        return ""
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"[{q1 * scale:{fmt}}-{q3 * scale:{fmt}}]"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--models", type=name_list(("mlp", "resmlp")), default=("mlp", "resmlp"))
    parser.add_argument("--contenders", type=name_list(CONTENDERS), default=CONTENDERS)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-memory", action="store_true", help="time only")
    args = parser.parse_args(argv)
    args.contenders = tuple(n for n in CONTENDERS if n in args.contenders)
    import deepspeed
    print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, {os.cpu_count()} CPUs, "
          f"{args.world_size} ranks (gloo, 1 thread each); {args.rounds} rounds x {args.steps} steps "
          f"after {args.warmup} warm-up")
    for model in args.models:
        numel = sum(p.numel() for p in build(model, 0)[0].parameters())
        load = os.getloadavg()[0]
        started = time.perf_counter()
        result = run_distributed(time_rank, args.world_size, args=(args, model), timeout=3600)[0]
        print(f"\n## {model}: {numel / 1e6:.2f}M parameters ({numel * 4 / 2**20:.1f} MiB); timed in "
              f"{time.perf_counter() - started:.0f} s, 1-min load {load:.1f} before, {os.getloadavg()[0]:.1f} after\n")
        print(time_table(result))
        if args.no_memory:
            continue
        held = {name: run_distributed(memory_rank, args.world_size, args=(name, model), timeout=600)
                for name in args.contenders}
        print("\nbytes per rank (one figure where every rank holds the same, else rank 0 / rank 1):\n")
        print(memory_table(held))


if __name__ == "__main__":
    main()
