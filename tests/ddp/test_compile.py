"""tandem under ``torch.compile`` (Note [torch.compile] in tandem/ddp/compile.py
and Note [fully_shard under torch.compile] in tandem/fsdp/schedule.py).

Compiled tandem DDP, outside the wrapper and inside it (and with no_sync
accumulation into bucket views, ZeRO-2, find_unused_parameters), trains to the
same parameters as eager tandem DDP and as torch's compiled DDP; fully_shard with
each block compiled, before or after sharding, as torch's FSDP2 with the same
compilation and as eager fully_shard. The model compiles into one graph
without a graph break, and DDP's bucket reductions are launched while the
compiled backward still runs: between the backward nodes of the pieces dynamo
split the graph into (a run with the split turned off is the control, where
they all wait for the end).

Compiling is slow on two cores: the models are tiny, every case but one
compiles with the "aot_eager" backend (dynamo and AOTAutograd, which decide the
graphs, the breaks and the backward nodes; no code generation), and one case
compiles with inductor, torch.compile's default. All cases run inside one
spawned group; dynamo is reset before each.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tandem
from tandem.fsdp import fully_shard
from tandem.testing import max_abs_diff, run_distributed
from tandem.testing.models import GPTBlock, TinyLM

TOL = 1e-6
VOCAB, SEQ, BATCH = 64, 8, 2  # BATCH sequences per rank


def gpt(dim: int, depth: int, heads: int = 2) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(VOCAB, dim, [GPTBlock(dim, heads) for _ in range(depth)])


def _compile(module: nn.Module, **options: Any) -> nn.Module:
    """torch.compile of a module: an OptimizedModule, which torch's stubs type as a callable."""
    return cast(nn.Module, torch.compile(module, **options))


# DDP: 3.2 MB of parameters, so that 1 MiB buckets (the smallest cap torch's
# compiled DDP accepts) make four; fully_shard: two small blocks.
DDP_MODEL = functools.partial(gpt, dim=128, depth=4)
SMALL_MODEL = functools.partial(gpt, dim=32, depth=2)


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def _loss(model: nn.Module, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), target.flatten())


@dataclass
class Outcome:
    params: dict[str, torch.Tensor]
    graph_breaks: int = 0
    graphs: int = 0                  # graphs dynamo captured (before DDP's split)
    pieces: int = 0                  # compiled backward nodes in the last step's graph
    timeline: list[str] = field(default_factory=list)  # the last step's backward
    error: str = ""                  # the traceback of a case that raised
    refusal: str = ""                # what the compiled autograd case was told


def _mark_compiled_backward(root: Any, timeline: list[str]) -> int:
    """A pre-hook on every compiled backward node reachable from ``root`` that
    writes ``compute`` to the timeline; returns how many there are."""
    seen, stack, found = set(), [root], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CompiledFunctionBackward":
            node.register_prehook(lambda *_: timeline.append("compute"))
            found += 1
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, *, steps: int = 3, micro: int = 1,
           clip: float | None = None, timeline: list[str] | None = None) -> int:
    """Train; returns the compiled backward nodes of the last step, whose
    backward writes to ``timeline``."""
    pieces = 0
    for step in range(steps):
        for m in range(micro):
            sync = m == micro - 1
            no_sync = getattr(model, "no_sync", None)  # a DDP, perhaps compiled
            ctx = no_sync() if not sync and no_sync is not None else contextlib.nullcontext()
            with ctx:
                loss = _loss(model, *_batch(step, m, rank)) / micro
                if step == steps - 1 and sync and timeline is not None:
                    timeline.clear()
                    pieces = _mark_compiled_backward(loss.grad_fn, timeline)
                loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return pieces


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameter values by name, without the prefixes that wrappers add."""
    out = {}
    for name, t in model.state_dict().items():
        name = name.replace("_orig_mod.", "").removeprefix("module.")
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
    return out


def _counted(run: Callable[[], Outcome]) -> Outcome:
    """``run()`` with dynamo reset, and what it counted; a case that raises is
    reported as its error (every rank raises alike), and the grid goes on."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    try:
        out = run()
    except Exception:
        return Outcome({}, error=traceback.format_exc())
    out.graph_breaks = sum(counters["graph_break"].values())
    out.graphs = counters["stats"]["unique_graphs"]
    return out


