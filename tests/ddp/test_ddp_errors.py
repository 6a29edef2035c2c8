"""Bad input to tandem's DDP fails with a clear error on every rank, and never hangs.

Each rank function catches the expected exception itself and returns its type and
message, so a test can check that every rank raised and what each one said: the
parameter or buffer by name, the ranks involved, and the fix. Every spawned run
has a deadline, so a hang fails the test instead of the CI job.

Process start-up costs about a second, so cases that need a process group run as
grids inside one spawned group per world size (tandem.testing.run_cases in
module-scoped fixtures); each test then reads its own case's outcome on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tandem
from tandem.testing import Case, CaseResults, RankFailure, run_cases

TIMEOUT_S = 60.0
TINY_CAP_MB = 1e-6  # 1 byte: every parameter closes a bucket of its own

Outcome = tuple[str, str] | None  # (exception type name, message), or None: no exception


def _outcome(fn: Callable[[], Any]) -> Outcome:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is part of what the tests check
        return type(e).__name__, str(e)
    return None


def _ranks_in_step(rank: int, world_size: int) -> bool:
    """A collective after an error path: it completes with the right value only if
    every rank issued the same collectives before it (nothing left pending)."""
    t = torch.tensor([float(rank + 1)])
    try:
        dist.all_reduce(t)
    except RuntimeError:  # a peer gave up: reported as "not in step"
        return False
    return float(t) == world_size * (world_size + 1) / 2


def _run(results: CaseResults, name: str) -> list[Any]:
    """A case's results, and every failing rank's traceback on failure."""
    try:
        return results[name]
    except RankFailure as e:
        details = "\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(e.tracebacks.items()))
        pytest.fail(f"ranks {sorted(e.tracebacks)} failed:\n{details}", pytrace=False)


# ---------------------------------------------------------------- models

def _mlp(hidden: int = 4, dtype: torch.dtype = torch.float32, extra_layer: bool = False) -> nn.Sequential:
    layers = [nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2)]
    if extra_layer:
        layers.append(nn.Linear(2, 2))
    return nn.Sequential(*layers).to(dtype)


class _WithBuffer(nn.Module):
    scale: torch.Tensor

    def __init__(self, buffer_len: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(buffer_len))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale[:4]


class _Gated(nn.Module):
    """Three chained 4x4 weights, and a ``gate`` that forward may skip.

    ``gate_index`` is where the gate is registered among the four parameters;
    buckets fill in reverse registration order, so with one parameter per bucket
    index 3 puts the gate in the first bucket launched, 2 in a middle one and 0 in
    the last (the one that carries the missing-gradient flag).
    """

    CHAIN = ("w0", "w1", "w2")
    gate: nn.Parameter

    def __init__(self, gate_index: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        names = list(self.CHAIN)
        names.insert(gate_index, "gate")
        for n in names:
            shape = (4,) if n == "gate" else (4, 4)
            self.register_parameter(n, nn.Parameter(torch.randn(shape, generator=g) * 0.5))

    def forward(self, x: torch.Tensor, use_gate: bool = True) -> torch.Tensor:
        h = x
        for n in self.CHAIN:
            h = torch.tanh(h @ getattr(self, n))
        if use_gate:
            h = h * self.gate
        return h


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 + rank))


def _reference_grads(model: nn.Module, world_size: int, skip_gate_on: list[int] | None = None,
                     ) -> dict[str, torch.Tensor]:
    """Gradients averaged over every rank's batch, computed in one process; a
    :class:`_Gated` model skips its gate on the ranks ``skip_gate_on``."""
    grads: dict[str, torch.Tensor] = {}
    for r in range(world_size):
        model.zero_grad(set_to_none=True)
        kwargs = {} if skip_gate_on is None else {"use_gate": r not in skip_gate_on}
        model(_batch(r), **kwargs).sum().backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                grads[n] = grads.get(n, torch.zeros_like(p)) + p.grad / world_size
    model.zero_grad(set_to_none=True)
    return grads


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _grads_match(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(
        torch.allclose(got[n], want[n], rtol=1e-5, atol=1e-6) for n in want)


# ---------------------------------------------------------------- construction cases
# Each builds a model on this rank and wraps it; the outcome is what DDP raised.

DDP = tandem.DistributedDataParallel


def _mismatch_shape_on_rank_1(rank: int, ws: int) -> None:
    DDP(_mlp(hidden=3 if rank == 1 else 4))


def _mismatch_shape_on_last_rank(rank: int, ws: int) -> None:
    DDP(_mlp(hidden=3 if rank == ws - 1 else 4))


def _mismatch_extra_layer(rank: int, ws: int) -> None:
    DDP(_mlp(extra_layer=rank == 1))


def _mismatch_dtype(rank: int, ws: int) -> None:
    DDP(_mlp(dtype=torch.float64 if rank == 1 else torch.float32))


def _mismatch_requires_grad(rank: int, ws: int) -> None:
    model = _mlp()
    if rank == 1:
        model[2].bias.requires_grad_(False)
    DDP(model)


def _mismatch_buffer_shape(rank: int, ws: int) -> None:
    DDP(_WithBuffer(buffer_len=5 if rank == 1 else 4))


def _reset_keeps_or_broadcasts(rank: int, ws: int) -> None:
    # An elastic rebuild's reset (broadcast=False) checks the model and keeps each rank's values;
    # the default reset gives every rank rank 0's.
    module = _WithBuffer()
    model = DDP(module)
    tensors = [*module.parameters(), module.scale]
    with torch.no_grad():
        for t in tensors:
            t.fill_(float(rank + 1))
    model.reset_process_group(broadcast=False)
    if not all(torch.equal(t, torch.full_like(t, rank + 1)) for t in tensors):
        raise AssertionError(f"rank {rank}: reset_process_group(broadcast=False) changed this rank's values")
    model.reset_process_group()
    if not all(torch.equal(t, torch.ones_like(t)) for t in tensors):
        raise AssertionError(f"rank {rank}: reset_process_group() did not give this rank rank 0's values")


def _reset_without_broadcast_still_checks(rank: int, ws: int) -> None:
    module = _WithBuffer()
    model = DDP(module)
    if rank == 1:  # a buffer reassigned, as a replacement with another model would hold
        module.scale = torch.ones(5)
    model.reset_process_group(broadcast=False)


def _reset_checked_by_the_caller(rank: int, ws: int, differ: bool) -> None:
    # An elastic change's reset (check=False) issues no collective: rank 1 resets twice and
    # rank 0 once, and the gather after it still pairs up. The caller gathers the digests with
    # numbers of its own, and check_model raises (on every rank) where the models differ.
    from tandem.comm.plain_data import all_gather_ints
    module = _WithBuffer()
    model = DDP(module)
    if differ and rank == 1:  # a buffer reassigned, as a replacement with another model would hold
        module.scale = torch.ones(5)
    with torch.no_grad():
        for t in [*module.parameters(), module.scale]:
            t.fill_(float(rank + 1))
    for _ in range(rank + 1):
        model.reset_process_group(broadcast=False, check=False)
    gathered = all_gather_ints([7 + rank, *model.model_digest()])
    if [row[0] for row in gathered] != [7, 8]:
        raise AssertionError(f"rank {rank}: a reset without the check issued a collective: {gathered}")
    model.check_model([row[1:] for row in gathered])
    if not torch.equal(module.scale, torch.full_like(module.scale, rank + 1)):
        raise AssertionError(f"rank {rank}: reset_process_group(broadcast=False, check=False) changed a value")


def _build_with(**kwargs: Any) -> Callable[[int, int], None]:
    def build(rank: int, ws: int) -> None:
        DDP(_mlp(), **kwargs)
    return build


def _reduce_dtype_fused(rank: int, ws: int) -> None:
    ddp = DDP(_mlp(), reduce_dtype=torch.bfloat16)
    ddp.fuse_optimizer(torch.optim.SGD(ddp.parameters(), lr=0.1))


def _comm_hook_twice(rank: int, ws: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    ddp = DDP(_mlp())
    ddp.register_comm_hook(None, allreduce_hook)
    ddp.register_comm_hook(None, allreduce_hook)


def _comm_hook_after_backward(rank: int, ws: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    ddp = DDP(_mlp())
    ddp(torch.randn(2, 4)).sum().backward()
    ddp.register_comm_hook(None, allreduce_hook)


def _device_ids_on_cpu(rank: int, ws: int) -> None:
    DDP(_mlp(), device_ids=[0])


def _output_device_on_cpu(rank: int, ws: int) -> None:
    DDP(_mlp(), output_device=0)


def _no_trainable_params(rank: int, ws: int) -> None:
    DDP(_mlp().requires_grad_(False))


def _no_params(rank: int, ws: int) -> None:
    DDP(nn.ReLU())


def _lazy(rank: int, ws: int) -> None:
    DDP(nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(2)))


def _tiny_positive_cap(rank: int, ws: int) -> None:
    # Positive, so valid; int(1e-9 MiB) is 0 bytes. torch accepts it (one bucket
    # per parameter); so must tandem, and it must still average correctly.
    torch.manual_seed(0)
    model = _mlp()
    want = _reference_grads(model, ws)
    ddp = DDP(model, bucket_cap_mb=1e-9)
    ddp(_batch(rank)).sum().backward()
    if not _grads_match(_grads(model), want):
        raise AssertionError("wrong gradients with bucket_cap_mb=1e-9")


def _still_trains(rank: int, ws: int) -> None:
    # Last in the grid: the errors above left every rank able to build a DDP
    # and average gradients together.
    torch.manual_seed(0)
    model = _mlp()
    want = _reference_grads(model, ws)
    ddp = DDP(model, bucket_cap_mb=TINY_CAP_MB)
    ddp(_batch(rank)).sum().backward()
    if not _grads_match(_grads(model), want):
        raise AssertionError("wrong gradients after the error cases")


BUILD_CASES: dict[str, Callable[[int, int], None]] = {
    "shape": _mismatch_shape_on_rank_1,
    "shape_last_rank": _mismatch_shape_on_last_rank,
    "extra_layer": _mismatch_extra_layer,
    "dtype": _mismatch_dtype,
    "requires_grad": _mismatch_requires_grad,
    "buffer_shape": _mismatch_buffer_shape,
    "reset_keeps_or_broadcasts": _reset_keeps_or_broadcasts,
    "reset_checks": _reset_without_broadcast_still_checks,
    "reset_checked_by_the_caller": functools.partial(_reset_checked_by_the_caller, differ=False),
    "reset_checked_by_the_caller_differs": functools.partial(_reset_checked_by_the_caller, differ=True),
    "mixed_precision": _build_with(mixed_precision=object()),
    "delay_all_reduce_named_params": _build_with(delay_all_reduce_named_params=object()),
    "param_to_hook_all_reduce": _build_with(param_to_hook_all_reduce=object()),
    "skip_all_reduce_unused_params": _build_with(skip_all_reduce_unused_params=True),
    "comm_hook_twice": _comm_hook_twice,
    "comm_hook_after_backward": _comm_hook_after_backward,
    "device_ids": _device_ids_on_cpu,
    "output_device": _output_device_on_cpu,
    "no_trainable": _no_trainable_params,
    "no_params": _no_params,
    "lazy": _lazy,
    "cap_zero": _build_with(bucket_cap_mb=0),
    "cap_negative": _build_with(bucket_cap_mb=-1.0),
    "cap_list_zero": _build_with(bucket_cap_mb_list=[1.0, 0.0]),
    "tiny_positive_cap": _tiny_positive_cap,
    "reduce_dtype_int": _build_with(reduce_dtype=torch.int32),
    "reduce_dtype_zero": _build_with(reduce_dtype=torch.bfloat16, zero_stage=2),
    "reduce_dtype_as_view": _build_with(reduce_dtype=torch.bfloat16, gradient_as_bucket_view=True),
    "reduce_dtype_fused": _reduce_dtype_fused,
    "still_trains": _still_trains,
}


def _run_build_cases(rank: int, ws: int, names: list[str]) -> dict[str, Any]:
    torch.manual_seed(0)  # the same model on every rank unless a case says otherwise
    results: dict[str, Any] = {name: _outcome(functools.partial(BUILD_CASES[name], rank, ws)) for name in names}
    results["in_step"] = _ranks_in_step(rank, ws)
    return results


TWO_RANK_BUILD = [n for n in BUILD_CASES if n != "shape_last_rank"]
THREE_RANK_BUILD = ["shape_last_rank", "extra_layer", "still_trains"]


@pytest.fixture(scope="module")
def built2(two) -> list[dict[str, Any]]:
    return _run(two, "build")


@pytest.fixture(scope="module")
def built3(three) -> list[dict[str, Any]]:
    return _run(three, "build")


def _raised_everywhere(results: list[dict[str, Any]], case: str, exc: str) -> list[str]:
    """The messages of ``case`` on every rank, after checking every rank raised ``exc``."""
    outcomes = [r[case] for r in results]
    assert all(o is not None for o in outcomes), f"{case}: some ranks did not raise: {outcomes}"
    assert [o[0] for o in outcomes] == [exc] * len(results), outcomes
    assert all(r["in_step"] for r in results)
    return [o[1] for o in outcomes]


def _same_message_on_every_rank(msgs: list[str]) -> str:
    """Each message is 'rank r: <text>' with the same text everywhere; returns the text."""
    texts = []
    for r, m in enumerate(msgs):
        assert m.startswith(f"rank {r}: "), m
        texts.append(m[len(f"rank {r}: "):])
    assert all(t == texts[0] for t in texts), texts
    return texts[0]


# ---------------------------------------------------------------- a model that differs across ranks

def test_shape_mismatch_on_rank_1(built2):
    text = _same_message_on_every_rank(_raised_everywhere(built2, "shape", "ValueError"))
    assert ("parameter '0.weight' of shape (4, 4) and float32, requires_grad=True on ranks [0]"
            in text), text
    assert "parameter '0.weight' of shape (3, 4) and float32, requires_grad=True on ranks [1]" in text
    assert "same model on every rank" in text and "Build the model identically" in text


def test_shape_mismatch_only_on_rank_2_of_3(built3):
    text = _same_message_on_every_rank(_raised_everywhere(built3, "shape_last_rank", "ValueError"))
    assert "parameter '0.weight' of shape (4, 4)" in text and "on ranks [0, 1]" in text, text
    assert "parameter '0.weight' of shape (3, 4) and float32, requires_grad=True on ranks [2]" in text


@pytest.mark.parametrize("fixture, holders", [("built2", "[0]"), ("built3", "[0, 2]")])
def test_different_number_of_parameters(request, fixture, holders):
    results = request.getfixturevalue(fixture)
    text = _same_message_on_every_rank(_raised_everywhere(results, "extra_layer", "ValueError"))
    # The first difference is the extra layer's weight, which the others lack.
    assert f"nothing on ranks {holders}" in text, text
    assert "parameter '3.weight' of shape (2, 2) and float32, requires_grad=True on ranks [1]" in text
    assert "different numbers of parameters and buffers: [4, 6]" in text


def test_dtype_mismatch(built2):
    text = _same_message_on_every_rank(_raised_everywhere(built2, "dtype", "ValueError"))
    assert "parameter '0.weight' of shape (4, 4) and float32, requires_grad=True on ranks [0]" in text
    assert "parameter '0.weight' of shape (4, 4) and float64, requires_grad=True on ranks [1]" in text


def test_requires_grad_mismatch(built2):
    text = _same_message_on_every_rank(_raised_everywhere(built2, "requires_grad", "ValueError"))
    assert "parameter '2.bias' of shape (2,) and float32, requires_grad=True on ranks [0]" in text
    assert "parameter '2.bias' of shape (2,) and float32, requires_grad=False on ranks [1]" in text


def test_buffer_shape_mismatch(built2):
    text = _same_message_on_every_rank(_raised_everywhere(built2, "buffer_shape", "ValueError"))
    assert "buffer 'scale' of shape (4,) and float32 on ranks [0]" in text, text
    assert "buffer 'scale' of shape (5,) and float32 on ranks [1]" in text


def test_a_reset_without_broadcast_keeps_each_ranks_values_and_still_checks_the_model(built2):
    assert [r["reset_keeps_or_broadcasts"] for r in built2] == [None, None]
    text = _same_message_on_every_rank(_raised_everywhere(built2, "reset_checks", "ValueError"))
    assert "buffer 'scale' of shape (5,) and float32 on ranks [1]" in text, text


def test_a_reset_without_the_check_leaves_it_to_the_callers_gather(built2):
    assert [r["reset_checked_by_the_caller"] for r in built2] == [None, None]
    text = _same_message_on_every_rank(_raised_everywhere(built2, "reset_checked_by_the_caller_differs",
                                                          "ValueError"))
    assert "buffer 'scale' of shape (5,) and float32 on ranks [1]" in text, text


# ---------------------------------------------------------------- torch arguments not supported yet

@pytest.mark.parametrize("arg", ["mixed_precision", "delay_all_reduce_named_params",
                                 "param_to_hook_all_reduce", "skip_all_reduce_unused_params"])
def test_unsupported_argument(built2, arg):
    for msg in _raised_everywhere(built2, arg, "NotImplementedError"):
        assert f"does not support {arg}" in msg, msg
        assert "torch.nn.parallel.DistributedDataParallel" in msg


def test_register_comm_hook_twice_or_late(built2):
    for msg in _raised_everywhere(built2, "comm_hook_twice", "RuntimeError"):
        assert "only be called once" in msg and "allreduce_hook" in msg, msg
    for msg in _raised_everywhere(built2, "comm_hook_after_backward", "RuntimeError"):
        assert "before the first backward" in msg, msg


# ---------------------------------------------------------------- bad arguments and modules

@pytest.mark.parametrize("case, shown", [("device_ids", "device_ids=[0]"),
                                         ("output_device", "output_device=0")])
def test_gpu_arguments_with_a_cpu_module(built2, case, shown):
    for msg in _raised_everywhere(built2, case, "ValueError"):
        assert shown in msg and "cpu" in msg and "leave both unset for CPU modules" in msg, msg


@pytest.mark.parametrize("case", ["no_trainable", "no_params"])
def test_module_without_trainable_parameters(built2, case):
    for msg in _raised_everywhere(built2, case, "RuntimeError"):
        assert "doesn't have any parameter that requires a gradient" in msg, msg


def test_lazy_module(built2):
    for msg in _raised_everywhere(built2, "lazy", "RuntimeError"):
        assert "parameter '1.weight' is uninitialized" in msg, msg
        assert "dummy forward" in msg


@pytest.mark.parametrize("case, shown", [("cap_zero", "bucket_cap_mb must be positive, got 0"),
                                         ("cap_negative", "bucket_cap_mb must be positive, got -1.0"),
                                         ("cap_list_zero", "bucket_cap_mb_list must be positive")])
def test_non_positive_bucket_cap(built2, case, shown):
    for msg in _raised_everywhere(built2, case, "ValueError"):
        assert shown in msg, msg


@pytest.mark.parametrize("case, shown", [
    ("reduce_dtype_int", "reduce_dtype must be a floating-point torch.dtype such as torch.bfloat16, got torch.int32"),
    ("reduce_dtype_zero", "reduce_dtype=torch.bfloat16 is not supported with zero_stage=2"),
    ("reduce_dtype_as_view", "cannot be used with gradient_as_bucket_view=True"),
    ("reduce_dtype_fused", "fuse_optimizer with reduce_dtype=torch.bfloat16")])
def test_reduce_dtype_is_refused_where_a_bucket_is_a_grad(built2, case, shown):
    """Where the buckets' own tensors would become gradients of parameters of another dtype."""
    for rank, msg in enumerate(_raised_everywhere(built2, case, "ValueError")):
        assert msg.startswith(f"rank {rank}: ") and shown in msg, msg


