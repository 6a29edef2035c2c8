"""Gradients born in their bucket (Note [gradients born in their bucket] in
tandem/ddp/reduction.py): after a step ``param.grad`` is a view of the reduced
bucket, and what a user of torch's default DDP can observe stays true.

Each case trains tandem's DDP and torch's DDP side by side in one process, on the
same batches, and compares every gradient and parameter after every step, plus
what the case is about: a kept old gradient is not overwritten, a tensor the user
assigned as ``.grad`` stays ``.grad`` and receives the average, an unused
parameter's ``.grad`` is left as it was, accumulation under no_sync, a second
gradient in one backward, a checkpoint round trip. The whole grid runs in one
spawned group per world size (2, and 3 where a division by the world size is
not exact).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

import tandem
from tandem.testing import grad_of, run_distributed
from tandem.testing.models import IN, OUT, make_model

TIMEOUT = 240
KW = {"bucket_cap_mb": 0.002}  # several buckets even on tiny models


class BigTwice(nn.Module):
    """A parameter of 384x384 in a bucket of 600 KB, the only one (which copies per parameter: Note [copy
    granularity]) used in two reentrant checkpoints, so that its AccumulateGrad
    runs twice in one backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, 384)
        self.big = nn.Linear(384, 384)
        self.head = nn.Linear(384, OUT)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = checkpoint(lambda t: torch.tanh(self.big(t)), h, use_reentrant=True)
        h = checkpoint(lambda t: torch.tanh(self.big(t)), h, use_reentrant=True)
        return self.head(h)


def _model(name: str) -> nn.Module:
    if name == "big_twice":
        torch.manual_seed(3)
        return BigTwice()
    return make_model(name, seed=3)


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, IN, generator=g), torch.randn(4, OUT, generator=g)


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None], what: str) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x is None) == (y is None), f"{what}: tensor {i} is None on one side only"
        if x is not None:
            assert y is not None
            diff = (x - y).abs().max().item()
            assert diff <= 1e-6, f"{what}: tensor {i} differs by {diff}"


Wrapped = tandem.DistributedDataParallel | TorchDDP


class Pair:
    """tandem's DDP and torch's DDP over identical models, stepped together."""

    def __init__(self, name: str, **ddp: object) -> None:
        self.ours = tandem.DistributedDataParallel(_model(name), **KW, **ddp)  # type: ignore[arg-type]
        self.ref = TorchDDP(_model(name), **KW, **ddp)  # type: ignore[arg-type]
        self.opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in self.both]

    @property
    def both(self) -> tuple[Wrapped, Wrapped]:
        return self.ours, self.ref

    def each(self, fn: Callable[[Wrapped, torch.optim.Optimizer], None]) -> None:
        for m, o in zip(self.both, self.opts):
            fn(m, o)

    def check(self, what: str) -> None:
        _same(_grads(self.ours), _grads(self.ref), f"{what}: grads")
        _same([p.detach() for p in self.ours.parameters()], [p.detach() for p in self.ref.parameters()],
              f"{what}: params")


def _backward(m: nn.Module, step: int, rank: int, micro: int = 0) -> None:
    x, y = _batch(step, micro, rank)
    nn.functional.mse_loss(m(x, step), y).backward()


def _backward_at(step: int, rank: int) -> Callable[[nn.Module, torch.optim.Optimizer], None]:
    """What :meth:`Pair.each` runs for a step's backward."""
    return lambda m, o: _backward(m, step, rank)


def _bound_to_buckets(ddp: tandem.DistributedDataParallel) -> int:
    """How many parameters' .grad share memory with the reducer's buckets."""
    reducer = ddp.reducer
    assert reducer is not None
    ptrs = {t.untyped_storage().data_ptr() for t in reducer.buffer.flat.values()}
    return sum(p.grad is not None and p.grad.untyped_storage().data_ptr() in ptrs for p in ddp.parameters())