# ---------------------------------------------------------------------- DDP
@dataclass(frozen=True)
class DDPCase:
    impl: str = "tandem"          # or "torch"
    compile: str = "outer"        # "outer": torch.compile(DDP(model)); "inner": DDP(torch.compile(model)); "eager"
    backend: str = "aot_eager"
    split: bool = True            # torch._dynamo.config.optimize_ddp
    micro: int = 1                # micro-batches per step, all but the last under no_sync()
    ddp: tuple[tuple[str, Any], ...] = ()
    model: Callable[[], nn.Module] = DDP_MODEL


def _outcome(model: nn.Module, run: nn.Module, opt: torch.optim.Optimizer, rank: int, timeline: list[str],
             **train: Any) -> Outcome:
    """Train ``run`` (``model``, wrapped or compiled); ``model``'s parameters
    after, and the compiled pieces and collectives of the last step."""
    pieces = _train(run, opt, rank, timeline=timeline, **train)
    return Outcome(_full_params(model), pieces=pieces, timeline=timeline)


def _ddp_case(rank: int, case: DDPCase) -> Outcome:
    model = case.model()
    compiled = functools.partial(_compile, backend=case.backend)
    kwargs = {"bucket_cap_mb": 1, **dict(case.ddp)}
    wrap = tandem.DistributedDataParallel if case.impl == "tandem" else nn.parallel.DistributedDataParallel
    ddp = wrap(compiled(model) if case.compile == "inner" else model, **kwargs)
    timeline: list[str] = []
    if isinstance(ddp, tandem.DistributedDataParallel):
        ddp.comm.observers.append(lambda e: timeline.append(e.tag) if e.tag.startswith("bucket") else None)
    run = compiled(ddp) if case.compile == "outer" else ddp
    if dict(case.ddp).get("zero_stage"):
        opt: torch.optim.Optimizer = tandem.ZeroOptimizer(ddp, torch.optim.SGD, lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with torch._dynamo.config.patch(optimize_ddp=case.split):
        return _outcome(model, run, opt, rank, timeline, micro=case.micro)


DDP_CASES = {
    "eager": DDPCase(compile="eager"),
    "outer": DDPCase(),
    "inner": DDPCase(compile="inner"),
    "torch": DDPCase(impl="torch"),
    "unsplit": DDPCase(split=False),
    "eager_accumulate": DDPCase(compile="eager", micro=2, ddp=(("gradient_as_bucket_view", True),)),
    "accumulate": DDPCase(micro=2, ddp=(("gradient_as_bucket_view", True),)),
    "eager_zero": DDPCase(compile="eager", ddp=(("zero_stage", 2),)),
    "zero": DDPCase(ddp=(("zero_stage", 2),)),
    "eager_unused": DDPCase(compile="eager", ddp=(("find_unused_parameters", True),)),
    "unused": DDPCase(ddp=(("find_unused_parameters", True),)),
    "eager_small": DDPCase(compile="eager", model=SMALL_MODEL),
    "inductor": DDPCase(backend="inductor", model=SMALL_MODEL),
}


def _compiled_autograd(rank: int) -> Outcome:
    """Compiled autograd traces the backward's hooks: refused, naming what to do."""
    model = SMALL_MODEL()
    ddp = _compile(tandem.DistributedDataParallel(model), backend="aot_eager")

    def step() -> None:
        _loss(ddp, *_batch(0, 0, rank)).backward()

    try:
        with torch._dynamo.config.patch(compiled_autograd=True):
            torch.compile(step, backend="aot_eager")()
    except RuntimeError as e:
        return Outcome({}, refusal=str(e))
    return Outcome({})


# ---------------------------------------------------------------------- fully_shard
@dataclass(frozen=True)
class ShardCase:
    impl: str = "tandem"          # or "torch"
    compile: str = "before"       # each block: "before" or "after" fully_shard, or "eager"


def _shard_case(rank: int, world_size: int, case: ShardCase) -> Outcome:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = SMALL_MODEL()
    if case.impl == "tandem":
        shard = functools.partial(fully_shard, mesh=mesh, min_unit_bytes=0)
    else:
        shard = functools.partial(torch_fully_shard, mesh=mesh)
    # As torchtitan: fullgraph, so that a graph break inside a block is an error.
    compiled = functools.partial(_compile, backend="aot_eager", fullgraph=True)
    if case.compile == "before":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = compiled(block)
    for block in model.blocks:
        shard(block)
    shard(model)
    if case.compile == "after":
        for block in model.blocks:
            block.compile(backend="aot_eager", fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, rank, steps=1, clip=1.0)
    timeline: list[str] = []
    if case.impl == "tandem":  # the reduce-scatter group exists from the first step on
        units = [u for m in model.modules() if (u := getattr(m, "_tandem_fsdp_unit", None))]
        for comm in {id(u.reduce_comm): u.reduce_comm for u in units}.values():
            comm.observers.append(lambda e: timeline.append(e.tag) if e.op == "reduce_scatter" else None)
    return _outcome(model, model, opt, rank, timeline, steps=2, clip=1.0)


SHARD_CASES = {
    "shard_eager": ShardCase(compile="eager"),
    "shard_before": ShardCase(),
    "shard_after": ShardCase(compile="after"),
    "torch_shard_before": ShardCase(impl="torch"),
    "torch_shard_after": ShardCase(impl="torch", compile="after"),
}


# ---------------------------------------------------------------------- the group
def _grid(rank: int, world_size: int) -> dict[str, Outcome]:
    torch._inductor.config.compile_threads = 1  # no pool of compile workers on two cores
    results = {}
    for name, case in DDP_CASES.items():
        results[name] = _counted(functools.partial(_ddp_case, rank, case))
    for name, shard_case in SHARD_CASES.items():
        results[name] = _counted(functools.partial(_shard_case, rank, world_size, shard_case))
    if hasattr(torch._dynamo.config, "compiled_autograd"):
        results["compiled_autograd"] = _counted(functools.partial(_compiled_autograd, rank))
    dist.barrier()
    return results


@functools.cache
def _results() -> list[dict[str, Outcome]]:
    return run_distributed(_grid, 2, timeout=900)


def _get(results: dict[str, Outcome], name: str) -> Outcome:
    assert not results[name].error, f"case {name} raised:\n{results[name].error}"
    return results[name]


@pytest.mark.parametrize("name, reference", [
    ("outer", "eager"), ("inner", "eager"), ("unsplit", "eager"), ("outer", "torch"),
    ("accumulate", "eager_accumulate"), ("zero", "eager_zero"), ("unused", "eager_unused"),
    ("inductor", "eager_small"),
    ("shard_before", "shard_eager"), ("shard_after", "shard_eager"),
    ("shard_before", "torch_shard_before"), ("shard_after", "torch_shard_after"),
])
def test_compiled_equals_reference(name: str, reference: str) -> None:
    for rank, results in enumerate(_results()):
        diff = max_abs_diff(_get(results, name).params, _get(results, reference).params)
        assert diff <= TOL, f"rank {rank}: {name} vs {reference}: max abs diff {diff:.3g}"


@pytest.mark.parametrize("name", ["outer", "inner", "accumulate", "zero", "unused", "inductor",
                                  "shard_before", "shard_after"])
def test_the_model_is_one_graph_without_breaks(name: str) -> None:
    for results in _results():
        got = _get(results, name)
        assert got.graph_breaks == 0, name
        # One graph for the whole model under DDP; for fully_shard one for all
        # blocks (the same code, compiled once, every step).
        assert got.graphs == 1, (name, got.graphs)


@pytest.mark.parametrize("name", ["outer", "inner", "accumulate", "zero", "unused"])
def test_bucket_reductions_launch_during_the_compiled_backward(name: str) -> None:
    for results in _results():
        got = _get(results, name)
        assert got.pieces >= 3, got.pieces  # dynamo split the graph at buckets
        last_compute = len(got.timeline) - 1 - got.timeline[::-1].index("compute")
        early = [e for e in got.timeline[:last_compute] if e.startswith("bucket")]
        assert len(early) >= 2, got.timeline
        assert len([e for e in got.timeline if e.startswith("bucket")]) >= 3, got.timeline


def test_without_the_split_reductions_wait_for_the_end_of_backward() -> None:
    # The control of the test above: one compiled graph, one backward node.
    for results in _results():
        got = _get(results, "unsplit")
        assert got.pieces == 1
        assert got.timeline[0] == "compute" and got.timeline.count("compute") == 1, got.timeline


def test_per_block_reductions_launch_between_the_compiled_blocks() -> None:
    for results in _results():
        for name in ("shard_before", "shard_after"):
            got = _get(results, name)
            assert got.pieces == 2, (name, got.pieces)  # one backward node per compiled block
            assert got.timeline.count("unit blocks.1") == 1, got.timeline
            first_reduce = got.timeline.index("unit blocks.1")
            last_compute = len(got.timeline) - 1 - got.timeline[::-1].index("compute")
            assert first_reduce < last_compute, (name, got.timeline)


def test_compiled_autograd_is_refused_with_what_to_do() -> None:
    for results in _results():
        if "compiled_autograd" not in results:
            pytest.skip(f"torch {torch.__version__} has no torch._dynamo.config.compiled_autograd")
        got = _get(results, "compiled_autograd")
        assert "compiled autograd" in got.refusal and "torch.compile(model)" in got.refusal, got.refusal


# ------------------------------------------------- compiling a DDP built before dynamo was loaded
LATE_DYNAMO = """
import sys
import torch
import tandem


def train(compile_as):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = tandem.DistributedDataParallel(model)
    print("LOADED", "torch._dynamo" in sys.modules, "torch.distributed.tensor" in sys.modules, flush=True)
    compiled = torch.compile(ddp, backend="aot_eager") if compile_as == "torch.compile" else ddp
    if compile_as == "Module.compile":
        ddp.compile(backend="aot_eager")
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    losses = []
    for step in range(3):
        loss = compiled(torch.randn(8, 16, generator=g)).square().mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        losses.append(loss.item())
    return losses


tandem.init()
compiled = train(sys.argv[1 + torch.distributed.get_rank()])  # each rank compiles its own way
from torch._dynamo.utils import counters
print("BREAKS", sum(counters["graph_break"].values()), flush=True)
eager = train("eager")
# Compiled (aot_eager decomposes the ops) and eager are two computations: equal to float32 rounding.
print("SAME", all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(compiled, eager)) or (compiled, eager),
      flush=True)
tandem.shutdown()
"""


def test_a_ddp_built_before_dynamo_is_loaded_compiles_without_a_graph_break(tmp_path) -> None:
    """``import tandem`` and building a DDP load neither dynamo nor DTensor (1.5 s and
    more of each worker's start); compiled afterwards, by ``torch.compile(ddp)`` or
    ``ddp.compile()``, its forward is excluded as torch's decorator excludes it
    (``_compat.not_traced_forward``): no graph break, and the losses of an eager
    DDP trained after it in the same process."""
    import os
    import subprocess
    import sys

    path = tmp_path / "late.py"
    path.write_text(LATE_DYNAMO)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_",
                                                                     "TORCHELASTIC_", "TANDEM_JOB_SECRET"))}
    # Rank 0 compiles with torch.compile(ddp), rank 1 with ddp.compile(): both issue the same bucket
    # all-reduces, so one job tries both.
    r = subprocess.run([sys.executable, "-m", "tandem", "run", "--nproc-per-node", "2", str(path),
                        "torch.compile", "Module.compile"], capture_output=True, text=True, timeout=180, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"[rank {rank}]")]
        assert any("LOADED False False" in line for line in mine), r.stdout  # the compiled run's build
        assert any("BREAKS 0" in line for line in mine), (rank, r.stdout)
        assert any("SAME True" in line for line in mine), (rank, r.stdout)