def test_tiny_positive_bucket_cap_works(built2):
    assert [r["tiny_positive_cap"] for r in built2] == [None, None]


@pytest.mark.parametrize("fixture", ["built2", "built3"])
def test_errors_leave_the_group_usable(request, fixture):
    results = request.getfixturevalue(fixture)
    assert all(r["still_trains"] is None for r in results), [r["still_trains"] for r in results]
    assert all(r["in_step"] for r in results)


# ---------------------------------------------------------------- no process group

def test_no_process_group():
    assert not dist.is_initialized(), "this test needs a process without a process group"
    with pytest.raises(RuntimeError, match=r"tandem\.init\(\)"):
        tandem.DistributedDataParallel(_mlp())


# ---------------------------------------------------------------- parameters that get no gradient

GATE_BUCKETS = {3: "first", 2: "middle", 0: "last"}  # gate_index -> bucket launched


def _missing_grad_case(rank: int, ws: int, gate_index: int, skip_on: list[int]) -> dict[str, Any]:
    """One step in which the gate gets no gradient on the ranks ``skip_on``."""
    model = _Gated(gate_index)
    ddp = DDP(model, bucket_cap_mb=TINY_CAP_MB)
    reducer = ddp.reducer
    assert reducer is not None
    plan = reducer.plan
    out: dict[str, Any] = {
        "num_buckets": len(plan.buckets),
        "gate_bucket": plan.bucket_of()[reducer.names.index("gate")][0],
    }
    holder: dict[str, torch.Tensor] = {}

    def forward() -> None:
        holder["loss"] = ddp(_batch(rank), use_gate=rank not in skip_on).sum()

    out["forward"] = _outcome(forward)
    out["backward"] = _outcome(lambda: holder["loss"].backward())
    out["in_step"] = _ranks_in_step(rank, ws)
    return out