# ---------------------------------------------------------------------- cases
def case_plain(rank: int, set_to_none: bool, model: str = "mlp") -> None:
    pair = Pair(model)
    for step in range(4):
        pair.each(lambda m, o: o.zero_grad(set_to_none=set_to_none))
        pair.each(_backward_at(step, rank))
        pair.check(f"{model} set_to_none={set_to_none} step {step}")
        pair.each(lambda m, o: o.step())
    n = sum(1 for _ in pair.ours.parameters())
    assert _bound_to_buckets(pair.ours) == n, "param.grad should be its bucket's view after a step"


def case_zero_grad_between_forward_and_backward(rank: int) -> None:
    pair = Pair("mlp")
    for step in range(3):
        for m, o in zip(pair.both, pair.opts):
            x, y = _batch(step, 0, rank)
            loss = nn.functional.mse_loss(m(x), y)
            o.zero_grad(set_to_none=True)
            loss.backward()
            o.step()
        pair.check(f"zero_grad after forward, step {step}")


def case_kept_gradients(rank: int) -> None:
    """A user keeps old gradients (the tensors, and views of them) across
    zero_grad(set_to_none=True): the next step must not write into them."""
    pair = Pair("mlp")
    kept: list[list[torch.Tensor]] = []    # per model, kept after the previous step
    values: list[list[torch.Tensor]] = []  # what they held then
    for step in range(4):
        pair.each(lambda m, o: o.zero_grad(set_to_none=True))
        pair.each(_backward_at(step, rank))
        pair.check(f"kept gradients, step {step}")
        pair.each(lambda m, o: o.step())
        for k, (ts, vs) in enumerate(zip(kept, values)):  # a whole step later: unchanged
            _same(list(ts), list(vs), f"kept at step {step - 1}, {('tandem', 'torch')[k]}")
        if step == 1:  # the gradient tensors themselves
            kept = [[p.grad for p in m.parameters()] for m in pair.both]  # type: ignore[misc]
        elif step == 2:  # views derived from them
            kept = [[p.grad.view(-1) for p in m.parameters()] for m in pair.both]  # type: ignore[union-attr]
        else:
            kept = []
        values = [[t.clone() for t in ts] for ts in kept]


def case_user_assigned_grad(rank: int) -> None:
    """``p.grad = t`` before forward: autograd accumulates into t, DDP writes the
    average into t, and t stays p.grad (torch's default semantics)."""
    pair = Pair("mlp")
    for step in range(3):
        given = [[torch.full_like(p, 0.5) for p in m.parameters()] for m in pair.both]
        for m, ts in zip(pair.both, given):
            for p, t in zip(m.parameters(), ts):
                p.grad = t
        pair.each(_backward_at(step, rank))
        pair.check(f"user-assigned .grad, step {step}")
        for m, ts in zip(pair.both, given):
            assert all(p.grad is t for p, t in zip(m.parameters(), ts)), "the user's tensor stays .grad"
        pair.each(lambda m, o: o.step())


def case_no_sync(rank: int, set_to_none: bool) -> None:
    pair = Pair("mlp")
    for step in range(3):
        pair.each(lambda m, o: o.zero_grad(set_to_none=set_to_none))
        for micro in range(3):
            for m in pair.both:
                ctx = m.no_sync() if micro < 2 else contextlib.nullcontext()
                with ctx:
                    _backward(m, step, rank, micro)
            if micro < 2:  # local sums, before the synchronised backward
                _same(_grads(pair.ours), _grads(pair.ref), f"no_sync micro {micro}")
        pair.check(f"no_sync set_to_none={set_to_none}, step {step}")
        pair.each(lambda m, o: o.step())


