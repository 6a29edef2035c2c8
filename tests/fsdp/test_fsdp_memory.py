"""The stage-3 memory planner (tandem.zero.estimate_memory with a FullyShardSpec):
pure grids of shapes and world sizes in one process, then its prediction against
the bytes each rank of a fully_shard model holds, at 2 and 3 ranks."""

from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass, field

import pytest
import torch
from test_fsdp import _distinct_bytes, tandem_units
from torch import nn

from tandem.fsdp import MixedPrecisionPolicy, fully_shard, plan_unit
from tandem.planner.memory import StepActivity, stage3_peak
from tandem.testing import as_dtensor, run_distributed
from tandem.zero import FullyShardSpec, MemoryEstimate, estimate_memory, format_memory_table


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class Shapes(nn.Module):
    """Parameters of the given shapes, nothing else."""

    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes)


def _random_model(rng: random.Random) -> tuple[nn.Module, list[list[tuple[int, ...]]]]:
    """A root with a few parameters of its own and blocks of uneven shapes; the
    shapes per unit (root first)."""
    def shapes() -> list[tuple[int, ...]]:
        return [(rng.randint(1, 9), *[rng.randint(1, 5) for _ in range(rng.randint(0, 2))])
                for _ in range(rng.randint(1, 4))]
    blocks = [shapes() for _ in range(rng.randint(1, 4))]
    root = shapes()
    model = nn.Module()
    model.blocks = nn.ModuleList(Shapes(s) for s in blocks)
    model.own = Shapes(root)
    return model, [root, *blocks]


# ---------------------------------------------------------------------- pure grids

