"""fully_shard (ZeRO-3) against torch's FSDP2 and DDP on gloo: step time and bytes held.

Run book::

    python benchmarks/bench_fsdp.py                      # 2 ranks, the defaults (about 2 minutes on 2 cores)
    python benchmarks/bench_fsdp.py --width 768 --depth 8 --rounds 15
    python benchmarks/bench_fsdp.py --profile 10         # + cProfile of 10 steps of each FSDP, rank 0
    python benchmarks/bench_fsdp.py --compile            # + both FSDPs with each block compiled
    python benchmarks/bench_fsdp.py --world-size 4 --contenders tandem-fsdp,torch-fsdp

Launches its own ranks (tandem.testing.run_distributed: gloo, one intra-op
thread per rank). Contenders, all with AdamW on the same model and batches: an
input projection, ``depth`` residual blocks (LayerNorm, Linear(d, 4d), GELU,
Linear(4d, d)), a final LayerNorm and a Linear head:

    tandem-fsdp            tandem.fsdp.fully_shard on each block, then on the model;
                           min_unit_bytes=0 (the same units as torch)
    torch-fsdp             torch.distributed.fsdp.fully_shard, the same calls
    tandem-fsdp-noreshard  tandem-fsdp with reshard_after_forward=False everywhere
    torch-fsdp-noreshard   torch-fsdp with reshard_after_forward=False everywhere
    ddp                    tandem.DistributedDataParallel
    torch-ddp              torch's DistributedDataParallel

and with ``--compile``, each block compiled with ``torch.compile`` (inductor)
before it is sharded, as torchtitan does with torch's FSDP2:

    tandem-fsdp+compile    tandem-fsdp over the compiled blocks
    torch-fsdp+compile     torch-fsdp over the compiled blocks

(each compiles in one untimed step when it is built, before the warm-up).

A step is zero_grad(set_to_none=True), forward, MSE loss, backward,
clip_grad_norm_(model.parameters(), 1.0), optimizer step. Steps run in
interleaved rounds: every contender runs one block of steps per round, starting
on a barrier, and the order rotates from round to round, so that a noisy
neighbour hits all alike. Times are rank 0's clock: the median over rounds of
each block's mean step, with the quartiles over rounds in brackets; "vs
torch" is the median over rounds of tandem's block over its torch
counterpart's block in the same round (quartiles in brackets), then the ratio
of the two medians.

Bytes are counted from the tensors each rank holds after a step, not computed;
a storage shared by several views counts once, a sharded parameter counts its
local tensor's storage: parameters = the registered parameters, plus
tandem-fsdp's unsharded unit buffers and torch-fsdp's all-gather outputs and
unsharded parameters (all freed after backward: 0 bytes when working);
gradients = ``param.grad``'s storages, plus tandem DDP's flat bucket buffer;
optimizer state = every tensor in AdamW's state. torch's DDP keeps its bucket
buffers inside C++, which are not counted.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from bench_ddp import name_list, profile_steps  # the sibling script, on sys.path when run
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem
from tandem.fsdp import fully_shard as tandem_fully_shard
from tandem.fsdp.unit import unit_of
from tandem.testing import run_distributed

CONTENDERS = ("tandem-fsdp", "torch-fsdp", "tandem-fsdp-noreshard", "torch-fsdp-noreshard",
              "ddp", "torch-ddp")
COMPILED = ("tandem-fsdp+compile", "torch-fsdp+compile")  # with --compile
COUNTERPART = {"tandem-fsdp": "torch-fsdp", "tandem-fsdp-noreshard": "torch-fsdp-noreshard",
               "ddp": "torch-ddp", "tandem-fsdp+compile": "torch-fsdp+compile"}
BASELINE = {"tandem-fsdp": "ddp", "tandem-fsdp-noreshard": "ddp", "ddp": "ddp",
            "torch-fsdp": "torch-ddp", "torch-fsdp-noreshard": "torch-ddp", "torch-ddp": "torch-ddp",
            "tandem-fsdp+compile": "ddp", "torch-fsdp+compile": "torch-ddp"}


def contenders(args: argparse.Namespace) -> tuple[str, ...]:
    """The contenders to run, in CONTENDERS order: ``--contenders`` if given, else all."""
    names = CONTENDERS + COMPILED if args.compile else CONTENDERS
    return tuple(n for n in names if n in args.contenders) if args.contenders else names


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def build(args: argparse.Namespace, rank: int) -> tuple[Net, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Net(args.width, args.depth)
    gen = torch.Generator().manual_seed(1000 + rank)
    # Tokens as rows: the blocks mix no positions, and a 2-D output is no view
    # (torch's FSDP2 warns about a root that returns one).
    shape = (args.batch * args.seq, args.width)
    return model, torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def wrap(name: str, model: Net, mesh: Any) -> nn.Module:
    """``model`` as contender ``name`` runs it."""
    if name == "ddp":
        return tandem.DistributedDataParallel(model)
    if name == "torch-ddp":
        return TorchDDP(model)
    reshard = not name.endswith("-noreshard")
    # each block, before it is sharded (Note [fully_shard under torch.compile] in tandem/fsdp/schedule.py)
    if name.endswith("+compile"):
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block)
    if name.startswith("tandem"):
        shard = functools.partial(tandem_fully_shard, mesh=mesh, reshard_after_forward=reshard,
                                  min_unit_bytes=0)
    else:
        shard = functools.partial(torch_fully_shard, mesh=mesh, reshard_after_forward=reshard)
    for block in model.layers:
        shard(block)
    return shard(model)


def contender(name: str, args: argparse.Namespace, rank: int, mesh: Any
              ) -> tuple[Callable[[], None], Callable[[], dict]]:
    model, x, y = build(args, rank)
    wrapped = wrap(name, model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(wrapped(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    if name.endswith("+compile"):
        step()  # compiles, outside the clock (every rank: the step communicates)

    def holdings() -> dict:
        params = list(model.parameters()) + _unsharded_buffers(model)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if isinstance(wrapped, tandem.DistributedDataParallel):
            grads += [*wrapped.reducer.buffer.flat.values(), *wrapped.reducer.buffer.solo.values()]
        state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        return {"params": _storage_bytes(params), "grads": _storage_bytes(grads),
                "optimizer": _storage_bytes(state)}

    return step, holdings


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor: its local tensor)."""
    storages = {}
    for t in tensors:
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _unsharded_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The full-parameter buffers an FSDP keeps beside the registered parameters
    (torch's through its private per-module state: a benchmark may look inside)."""
    found: list[torch.Tensor] = []
    for m in model.modules():
        unit = unit_of(m)
        if unit is not None and unit.modules[0] is m:
            found.append(unit.params.unsharded_flat)
        group = m._get_fsdp_state()._fsdp_param_group if hasattr(m, "_get_fsdp_state") else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            found += list(fsdp_param.all_gather_outputs)
            if hasattr(fsdp_param, "_unsharded_param"):
                found.append(fsdp_param._unsharded_param)
    return found


def bench_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.distributed.barrier()
    names = contenders(args)
    runs = {name: contender(name, args, rank, mesh) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for step, _ in runs.values():
        for _ in range(args.warmup):
            step()
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            step = runs[name][0]
            torch.distributed.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - start) / args.steps)
    result = {"times": times, "bytes": {name: h() for name, (_, h) in runs.items()}}
    if args.profile:
        result["profile"] = {name: profile_steps(runs[name][0], args.profile, rank)
                             for name in ("tandem-fsdp", "torch-fsdp") if name in runs}
    return result