def case_unused_keeps_grad(rank: int) -> None:
    """find_unused_parameters with gradients kept between steps: the branch a step
    does not use keeps its old .grad bit for bit (it is not scaled in place, nor
    reduced); the user makes the kept gradients differ between ranks."""
    pair = Pair("switching", find_unused_parameters=True)
    for step in range(4):  # never zeroed: gradients accumulate across steps
        before = [_grads(m) for m in pair.both]
        pair.each(_backward_at(step, rank))
        pair.check(f"unused branch, step {step}")
        for m, old in zip(pair.both, before):
            unused = "b" if step % 2 == 0 else "a"
            for (n, p), g in zip(m.module.named_parameters(), old):
                if n.startswith(unused + "."):
                    assert (g is None and p.grad is None) or (
                        g is not None and p.grad is not None and torch.equal(p.grad, g)), \
                        f"{type(m).__module__}: {n} at step {step}"
        pair.each(lambda m, o: o.step())
        used = "a" if step % 2 == 0 else "b"
        for m in pair.both:  # rank-dependent stale gradients: a reduction of them would show
            for n, p in m.module.named_parameters():
                if n.startswith(used + "."):
                    grad_of(p).mul_(rank + 1)


def case_second_gradient(rank: int, world_size: int) -> None:
    """A parameter whose gradient arrives twice in one backward (two reentrant
    checkpoints) while its bucket still fills, with gradients kept between steps:
    the second one adds to the view before the bucket is scaled. torch's DDP
    refuses a second gradient, so the reference is one process on the global batch."""
    ours = tandem.DistributedDataParallel(_model("big_twice"))  # one bucket: it fills until the end
    local = _model("big_twice")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, local)]
    for step in range(3):
        for o in opts:
            o.zero_grad(set_to_none=False)
        _backward(ours, step, rank)
        parts = [_batch(step, 0, r) for r in range(world_size)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        nn.functional.mse_loss(local(x), y).backward()
        _same(_grads(ours), _grads(local), f"second gradient, step {step}: grads")
        for o in opts:
            o.step()


def case_checkpoint_round_trip(rank: int) -> None:
    """Save model and optimizer mid-training, load into a fresh DDP, continue:
    equal to the run that never stopped (gradients are not part of a checkpoint)."""
    pair = Pair("mlp")
    for step in range(2):
        pair.each(lambda m, o: o.zero_grad(set_to_none=True))
        pair.each(_backward_at(step, rank))
        pair.each(lambda m, o: o.step())
    buf = io.BytesIO()
    torch.save({"model": pair.ours.state_dict(), "opt": pair.opts[0].state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf)
    resumed = tandem.DistributedDataParallel(make_model("mlp", seed=99), **KW)  # type: ignore[arg-type]
    resumed.load_state_dict(state["model"])
    opt = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(state["opt"])
    for step in range(2, 4):
        for m, o in ((pair.ours, pair.opts[0]), (resumed, opt)):
            o.zero_grad(set_to_none=step % 2 == 0)
            _backward(m, step, rank)
            o.step()
        _same([p.detach() for p in resumed.parameters()], [p.detach() for p in pair.ours.parameters()],
              f"resumed, step {step}")


def _grid(rank: int, world_size: int) -> list[str]:
    done = []
    cases: list[tuple[str, Callable[[], None]]] = [
        ("plain set_to_none", lambda: case_plain(rank, True)),
        ("plain keep grads", lambda: case_plain(rank, False)),
        ("tied keep grads", lambda: case_plain(rank, False, "tied")),
        ("zero_grad after forward", lambda: case_zero_grad_between_forward_and_backward(rank)),
        ("kept gradients", lambda: case_kept_gradients(rank)),
        ("user-assigned grad", lambda: case_user_assigned_grad(rank)),
        ("no_sync set_to_none", lambda: case_no_sync(rank, True)),
        ("no_sync keep grads", lambda: case_no_sync(rank, False)),
        ("unused keeps grad", lambda: case_unused_keeps_grad(rank)),
        ("second gradient", lambda: case_second_gradient(rank, world_size)),
        ("checkpoint round trip", lambda: case_checkpoint_round_trip(rank)),
    ]
    for name, run in cases:
        try:
            run()
        except AssertionError as e:
            raise AssertionError(f"case {name!r} at world {world_size}: {e}") from e
        done.append(name)
    return done


@pytest.mark.parametrize("world_size", [2, 3])
def test_grad_views_match_torch(world_size: int) -> None:
    results = run_distributed(_grid, world_size, timeout=TIMEOUT)
    assert all(len(r) == 11 for r in results)