@pytest.mark.parametrize("seed", range(40))
def test_stage3_bytes_follow_the_dim0_chunks(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.randint(1, 4)
    model, unit_shapes = _random_model(rng)
    names = tuple(f"blocks.{i}" for i in range(len(unit_shapes) - 1))
    s3 = estimate_memory(model, world, fsdp=FullyShardSpec(units=names, min_unit_bytes=0))[3]
    assert [u.name for u in s3.units] == ["", *names]
    chunks = [[_ceil(s[0], world) * _numel(s[1:]) for s in shapes] for shapes in unit_shapes]
    assert s3.params == 4 * sum(map(sum, chunks))
    assert s3.optimizer == 8 * sum(map(sum, chunks))   # rank 0 holds full chunks
    # the sharded gradients are copied out of the reduce-scatter input, without the flags
    assert s3.grads == 4 * sum(map(sum, chunks))
    for u, c, shapes in zip(s3.units, chunks, unit_shapes):
        assert u.layout.shard_numel == sum(c) and u.layout.unsharded_numel == world * sum(c)
        assert [p.shape for p in u.layout.params] == shapes
    full = [world * 4 * sum(c) for c in chunks]
    # the root, one block, one gather: its own, or the next block's (forward
    # prefetch) or the previous one's (backward); the root prefetches the first
    # block in forward and the last in backward
    assert s3.gathered == max(full[0] + max(full[0], full[1], full[-1]),
                              *(full[0] + f + max(full[max(k - 1, 1):k + 2]) for k, f in enumerate(full) if k))
    # two reductions in flight (their inputs, flags included; the output is a chunk of
    # it), plus a unit's full gradients and the root's (which encloses it and waits
    # for its own last gradient)
    reduce_buffers = sorted(world * 4 * (sum(c) + len(c)) for c in chunks)
    full_grads = [4 * sum(map(_numel, s)) for s in unit_shapes]
    assert s3.reducing == sum(reduce_buffers[-2:]) + full_grads[0] + max([0, *full_grads[1:]])


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_frozen_parameters_are_sharded_but_have_no_state(world: int) -> None:
    model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
    model[0].requires_grad_(False)
    s3 = estimate_memory(model, world, fsdp=FullyShardSpec(units=("0", "1"), min_unit_bytes=0))[3]
    chunk = {name: _ceil(p.shape[0], world) * p[0].numel() for name, p in model.named_parameters()}
    assert s3.params == 4 * sum(chunk.values())
    assert s3.optimizer == 8 * (chunk["1.weight"] + chunk["1.bias"])
    assert s3.grads == 4 * (chunk["1.weight"] + chunk["1.bias"])   # unit "0" is never reduced


def test_mixed_precision_sizes() -> None:
    model = nn.Sequential(nn.Linear(6, 10), nn.Linear(10, 10))
    units = ("0", "1")
    fp32 = estimate_memory(model, 3, fsdp=FullyShardSpec(units=units, min_unit_bytes=0))[3]
    bf16 = estimate_memory(model, 3, fsdp=FullyShardSpec(units=units, min_unit_bytes=0, param_dtype=torch.bfloat16,
                                                         reduce_dtype=torch.float32))[3]
    low = estimate_memory(model, 3, fsdp=FullyShardSpec(units=units, min_unit_bytes=0,
                                                        param_dtype=torch.bfloat16))[3]
    assert bf16.params == fp32.params and bf16.optimizer == fp32.optimizer  # shards stay fp32
    shard = sum(u.layout.shard_numel for u in fp32.units)
    assert bf16.grads == fp32.grads == low.grads == 4 * shard   # fp32 shards of the gradients, however reduced
    # half-size gathers: the bf16 copy of the shard is written into the all-gather's output
    assert bf16.gathered == fp32.gathered // 2


def test_cpu_offload_moves_the_steady_state_to_the_host() -> None:
    model = nn.Sequential(nn.Linear(6, 10), nn.Linear(10, 10))
    spec = functools.partial(FullyShardSpec, units=("0", "1"), min_unit_bytes=0, param_dtype=torch.bfloat16,
                             reduce_dtype=torch.float32)
    kept = estimate_memory(model, 3, fsdp=spec())[3]
    offloaded = estimate_memory(model, 3, fsdp=spec(cpu_offload=True))[3]
    assert offloaded.params == offloaded.grads == offloaded.optimizer == 0
    assert offloaded.host == kept.params + kept.grads + kept.optimizer and kept.host == 0
    assert offloaded.reducing == kept.reducing and offloaded.gathered == kept.gathered
    fp32 = functools.partial(FullyShardSpec, units=("0", "1"), min_unit_bytes=0)
    # the shard on the host is copied into the all-gather's output, as a cast is
    assert (estimate_memory(model, 3, fsdp=fp32(cpu_offload=True))[3].gathered
            == estimate_memory(model, 3, fsdp=fp32())[3].gathered)
    with pytest.raises(ValueError, match="FullyShardSpec.cpu_offload must be a bool, got 1"):
        FullyShardSpec(cpu_offload=1)  # type: ignore[arg-type]


def test_the_phased_peak_takes_the_largest_phase_of_a_step() -> None:
    model = nn.Module()
    model.embed = nn.Linear(8, 16)
    model.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
    names = tuple(f"blocks.{i}" for i in range(3))
    spec = FullyShardSpec(units=names, min_unit_bytes=0)
    s3 = estimate_memory(model, 2, fsdp=spec)[3]
    step = StepActivity(before=100, after=1000, blocks=tuple((n, 5000, 400) for n in names), outputs=300)
    root_full = 2 * 4 * s3.units[0].layout.shard_numel
    state = s3.params + s3.optimizer
    # the loss: everything saved, the root gathered, the outputs and the loss's own gradients
    big_loss = dataclasses.replace(step, loss=10**6)
    assert stage3_peak(s3, spec, big_loss, 8) == state + root_full + 100 + 1000 + 3 * 5000 + 300 + 10**6
    # checkpointed: the blocks keep their inputs, and one recomputes its forward
    plain = stage3_peak(s3, spec, step, 8)
    ckpt = stage3_peak(s3, spec, dataclasses.replace(step, checkpointed=True), 8)
    assert ckpt < plain
    # offloaded: the state and the sharded gradients stay on the host
    offloaded = FullyShardSpec(units=names, min_unit_bytes=0, cpu_offload=True)
    assert stage3_peak(estimate_memory(model, 2, fsdp=offloaded)[3], offloaded, step, 8) <= plain - state
    # never above stage 3's upper bound with the activations
    assert plain <= s3.peak(100 + 1000 + 3 * 5000 + 300)


def test_tiny_units_merge_into_the_enclosing_call() -> None:
    model = nn.Module()
    model.embed = nn.Linear(4, 64)                                        # 1280 bytes
    model.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64)) for _ in range(2))
    names = ("embed", "blocks.0.0", "blocks.0", "blocks.1.0", "blocks.1")
    spec = FullyShardSpec(units=names, min_unit_bytes=1024)
    units = estimate_memory(model, 2, fsdp=spec)[3].units
    # the norms (512 bytes) join their blocks; embed stays (nothing but the root encloses
    # it, and it is big enough); the root's own unit is empty
    assert [(u.name, u.merged) for u in units] == [("", ()), ("embed", ()), ("blocks.0", ("blocks.0.0",)),
                                                    ("blocks.1", ("blocks.1.0",))]
    big = FullyShardSpec(units=names, min_unit_bytes=1 << 20)
    (root,) = estimate_memory(model, 2, fsdp=big)[3].units
    assert root.name == "" and sorted(root.merged) == sorted(names)
    assert root.layout.numel == sum(p.numel() for p in model.parameters())