def _run_missing_grad_cases(rank: int, ws: int, cases: list[tuple[int, list[int]]]) -> list[dict[str, Any]]:
    return [_missing_grad_case(rank, ws, gate_index, skip_on) for gate_index, skip_on in cases]


MISSING_CASES = [(g, skip) for g in GATE_BUCKETS for skip in ([0, 1], [1])]


@pytest.fixture(scope="module")
def missing2(two) -> list[list[dict[str, Any]]]:
    return _run(two, "missing")


@pytest.fixture(scope="module")
def missing3(three) -> list[list[dict[str, Any]]]:
    return _run(three, "missing")


def _check_missing(per_rank: list[dict[str, Any]], gate_index: int, skip_on: list[int]) -> None:
    ws = len(per_rank)
    expected_bucket = {"first": 0, "middle": 1, "last": 3}[GATE_BUCKETS[gate_index]]
    msgs = []
    for r, res in enumerate(per_rank):
        assert (res["num_buckets"], res["gate_bucket"]) == (4, expected_bucket), res
        assert res["forward"] is None, res["forward"]
        # Raised by this step's backward, on every rank, not by the next step.
        assert res["backward"] is not None, f"rank {r}: backward did not raise"
        assert res["backward"][0] == "RuntimeError", res["backward"]
        assert res["in_step"]
        msgs.append(res["backward"][1])
    text = _same_message_on_every_rank(msgs)
    assert "these parameters received no gradient in this backward" in text, text
    for r in range(ws):
        line = f"  rank {r}: 'gate'"
        assert (line in text) == (r in skip_on), (r, text)
    assert "find_unused_parameters=True" in text


