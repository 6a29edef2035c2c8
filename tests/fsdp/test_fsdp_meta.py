"""The meta-device recipe, end to end (Note [meta init] in tandem/fsdp/api.py,
Note [random init of shards] in tandem/fsdp/init.py).

Build the model under ``torch.device("meta")``, ``fully_shard`` every block and
the root, ``model.to_empty(device="cpu")``, then the model's own
``init_weights()`` (or ``reset_parameters()`` per module): with
``init_like_unsharded()`` the full parameters equal the same init done eagerly,
bit for bit, at 2 and 3 ranks, for tandem and for torch's FSDP2; without it
tandem draws what torch's FSDP2 draws (DTensor's rules, under which every
CPU rank's shard repeats the same numbers: shown, so that the Note stays true).
No rank allocates the full model on the way (peak bytes measured with the
profiler's allocation events, the eager build as the control). A dtype change
after sharding (``model.to(torch.float64)``, ``model.bfloat16()``) trains as
the eager model converted the same way, on the global batch, and as torch's
FSDP2; so does a cast between training steps. All cases run in one spawned
group per world size.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandem.fsdp import DEFAULT_MIN_UNIT_BYTES, fully_shard, init_like_unsharded
from tandem.fsdp.unit import unit_of
from tandem.testing import max_abs_diff, run_distributed
from tandem.testing.memory import PeakMemory
from tandem.testing.models import GPT

VOCAB, DIM, DEPTH, SEQ, BATCH = 32, 32, 6, 8, 2  # BATCH sequences per rank
INIT_SEED = 7


def _build() -> GPT:
    return GPT(VOCAB, DIM, DEPTH)


def _init_weights(model: nn.Module) -> None:
    model.init_weights()  # type: ignore[operator]


def _reset_parameters(model: nn.Module) -> None:
    """torchtitan's other habit: every module's own reset_parameters()."""
    for m in model.modules():
        reset = getattr(m, "reset_parameters", None)
        if reset is not None:
            reset()


INITS: dict[str, Callable[[nn.Module], None]] = {"init_weights": _init_weights,
                                                 "reset_parameters": _reset_parameters}


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _eager(init: str) -> nn.Module:
    model = _build()
    torch.manual_seed(INIT_SEED)
    INITS[init](model)
    return model


def _meta(impl: str, world_size: int, init: str, like_unsharded: bool = True,
          dtype: torch.dtype | None = None, min_unit_bytes: int = 0) -> nn.Module:
    """The recipe: meta build, fully_shard per block and root, to_empty, init
    (tandem: blocks under ``min_unit_bytes`` merge into the root's unit)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    shard: Any = (functools.partial(fully_shard, mesh=mesh, min_unit_bytes=min_unit_bytes) if impl == "tandem"
                  else functools.partial(torch_fully_shard, mesh=mesh))
    with torch.device("meta"):
        model = _build()
    for block in model.blocks:
        shard(block)
    shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(INIT_SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DTensor: "random operators may not have complete support on cpu"
        if like_unsharded:
            with init_like_unsharded():
                INITS[init](model)
        else:
            INITS[init](model)
    if dtype is not None:
        model.to(dtype)
    return model


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _global_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [_batch(step, r) for r in range(world_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _train(model: nn.Module, batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
           steps: int = 2) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        tokens, target = batches(step)
        logits = model(tokens).flatten(0, 1)
        F.cross_entropy(logits.float() if logits.dtype == torch.bfloat16 else logits, target.flatten()).backward()
        opt.step()
        opt.zero_grad()
    return _full(model)


def _model_bytes() -> int:
    with torch.device("meta"):
        model = _build()
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _grid(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for init in INITS:
        out[f"eager/{init}"] = _full(_eager(init))
        for impl in ("tandem", "torch"):
            out[f"{impl}/{init}"] = _full(_meta(impl, world_size, init))
            out[f"{impl}/{init}/dtensor_rules"] = _full(_meta(impl, world_size, init, like_unsharded=False))
    # tandem's default merges these tiny blocks into the root's unit (Note [tiny
    # units]): to_empty reaches a block's module before the unit's own module.
    merged = _meta("tandem", world_size, "init_weights", min_unit_bytes=DEFAULT_MIN_UNIT_BYTES)
    out["merged/units"] = len({id(u) for m in merged.modules() if (u := unit_of(m)) is not None})
    out["merged/init_weights"] = _full(merged)
    # Peaks: the recipe against the eager build (the control: it must see the whole model).
    with PeakMemory() as mem:
        model = _meta("tandem", world_size, "init_weights")
    out["peak/meta"] = mem.peak
    del model
    with PeakMemory() as mem:
        model = _eager("init_weights")
    out["peak/eager"] = mem.peak
    del model
    # A dtype change after sharding, then training: against the eager model
    # converted the same way, trained in one process on the global batch.
    for name, dtype in (("float64", torch.float64), ("bfloat16", torch.bfloat16)):
        eager = _eager("init_weights").to(dtype)
        out[f"train/{name}/eager"] = _train(eager, functools.partial(_global_batch, world_size=world_size))
        for impl in ("tandem", "torch"):
            model = _meta(impl, world_size, "init_weights", dtype=dtype)
            out[f"train/{name}/{impl}/dtypes"] = {str(p.dtype) for p in model.parameters()}
            out[f"train/{name}/{impl}"] = _train(model, functools.partial(_batch, rank=rank))
        # The blocks merged into the root's unit: nn.Module._apply converts a block
        # before the root that owns its unit (this raised "mixed dtypes" once).
        model = _meta("tandem", world_size, "init_weights", dtype=dtype, min_unit_bytes=DEFAULT_MIN_UNIT_BYTES)
        out[f"train/{name}/merged/dtypes"] = {str(p.dtype) for p in model.parameters()}
        out[f"train/{name}/merged"] = _train(model, functools.partial(_batch, rank=rank))
    # Forgetting to_empty: the parameters stay meta, as in torch's FSDP2, and the first forward says what to do.
    for impl in ("tandem", "torch"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        with torch.device("meta"):
            model = _build()
        shard = fully_shard if impl == "tandem" else torch_fully_shard
        for block in model.blocks:
            shard(block, mesh=init_device_mesh("cpu", (world_size,)))
        shard(model, mesh=init_device_mesh("cpu", (world_size,)))
        out[f"forgot/{impl}/meta"] = all(p.is_meta for p in model.parameters())
        try:
            model(_batch(0, rank)[0])
            out[f"forgot/{impl}/error"] = ""
        except RuntimeError as e:
            out[f"forgot/{impl}/error"] = str(e)
    # A placement it cannot split: refused, naming it (the same on every rank).
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    partial = DTensor.from_local(torch.zeros(4, 2), init_device_mesh("cpu", (world_size,)), [Partial()])
    try:
        with init_like_unsharded():
            nn.init.normal_(partial)
        out["partial/error"] = ""
    except NotImplementedError as e:
        out["partial/error"] = str(e)
    # A cast between steps, after the units have run: train, .double(), train on.
    def midway(model: nn.Module, batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> Any:
        _train(model, batches, steps=1)
        model.double()
        return _train(model, lambda step: batches(step + 1))

    out["midway/eager"] = midway(_eager("init_weights"), functools.partial(_global_batch, world_size=world_size))
    out["midway/tandem"] = midway(_meta("tandem", world_size, "init_weights"), functools.partial(_batch, rank=rank))
    return out


@functools.cache
def _results(world_size: int) -> list[dict[str, Any]]:
    return run_distributed(_grid, world_size, timeout=300)


WORLDS = [2, 3]


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("impl", ["tandem", "torch"])
@pytest.mark.parametrize("init", list(INITS))
def test_meta_init_equals_eager_init(world_size: int, impl: str, init: str) -> None:
    for rank, results in enumerate(_results(world_size)):
        got, eager = results[f"{impl}/{init}"], results[f"eager/{init}"]
        assert max_abs_diff(got, eager) == 0, (rank, {n: max_abs_diff({n: got[n]}, {n: eager[n]}) for n in got})


@pytest.mark.parametrize("world_size", WORLDS)
def test_meta_init_of_tiny_units_merged_into_the_root_equals_eager_init(world_size: int) -> None:
    for rank, results in enumerate(_results(world_size)):
        assert results["merged/units"] == 1, results["merged/units"]  # the case: every block absorbed
        assert max_abs_diff(results["merged/init_weights"], results["eager/init_weights"]) == 0, rank


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("init", list(INITS))
def test_without_init_like_unsharded_tandem_draws_what_torch_draws(world_size: int, init: str) -> None:
    for results in _results(world_size):
        tandem_, torch_ = results[f"tandem/{init}/dtensor_rules"], results[f"torch/{init}/dtensor_rules"]
        assert max_abs_diff(tandem_, torch_) == 0
        # Note [random init of shards]: on CPU each rank's shard repeats rank 0's draws,
        # and the full parameters are not the eager ones.
        w = tandem_["blocks.0.up.weight"]
        rows = -(-w.shape[0] // world_size)
        assert torch.equal(w[:rows], w[rows:2 * rows])
        assert max_abs_diff(tandem_, results[f"eager/{init}"]) > 0


@pytest.mark.parametrize("world_size", WORLDS)
def test_no_rank_allocates_the_full_model(world_size: int) -> None:
    model_bytes = _model_bytes()
    for rank, results in enumerate(_results(world_size)):
        eager, meta = results["peak/eager"], results["peak/meta"]
        assert eager >= model_bytes, (eager, model_bytes)  # the control: the measure sees a full model
        # The shards (1/N) plus one block gathered at a time, and one parameter drawn in full.
        block_bytes = model_bytes // (DEPTH + 1)
        assert meta <= model_bytes / world_size + 2 * block_bytes, (rank, meta, model_bytes)
        assert meta < 0.75 * model_bytes, (rank, meta, model_bytes)


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_dtype_change_after_sharding_trains_as_eager_and_torch(world_size: int, dtype: str) -> None:
    for rank, results in enumerate(_results(world_size)):
        tandem_, torch_ = results[f"train/{dtype}/tandem"], results[f"train/{dtype}/torch"]
        assert results[f"train/{dtype}/tandem/dtypes"] == {f"torch.{dtype}"}
        # The same reductions as torch's FSDP2, in the same order: equal to rounding.
        assert max_abs_diff(tandem_, torch_) <= 1e-12, (rank, max_abs_diff(tandem_, torch_))
        merged = results[f"train/{dtype}/merged"]
        assert results[f"train/{dtype}/merged/dtypes"] == {f"torch.{dtype}"}
        assert max_abs_diff(merged, tandem_) <= 1e-12, (rank, max_abs_diff(merged, tandem_))
        if dtype == "float64":  # the global batch's mean in one process rounds differently
            eager = results[f"train/{dtype}/eager"]
            assert max_abs_diff(tandem_, eager) <= 1e-12, (rank, max_abs_diff(tandem_, eager))


@pytest.mark.parametrize("world_size", WORLDS)
def test_dtype_change_between_steps(world_size: int) -> None:
    for rank, results in enumerate(_results(world_size)):
        got, eager = results["midway/tandem"], results["midway/eager"]
        assert {t.dtype for t in got.values()} == {torch.float64}
        assert max_abs_diff(got, eager) <= 1e-6, (rank, max_abs_diff(got, eager))  # one float32 step first


@pytest.mark.parametrize("world_size", WORLDS)
def test_a_forward_before_to_empty_is_an_error_naming_what_to_do(world_size: int) -> None:
    for rank, results in enumerate(_results(world_size)):
        assert results["forgot/tandem/meta"] and results["forgot/torch/meta"]
        assert "meta device" in results["forgot/torch/error"]  # torch refuses too
        error = results["forgot/tandem/error"]
        assert error.startswith(f"rank {rank}: fully_shard parameters are still on the meta device"), error
        assert "emb.weight" in error and "model.to_empty(device=...)" in error, error


@pytest.mark.parametrize("world_size", WORLDS)
def test_init_like_unsharded_refuses_a_placement_it_cannot_split(world_size: int) -> None:
    for results in _results(world_size):
        error = results["partial/error"]
        assert "shape (4, 2)" in error and "Partial" in error and "only Shard and Replicate" in error, error