def vs_torch(times: dict[str, list[float]], name: str) -> dict[str, Any]:
    """Contender ``name`` against its torch counterpart (COUNTERPART), from their
    per-round mean step times: the median of the per-round ratios, their quartiles
    (None with fewer than 2 rounds), and the ratio of the two medians."""
    per_round = [a / b for a, b in zip(times[name], times[COUNTERPART[name]])]
    return {"per_round": statistics.median(per_round), "quartiles": quartiles(per_round),
            "of_medians": statistics.median(times[name]) / statistics.median(times[COUNTERPART[name]])}


def format_table(results: list[dict[str, Any]]) -> str:
    times = results[0]["times"]  # every contender that ran, in CONTENDERS order
    rows = [("| contender | step ms, median [quartiles] | vs torch: per round [quartiles]; of medians "
             "| vs its DDP | parameters | gradients | optimizer state | total |"),
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in times:
        t = statistics.median(times[name])
        ratio = ""
        if COUNTERPART.get(name) in times:
            r = vs_torch(times, name)
            ratio = f"**{r['per_round']:.2f}** {_bracket(r['quartiles'], '.2f')}; {r['of_medians']:.2f}"
        baseline = f"{t / statistics.median(times[BASELINE[name]]):.2f}x" if BASELINE[name] in times else ""
        held = [r["bytes"][name] for r in results]
        cells = [per_rank([h[k] for h in held]) for k in ("params", "grads", "optimizer")]
        total = per_rank([sum(h.values()) for h in held])
        rows.append(f"| {name} | {t * 1e3:.1f} {_bracket(quartiles([x * 1e3 for x in times[name]]), '.1f')} "
                    f"| {ratio} | {baseline} | {' | '.join(cells)} | {total} |")
    return "\n".join(rows)


def quartiles(values: list[float]) -> tuple[float, float] | None:
    """First and third quartiles, None with fewer than 2 values."""
    if len(values) < 2:
        return None
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q1, q3


def _bracket(q: tuple[float, float] | None, fmt: str) -> str:
    return "" if q is None else f"[{q[0]:{fmt}}-{q[1]:{fmt}}]"


def per_rank(values: list[int]) -> str:
    """One figure when every rank holds the same (to the figure shown), else rank 0's / rank 1's / ..."""
    shown = [_mib(v) for v in values]
    return shown[0] if len(set(shown)) == 1 else " / ".join(shown)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def build_parser() -> argparse.ArgumentParser:
    """The command line, also what bench_scale.py builds this script's settings with."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after measuring, cProfile N steps of tandem-fsdp and torch-fsdp on rank 0")
    parser.add_argument("--compile", action="store_true",
                        help="also time both FSDPs with each block compiled (torch.compile, before sharding)")
    parser.add_argument("--contenders", type=name_list(CONTENDERS + COMPILED), default=(),
                        help="comma-separated subset to run, e.g. tandem-fsdp,torch-fsdp (default all; "
                             "with --compile the compiled ones are named too)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not contenders(args):
        parser.error("--contenders names only compiled contenders: add --compile")
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    results = run_distributed(bench_rank, args.world_size, args=(args,), timeout=3600)
    numel = sum(p.numel() for p in Net(args.width, args.depth).parameters())
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.world_size} ranks (gloo, 1 thread each); "
          f"{args.depth} blocks of width {args.width} ({numel / 1e6:.2f}M parameters, "
          f"{numel * 4 / 2**20:.1f} MiB), batch {args.batch} x seq {args.seq} per rank; "
          f"{args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up; ran "
          f"{time.perf_counter() - started:.0f} s; 1-min load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after\n")
    print(format_table(results))
    if len(results) > 1:
        print("\nbytes: one figure where every rank holds the same, else rank 0 / rank 1 / ...")
    for name, text in results[0].get("profile", {}).items():
        print(f"\n## cProfile, {name} (rank 0)\n\n{text}")


if __name__ == "__main__":
    main()