@pytest.mark.parametrize("skip_on", [[0, 1], [1]], ids=["unused_on_all_ranks", "unused_on_rank_1"])
@pytest.mark.parametrize("gate_index", list(GATE_BUCKETS), ids=[f"{b}_bucket" for b in GATE_BUCKETS.values()])
def test_missing_gradient_two_ranks(missing2, gate_index, skip_on):
    k = MISSING_CASES.index((gate_index, skip_on))
    _check_missing([rank_results[k] for rank_results in missing2], gate_index, skip_on)


@pytest.mark.parametrize("gate_index", list(GATE_BUCKETS), ids=[f"{b}_bucket" for b in GATE_BUCKETS.values()])
def test_missing_gradient_only_on_rank_2_of_3(missing3, gate_index):
    k = list(GATE_BUCKETS).index(gate_index)
    _check_missing([rank_results[k] for rank_results in missing3], gate_index, [2])


def _assert_good_steps(results: list[dict[str, Any]], steps: int) -> None:
    """Steps 0..steps-1 raised nothing and averaged correctly on every rank (all
    ranks' problems are listed together: one rank's error often explains another's)."""
    problems = []
    for r, res in enumerate(results):
        for step in range(steps):
            if res[f"step{step}"] is not None:
                problems.append(f"rank {r}, step {step} raised {res[f'step{step}']}")
                break
            if not res[f"grads{step}"]:
                problems.append(f"rank {r}, step {step}: wrong gradients")
                break
        else:
            if not res["in_step"]:
                problems.append(f"rank {r}: collectives out of step after the steps")
    assert not problems, "\n".join(problems)