def test_keeping_units_after_forward_holds_them_all() -> None:
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    units = tuple(str(i) for i in range(4))
    kept = estimate_memory(model, 2, fsdp=FullyShardSpec(units=units, reshard_after_forward=False,
                                                         min_unit_bytes=0))[3]
    freed = estimate_memory(model, 2, fsdp=FullyShardSpec(units=units, min_unit_bytes=0))[3]
    full = 2 * 4 * kept.units[1].layout.shard_numel
    assert kept.gathered == 5 * full and freed.gathered == 2 * full   # the root is empty here
    assert (kept.params, kept.grads, kept.optimizer) == (freed.params, freed.grads, freed.optimizer)


def test_nested_units_count_their_enclosing_units() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Linear(8, 8))
    s3 = estimate_memory(model, 2, fsdp=FullyShardSpec(units=("0", "0.0", "0.1", "1"), min_unit_bytes=0))[3]
    assert [u.name for u in s3.units] == ["", "0", "0.0", "0.1", "1"] and s3.units[1].layout.numel == 0
    full = 2 * 4 * s3.units[2].layout.shard_numel
    assert s3.gathered == 2 * full  # "0" gathers nothing: one Linear and one gather at a time


def test_default_is_one_unit_and_the_table_names_it() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    estimates = estimate_memory(model, 2)
    assert [u.name for u in estimates[3].units] == [""]
    assert estimates[3].gathered == 2 * 2 * estimates[3].params   # the whole model, gathered and copied out
    table = format_memory_table(estimates, 2)
    assert "gathered" in table and "reducing" in table and "1 fully_shard units" in table
    assert all(isinstance(e, MemoryEstimate) for e in estimates)


def test_bad_specs_name_the_field_and_the_value() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"'layers.0'.*submodules of Sequential"):
        estimate_memory(model, 2, fsdp=FullyShardSpec(units=("layers.0",)))
    with pytest.raises(ValueError, match="FullyShardSpec.min_unit_bytes.*-1"):
        FullyShardSpec(min_unit_bytes=-1)
    with pytest.raises(ValueError, match="FullyShardSpec.param_dtype.*torch.int64"):
        FullyShardSpec(param_dtype=torch.int64)
    with pytest.raises(ValueError, match="FullyShardSpec.reshard_after_forward.*2"):
        FullyShardSpec(reshard_after_forward=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="optimizer_bytes_per_param"):
        estimate_memory(model, 2, optimizer_bytes_per_param=-4)


def test_what_fully_shard_rejects_is_rejected() -> None:
    tied = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match=r"'1.weight'.*unit '0'"):
        estimate_memory(tied, 2, fsdp=FullyShardSpec(units=("0", "1"), min_unit_bytes=0))
    estimate_memory(tied, 2, fsdp=FullyShardSpec(units=(), min_unit_bytes=0))  # both in the root: fine
    mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double())
    with pytest.raises(ValueError, match="mix parameter dtypes"):
        estimate_memory(mixed, 2)
    estimate_memory(mixed, 2, fsdp=FullyShardSpec(units=("1",), min_unit_bytes=0))


# ---------------------------------------------------------------------- measured

