"""tandem's fully_shard against torch's FSDP2 at fake worlds of 8 and 64 on one
GPU: per-rank peak memory and step time of a 1.4-billion-parameter GPT built on
meta, and ``tandem plan``'s predicted peak beside the measured one.

Run book (a machine with one CUDA GPU; about 2.5 minutes on an H100)::

    python benchmarks/bench_fake_world.py                             # worlds 8 and 64, every variant
    python benchmarks/bench_fake_world.py --world 64 --variants offload --rounds 8
    python benchmarks/bench_fake_world.py --device cpu --layers 2 --width 128 --vocab 512 --seq 64 \\
        --world 8,64 --rounds 2                                       # a dry run on CPU, seconds

One process is rank 0 of a world of N under torch's fake process group
(tandem.testing.fake_world): collectives return at once and leave their
outputs as they were, everything else is real: the shards of 1/N, each unit's
gathered buffers, the copies, the host's work and the kernels. So the numbers
are one rank's memory and compute at world N with free communication; the
values the model computes are meaningless.

The model is the GPT example's (tandem/examples/gpt_model.py; the defaults: 24
layers x 2048, vocab 50304, about 1.42 billion parameters, 5.7 GB in fp32),
built on the meta device and sharded the same way for both contenders:
``fully_shard`` on each block, then on the model, over
``init_device_mesh(device, (N,))``, with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; then
``to_empty`` (onto the host under CPUOffloadPolicy, as torchtitan does) and each
rank's shards initialised where they live (normal(0, 0.02) weights, zero biases,
unit norms; not the example's ``init_weights()``, which draws every full
parameter on the host, seconds per build at this size, for values a fake
all-gather does not carry anyway). Contenders:

    torch-fsdp      torch.distributed.fsdp.fully_shard
    tandem-fsdp     tandem.fsdp.fully_shard, the same calls (min_unit_bytes=0)

Variants (--variants): ``plain``; ``offload``: CPUOffloadPolicy() on both
(shards, gradients and the optimizer step on the host); ``ac``: activation
checkpointing of each block, the example's own (GPTConfig's
activation_checkpointing: non-reentrant torch.utils.checkpoint inside
``Block.forward``), the same model for both.

A step: zero_grad(set_to_none=True), forward, cross-entropy of the logits in
fp32, backward, AdamW's step (torch's default implementation for the device)
on batch x seq tokens of random ids.

Time: the two contenders of a configuration run in interleaved rounds (a block
of --steps steps each, order alternating, the device synchronised around each
block): the median over rounds of each block's mean step, [q1..q3] over rounds,
and tandem/torch as the median of the per-round ratios [q1..q3]; host CPU is
the Python thread's CPU time per step. Peak memory: each contender is built
while the other (if built) holds only its state between steps, and its peak is
torch.cuda.max_memory_allocated over its build and first two steps minus what
was allocated before it was built (tandem.testing.memory.PeakMemory; on CPU
the profiler's allocation events, which under CPUOffloadPolicy count the
host's shards too, which the plan leaves out).

Under the fake group a collective never reports itself completed
(``is_completed()`` stays False), so a reduce-scatter stays in flight until
the next unit's launch finishes it, as one launched on NCCL ahead of the GPU
does; tandem then keeps one input buffer alive, as FSDP2 does (Note
[reductions in flight] in tandem/fsdp/schedule.py). Plan: ``tandem.tools.plan.plan``
on the unsharded model with one rank's batch, ``param_dtype``,
``reduce_dtype``, ``cpu_offload`` and ``activation_checkpointing`` as the
variant has them: the fully_shard row's peak (the largest phase of the
measured step: Note [stage 3 peak] in tandem/planner/memory/phases.py), and its
error against each contender's measured peak.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.examples.gpt_model import GPT, GPTConfig
from tandem.testing import fake_world
from tandem.testing.memory import PeakMemory
from tandem.tools.plan import plan

CONTENDERS = ("torch-fsdp", "tandem-fsdp")
VARIANTS = ("plain", "offload", "ac")
Step = Callable[[], None]


def gpt(args: argparse.Namespace, checkpointed: bool) -> GPT:
    """The unsharded model, on the meta device."""
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.width // 64,
                    n_embd=args.width, activation_checkpointing=checkpointed)
    with torch.device("meta"):
        return GPT(cfg)


@torch.no_grad()
def init_shards(model: nn.Module) -> None:
    """Each rank's shard of every parameter, initialised where it lives."""
    for module in model.modules():
        for leaf, p in module.named_parameters(recurse=False):
            local = p.to_local() if hasattr(p, "to_local") else p
            if isinstance(module, nn.LayerNorm):
                local.fill_(1.0 if leaf == "weight" else 0.0)
            elif leaf == "bias":
                local.zero_()
            else:
                local.normal_(0.0, 0.02)


def build(name: str, variant: str, world: int, args: argparse.Namespace) -> tuple[nn.Module, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    if name == "torch-fsdp":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        kwargs: dict[str, Any] = {}
    else:
        from tandem.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        kwargs = {"min_unit_bytes": 0}
    kwargs["mesh"] = init_device_mesh(args.device, (world,))
    kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if variant == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=args.device == "cuda")  # pinning needs CUDA
    model = gpt(args, checkpointed=variant == "ac")
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    model.to_empty(device="cpu" if variant == "offload" else args.device)
    init_shards(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=args.device).manual_seed(1)
    return tuple(torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device, generator=g)
                 for _ in range(2))  # type: ignore[return-value]