def _continue_after_missing(rank: int, ws: int, skip_on: list[int]) -> dict[str, Any]:
    """The failing step, then good steps: the user caught the error and carries on."""
    model = _Gated(3)
    want = _reference_grads(model, ws)
    ddp = DDP(model, bucket_cap_mb=TINY_CAP_MB)
    out: dict[str, Any] = {
        "failing": _outcome(lambda: ddp(_batch(rank), use_gate=rank not in skip_on).sum().backward())}
    for step in range(3):
        model.zero_grad(set_to_none=True)
        out[f"step{step}"] = _outcome(lambda: ddp(_batch(rank)).sum().backward())
        out[f"grads{step}"] = _grads_match(_grads(model), want)
    # A rank that hit an unexpected error skips this, so that the test reports
    # the error rather than the collective mismatch that follows it.
    if all(out[f"step{step}"] is None for step in range(3)):
        out["in_step"] = _ranks_in_step(rank, ws)
    return out


@pytest.mark.parametrize("skip_on", [[0, 1], [1]], ids=["unused_on_all_ranks", "unused_on_rank_1"])
def test_training_continues_after_a_caught_missing_gradient_error(two, skip_on):
    results = _run(two, f"continue {skip_on}")
    for res in results:
        assert res["failing"] is not None and res["failing"][0] == "RuntimeError", res["failing"]
    _assert_good_steps(results, 3)


