"""tandem's fully_shard against torch's FSDP2 at fake worlds of 8 and 64, one
rank in this process (tandem.testing.fake_world: torch's fake process group,
whose collectives return at once; shards, gathered units and kernels are real).

On the same meta-built GPT sharded the same way (each block, then the root):
every parameter's local shard has FSDP2's shape, at rank 0 and at the last
rank (which holds short or empty chunks); a training step runs under
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` with and without
``CPUOffloadPolicy`` and activation checkpointing, leaving each rank's
gradients and AdamW state as FSDP2 leaves them, 1/N of the model's (and on
CUDA the offloaded shards and gradients pinned, as FSDP2 pins them); and the peak memory of
building the model and two steps is at most FSDP2's and ``tandem plan``
predicts it within 10% (on CPU a smaller GPT, measured from the profiler's
allocation events, without the offloaded variant, which changes nothing
there). The values computed are meaningless (a fake all-gather leaves its
output as it was), so nothing here compares values.

Each test opens its own fake group and destroys it. Parametrised by device:
the GPU lane runs the CUDA cases with ``-k cuda``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandem.examples.gpt_model import GPT, GPTConfig
from tandem.testing import as_dtensor, fake_world
from tandem.testing.memory import PeakMemory
from tandem.tools.plan import plan

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
WORLDS = [8, 64]
IMPLS = ["torch", "tandem"]
VARIANTS = ["plain", "offload", "ac"]

# Uneven on purpose: at 64 ranks a width of 96 leaves ranks 48-63 without rows
# of the norms and biases, and 200 vocabulary rows leave ranks 50-63 without any.
TINY = GPTConfig(vocab_size=200, block_size=16, n_layer=2, n_head=2, n_embd=96, activation_checkpointing=False)
BATCH = 2
# For the peak: activations, gathered units and reductions each a visible share.
SMALL = GPTConfig(vocab_size=8192, block_size=512, n_layer=4, n_head=8, n_embd=512, activation_checkpointing=False)
# The same on CPU, smaller (bf16 matmuls are slow there), with the same proportions as
# benchmarks/bench_fake_world.py's 1.4B GPT: the blocks hold most parameters (86%).
CPU_SMALL = GPTConfig(vocab_size=1024, block_size=64, n_layer=4, n_head=4, n_embd=128,
                      activation_checkpointing=False)
PEAK_MODELS = {"cpu": CPU_SMALL, "cuda": SMALL}


def _sharded(impl: str, cfg: GPTConfig, world: int, device: str, variant: str = "plain") -> nn.Module:
    """``cfg``'s GPT built on meta, sharded by ``impl`` (each block, then the
    root) over the fake world, given memory and its shards initialised."""
    from torch.distributed.device_mesh import init_device_mesh

    if impl == "torch":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
        from torch.distributed.fsdp import fully_shard as shard
    else:
        from tandem.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
        from tandem.fsdp import fully_shard as tandem_shard
        shard = functools.partial(tandem_shard, min_unit_bytes=0)
    kwargs: dict[str, Any] = {
        "mesh": init_device_mesh(device, (world,)),
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if variant == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device == "cuda")
    with torch.device("meta"):
        model = GPT(dataclasses.replace(cfg, activation_checkpointing=variant == "ac"))
    for block in model.blocks:
        shard(block, **kwargs)
    shard(model, **kwargs)
    model.to_empty(device="cpu" if variant == "offload" else device)
    with torch.no_grad():
        for p in model.parameters():
            as_dtensor(p).to_local().normal_(0.0, 0.02)
    return model


def _batch(cfg: GPTConfig, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    return tuple(torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size), device=device, generator=g)
                 for _ in range(2))  # type: ignore[return-value]


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def _stepper(model: nn.Module, cfg: GPTConfig, device: str) -> tuple[Callable[[], torch.Tensor], Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, target = _batch(cfg, device)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        logits = model(tokens)
        _loss(logits, target).backward()
        opt.step()
        return logits
    return step, opt


def _local_shapes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
    return {n: (tuple(as_dtensor(p).to_local().shape), str(as_dtensor(p).placements))
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("last_rank", [False, True], ids=["rank0", "last"])
def test_local_shards_have_fsdp2_shapes(device: str, world: int, last_rank: bool) -> None:
    with fake_world(world, rank=world - 1 if last_rank else 0):
        theirs = _local_shapes(_sharded("torch", TINY, world, device))
        ours = _local_shapes(_sharded("tandem", TINY, world, device))
    assert list(ours) == list(theirs)
    different = {n: (ours[n], theirs[n]) for n in ours if ours[n] != theirs[n]}
    assert not different, f"rank {world - 1 if last_rank else 0} of {world}: (tandem, FSDP2) differ: {different}"
    if last_rank and world == 64:  # the case that the uneven shapes are for
        assert ours["blocks.0.ln_1.weight"][0] == (0,) and ours["wte.weight"][0] == (0, 96)


def _rank0_rows(shape: torch.Size, world: int) -> int:
    """Elements of rank 0's dim-0 chunk: ``torch.chunk``'s ceil(rows / world) rows."""
    return -(-shape[0] // world) * (shape.numel() // shape[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_step_leaves_gradients_and_state_as_fsdp2(device: str, world: int, variant: str) -> None:
    shard_device = torch.device("cpu") if variant == "offload" else torch.device(device)
    found = {}
    with fake_world(world):
        for impl in IMPLS:
            model = _sharded(impl, TINY, world, device, variant)
            step, opt = _stepper(model, TINY, device)
            logits = step()
            assert logits.dtype == torch.bfloat16 and logits.shape == (BATCH, TINY.block_size, TINY.vocab_size)
            if variant == "offload" and device == "cuda":  # so that each gather's copy in is asynchronous
                unpinned = [n for n, p in model.named_parameters() if not as_dtensor(p).to_local().is_pinned()]
                assert not unpinned, f"{impl}: offloaded shards not in pinned memory: {unpinned}"
            grads = {}
            for n, p in model.named_parameters():
                assert p.grad is not None, f"{impl}: '{n}' has no gradient after the step"
                g = as_dtensor(p.grad).to_local()
                assert g.dtype == torch.float32 and g.device.type == shard_device.type, (impl, n, g.dtype, g.device)
                grads[n] = tuple(g.shape)
                # copied to the host asynchronously (Note [gradients to the host] in tandem/fsdp/unit.py)
                if variant == "offload" and device == "cuda":
                    assert g.is_pinned(), f"{impl}: the offloaded gradient of '{n}' is not in pinned memory"
            state = sum(as_dtensor(t).to_local().numel() * t.element_size() for s in opt.state.values()
                        for t in s.values() if isinstance(t, torch.Tensor) and t.dim())
            found[impl] = grads, state
    assert found["tandem"][0] == found["torch"][0]
    assert found["tandem"][1] == found["torch"][1]
    # 1/N of the model's state: AdamW's two fp32 moments of rank 0's chunks, at most one row
    # per parameter above an even split.
    params = list(GPT(TINY).parameters())
    expected = 8 * sum(_rank0_rows(p.shape, world) for p in params)
    assert found["tandem"][1] == expected
    assert expected <= 8 * (sum(p.numel() for p in params) / world + sum(p[0].numel() for p in params))


def _peak(impl: str, variant: str, world: int, device: str) -> int:
    """Bytes held at most over building ``impl``'s model and two steps, beyond
    what was held before (on CPU: the profiler's allocation events)."""
    cfg = PEAK_MODELS[device]
    if device == "cuda":
        torch.cuda.empty_cache()
    with PeakMemory(device) as mem:
        model = _sharded(impl, cfg, world, device, variant)
        step, _ = _stepper(model, cfg, device)
        step()
        step()
    return mem.peak


class PeakCache:
    """tandem's measured peak per case, measured once for the two tests that compare
    it (with FSDP2's, with the plan's): a CPU measurement replays the profiler's
    allocation events, seconds a case, and gives the same bytes each time."""

    def __init__(self) -> None:
        self._bytes: dict[tuple[str, int, str], int] = {}

    def tandem(self, variant: str, world: int, device: str) -> int:
        key = (variant, world, device)
        if key not in self._bytes:
            self._bytes[key] = _peak("tandem", variant, world, device)
        return self._bytes[key]


@pytest.fixture(scope="module")
def peaks() -> PeakCache:
    return PeakCache()


# On CPU, CPUOffloadPolicy changes nothing (the shards are on the host already).
PEAK_CASES = [pytest.param("cpu", v, id=f"{v}-cpu") for v in VARIANTS if v != "offload"] + [
    pytest.param("cuda", v, marks=needs_cuda, id=f"{v}-cuda") for v in VARIANTS]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(("device", "variant"), PEAK_CASES)
def test_peak_memory_at_most_fsdp2(peaks: PeakCache, device: str, variant: str, world: int) -> None:
    with fake_world(world):
        theirs, ours = _peak("torch", variant, world, device), peaks.tandem(variant, world, device)
    assert ours <= theirs, f"world {world}, {variant}: tandem's peak {ours:,} B > FSDP2's {theirs:,} B"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(("device", "variant"), PEAK_CASES)
def test_plan_predicts_the_peak_within_10_percent(peaks: PeakCache, device: str, variant: str, world: int) -> None:
    cfg = PEAK_MODELS[device]
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    report = plan(model, world_size=world, sample=_batch(cfg, device), loss_fn=_loss, optimizer="adamw",
                  min_unit_bytes=0, activation_checkpointing=variant == "ac", param_dtype=torch.bfloat16,
                  reduce_dtype=torch.float32, cpu_offload=variant == "offload")
    predicted = next(s for s in report.strategies if s.name == "fully_shard").peak
    del model
    with fake_world(world):
        measured = peaks.tandem(variant, world, device)
    assert abs(predicted - measured) <= 0.1 * measured, (
        f"world {world}, {variant}: tandem plan predicts {predicted:,} B, measured {measured:,} B "
        f"({(predicted - measured) / measured:+.1%})")