class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 3 * d + 1)   # odd rows: padded chunks at 2 and 3 ranks
        self.out = nn.Linear(3 * d + 1, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.fc(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int = 13, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


BLOCKS = tuple(f"blocks.{i}" for i in range(3))
NORMS = tuple(f"blocks.{i}.norm" for i in range(3))
SPECS = {
    "fp32": FullyShardSpec(units=BLOCKS, min_unit_bytes=0),
    "bf16": FullyShardSpec(units=BLOCKS, min_unit_bytes=0, param_dtype=torch.bfloat16,
                           reduce_dtype=torch.float32),
    "kept": FullyShardSpec(units=BLOCKS, min_unit_bytes=0, reshard_after_forward=False),
    "merged": FullyShardSpec(units=NORMS + BLOCKS, min_unit_bytes=1024),   # norms (104 B) join their blocks
}


@dataclass
class Measured:
    predicted: MemoryEstimate
    optimizer_expected: int                  # this rank's optimizer state by its own layout
    units: list[tuple[str, int]]             # (name, shard elements) of the units fully_shard built
    planned: list[tuple[str, int]]
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    gathered_forward: int = 0                # peak sampled at the units' forward hooks
    gathered: int = 0                        # peak over forward and backward samples
    reducing: int = 0                        # peak of gradients in flight, backward samples
    samples: list[tuple[str, int, int]] = field(default_factory=list)


def _measure(rank: int, world_size: int, spec: FullyShardSpec) -> Measured:
    torch.manual_seed(0)
    model = Net()
    predicted = estimate_memory(model, world_size, fsdp=spec)[3]
    kwargs: dict = {"min_unit_bytes": spec.min_unit_bytes}
    if spec.param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=spec.param_dtype, reduce_dtype=spec.reduce_dtype)
    for name in spec.units:  # NORMS first: bottom-up
        fully_shard(model.get_submodule(name), reshard_after_forward=spec.reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)
    modules = [m for m in model.modules() if hasattr(m, "_tandem_fsdp_unit")]
    units = tandem_units(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = Measured(predicted, 0, [], [(u.name, u.layout.shard_numel) for u in predicted.units])

    # What each unit holds beyond its shard, read through the runtime's own fields.
    def sample(tag: str, forward: bool) -> None:
        gathered = sum(u.params.unsharded_flat.untyped_storage().nbytes() for u in units)
        for u in units:
            g = u.pending_gather
            if g is not None and not g.direct:   # the input: the shard itself, or a chunk of the output
                shard = u.params.shard_flat.untyped_storage().data_ptr()
                gathered += _distinct_bytes(t for t in (g.output, g.input) if t.untyped_storage().data_ptr() != shard)
        reducing = _distinct_bytes(t for r in (u.pending_reduce for u in units) if r is not None
                                   for t in (r.input, r.output))
        reducing += _distinct_bytes(m.unsharded.grad for u in units for m in u.params.managed
                                    if m.unsharded.grad is not None)
        out.samples.append((tag, gathered, reducing))
        out.gathered = max(out.gathered, gathered)
        out.reducing = max(out.reducing, reducing)
        if forward:
            out.gathered_forward = max(out.gathered_forward, gathered)

    for m in modules:
        # after fully_shard's pre-hook (gathered, next unit prefetched), before its post-hook
        m.register_forward_pre_hook(lambda *_: sample("pre-forward", True))
        m.register_forward_hook(lambda *_: sample("forward", True), prepend=True)
    for u in units:
        for m in u.params.managed:
            # registered before the first forward: runs before fully_shard's hook, which may reduce
            m.unsharded.register_post_accumulate_grad_hook(lambda *_: sample("grad", False))

    for step in range(2):  # the second forward prefetches
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(step * world_size + rank))
        model(x).square().mean().backward()
        opt.step()
        if step == 0:
            opt.zero_grad()

    out.units = [(u.name, u.params.layout.shard_numel) for u in units]
    out.params = _distinct_bytes(as_dtensor(p).to_local() for p in model.parameters())
    out.grads = _distinct_bytes(as_dtensor(p.grad).to_local() for p in model.parameters() if p.grad is not None)
    out.optimizer = _distinct_bytes(v.to_local() if hasattr(v, "to_local") else v
                                   for s in opt.state.values() for k, v in s.items() if k != "step")
    out.optimizer_expected = 8 * sum(
        p.local_numel for u in predicted.units
        for p, trains in zip(plan_unit([q.shape for q in u.layout.params], world_size, rank).params, u.trainable)
        if trains)
    return out


def _grid(rank: int, world_size: int) -> dict[str, Measured]:
    return {name: _measure(rank, world_size, spec) for name, spec in SPECS.items()}


@functools.cache
def _measured(world_size: int) -> list[dict[str, Measured]]:
    return run_distributed(_grid, world_size, timeout=120)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(SPECS))
def test_prediction_matches_what_each_rank_holds(world_size: int, name: str) -> None:
    for rank, result in enumerate(_measured(world_size)):
        got = result[name]
        p = got.predicted
        assert sorted(got.units) == sorted(((n or "<root>"), s) for n, s in got.planned), (rank, got.units)
        assert got.params == p.params, (rank, got.params, p.params)
        assert got.grads == p.grads, (rank, got.grads, p.grads)
        # rank 0 holds full chunks; a later rank's last chunks may be shorter (no padding in optimizer state)
        assert got.optimizer == got.optimizer_expected <= p.optimizer, (rank, got.optimizer, p.optimizer)
        if rank == 0:
            assert got.optimizer == p.optimizer
        # the transient peaks: upper bounds, within 2x of what was sampled
        assert got.gathered <= p.gathered <= 2 * got.gathered_forward, (rank, got.gathered, p.gathered)
        assert got.reducing <= p.reducing <= 2 * got.reducing, (rank, got.reducing, p.reducing)