# ---------------------------------------------------------------- forwards without a backward

def _forward_without_backward(rank: int, ws: int, ddp_kwargs: dict[str, Any],
                              skip_on: list[int]) -> dict[str, Any]:
    """A forward with grad enabled whose output is dropped (an eval-like forward,
    or a skipped batch), then a normal step: no error, and correct gradients."""
    model = _Gated(3)
    use_gate = rank not in skip_on
    want = _reference_grads(model, ws, skip_gate_on=skip_on)
    ddp = DDP(model, bucket_cap_mb=TINY_CAP_MB, **ddp_kwargs)
    out: dict[str, Any] = {"dropped": _outcome(lambda: ddp(_batch(rank), use_gate=use_gate))}
    for step in range(2):
        model.zero_grad(set_to_none=True)
        out[f"step{step}"] = _outcome(lambda: ddp(_batch(rank), use_gate=use_gate).sum().backward())
        out[f"grads{step}"] = _grads_match(_grads(model), want)
    if all(out[k] is None for k in ("dropped", "step0", "step1")):  # see _continue_after_missing
        out["in_step"] = _ranks_in_step(rank, ws)
    return out


def _check_forward_without_backward(results: list[dict[str, Any]]) -> None:
    assert [res["dropped"] for res in results] == [None] * len(results)
    _assert_good_steps(results, 2)