def loss_of(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def make_step(model: nn.Module, opt: Any, args: argparse.Namespace) -> Step:
    tokens, target = batch(args)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_of(model(tokens), target).backward()
        opt.step()
    return step


def sync(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def built_alone(name: str, variant: str, world: int, args: argparse.Namespace) -> tuple[Step, int]:
    """The contender built and its first two steps run; the most bytes held
    over both beyond what was held before."""
    if args.device == "cuda":
        torch.cuda.empty_cache()
    with PeakMemory(args.device) as mem:
        model, opt = build(name, variant, world, args)
        step = make_step(model, opt, args)
        step()
        step()
    return step, mem.peak


def planned_peak(variant: str, world: int, args: argparse.Namespace) -> int:
    """``tandem plan``'s peak per rank for fully_shard in this configuration."""
    model = gpt(args, checkpointed=False)  # the plan checkpoints the blocks itself
    model.to_empty(device=args.device)
    init_shards(model)
    report = plan(model, world_size=world, sample=batch(args), loss_fn=loss_of, optimizer="adamw",
                  min_unit_bytes=0, activation_checkpointing=variant == "ac", param_dtype=torch.bfloat16,
                  reduce_dtype=torch.float32, cpu_offload=variant == "offload")
    del model
    return next(s for s in report.strategies if s.name == "fully_shard").peak


def timed_rounds(steps: dict[str, Step], args: argparse.Namespace
                 ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    names = list(steps)
    for name in names:
        for _ in range(args.warmup):
            steps[name]()
    per_step: dict[str, list[float]] = {n: [] for n in names}
    host: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % 2:] + names[:r % 2]:
            sync(args)
            start, cpu = time.perf_counter(), time.thread_time()
            for _ in range(args.steps):
                steps[name]()
            host[name].append((time.thread_time() - cpu) / args.steps)
            sync(args)
            per_step[name].append((time.perf_counter() - start) / args.steps)
    return per_step, host


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


HEADER = ("| world | variant | contender | ms/step [q1..q3] | / torch-fsdp [q1..q3] | host CPU ms/step | peak "
          "| plan peak | plan error |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def run_config(world: int, variant: str, args: argparse.Namespace) -> list[str]:
    """One configuration's rows: the plan, each contender built alone, then both timed."""
    predicted = planned_peak(variant, world, args)
    gc.collect()
    steps, peaks = {}, {}
    for name in CONTENDERS:
        steps[name], peaks[name] = built_alone(name, variant, world, args)
    per_step, host = timed_rounds(steps, args)
    rows = []
    for name in CONTENDERS:
        ms = [t * 1e3 for t in per_step[name]]
        q1, q3 = quartiles(ms)
        ratios = [a / b for a, b in zip(per_step[name], per_step["torch-fsdp"])]
        r1, r3 = quartiles(ratios)
        error = (predicted - peaks[name]) / peaks[name] * 100 if peaks[name] else float("nan")
        rows.append(f"| {world} | {variant} | {name} | {statistics.median(ms):.1f} [{q1:.1f}..{q3:.1f}] | "
                    f"{statistics.median(ratios):.3f} [{r1:.3f}..{r3:.3f}] | "
                    f"{statistics.median(host[name]) * 1e3:.1f} | {gib(peaks[name])} | {gib(predicted)} | "
                    f"{error:+.1f}% |")
    return rows


def describe_device(args: argparse.Namespace) -> str:
    versions = f"torch {torch.__version__}, Python {sys.version.split()[0]}"
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB; {versions}, CUDA {torch.version.cuda}"
    return f"CPU, {torch.get_num_threads()} threads; {versions}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", default="8,64", help="comma-separated fake world sizes")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048, help="n_embd, a multiple of 64")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=2, help="steps of each before timing (after its first two)")
    parser.add_argument("--steps", type=int, default=3, help="steps per block")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.world.split(",") if w]
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)} (choose from {', '.join(VARIANTS)})")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("bench_fake_world.py: no CUDA device; --device cpu runs it on the CPU (a small model)")
        torch.cuda.set_device(0)
    params = sum(p.numel() for p in gpt(args, checkpointed=False).parameters())
    print(f"{describe_device(args)}\nGPT {args.layers} layers x {args.width}, vocab {args.vocab}: {params / 1e9:.3f}B "
          f"parameters; batch {args.batch} x {args.seq} tokens per rank; bf16 parameters, fp32 reduction; "
          f"{args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up\n")
    print(HEADER, flush=True)
    started = time.perf_counter()
    for world in worlds:
        with fake_world(world):
            for variant in variants:
                try:
                    rows = run_config(world, variant, args)
                except Exception as e:  # one configuration's failure must not lose the others
                    rows = [f"| {world} | {variant} | failed | {type(e).__name__}: {str(e)[:200]} |"]
                print("\n".join(rows), flush=True)
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