def test_forward_without_backward_then_a_step(two):
    results = _run(two, "forward without backward")
    _check_forward_without_backward(results)


@pytest.mark.parametrize("skip_on", [[0, 1], [1]], ids=["unused_on_all_ranks", "unused_on_rank_1"])
def test_forward_without_backward_with_find_unused_parameters(two, skip_on):
    # torch's DDP allows this: unused parameters are only marked ready once the
    # backward starts.
    results = _run(two, f"forward without backward, find_unused_parameters {skip_on}")
    _check_forward_without_backward(results)


# ---------------------------------------------------------------- the spawned groups
SKIPS = ([0, 1], [1])


@pytest.fixture(scope="module")
def two() -> CaseResults:
    return run_cases({
        "build": Case(_run_build_cases, args=(TWO_RANK_BUILD,), timeout=TIMEOUT_S),
        "missing": Case(_run_missing_grad_cases, args=(MISSING_CASES,), timeout=TIMEOUT_S),
        **{f"continue {skip_on}": Case(_continue_after_missing, args=(skip_on,), timeout=TIMEOUT_S)
           for skip_on in SKIPS},
        "forward without backward": Case(_forward_without_backward, args=({}, []), timeout=TIMEOUT_S),
        **{f"forward without backward, find_unused_parameters {skip_on}": Case(
            _forward_without_backward, args=({"find_unused_parameters": True}, skip_on), timeout=TIMEOUT_S)
           for skip_on in SKIPS},
    }, 2)


@pytest.fixture(scope="module")
def three() -> CaseResults:
    return run_cases({
        "build": Case(_run_build_cases, args=(THREE_RANK_BUILD,), timeout=TIMEOUT_S),
        "missing": Case(_run_missing_grad_cases, args=([(g, [2]) for g in GATE_BUCKETS],), timeout=TIMEOUT_S),
    }, 3)
