"""tandem.DataParallel on three CPU "devices" gives the outputs and gradients of
the plain module on the whole batch.

Every check runs the same module twice from the same parameters: once through
DataParallel, once directly on the whole batch, and compares the outputs, the
parameter gradients and the gradients of the inputs.
"""

from __future__ import annotations

import copy
import threading
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

import tandem
from tandem.dp import gather, replicate, scatter, scatter_kwargs
from tandem.testing import grad_of

TOL = 1e-6
CPU3 = ["cpu", "cpu", "cpu"]
IN, HID, OUT = 5, 8, 3

Point = namedtuple("Point", ["x", "y"])


@dataclass
class Box:
    """A dataclass input and output; ``label`` is not a tensor, ``area`` is derived."""

    lo: torch.Tensor
    hi: torch.Tensor
    label: str = "box"
    area: Any = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.area = (self.hi - self.lo).sum()


class Nested(nn.Module):
    """Takes tensors nested in tuples, lists, dicts, a namedtuple and a dataclass,
    non-tensor arguments and keyword arguments; returns a nested structure too.
    One weight is tied and one submodule is used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, HID)
        self.mix = nn.Linear(HID, HID)
        self.head = nn.Linear(HID, OUT)
        self.back = nn.Linear(OUT, HID, bias=False)
        self.back.weight = self.head.weight  # tied; forward uses it as an (OUT, HID) matrix
        self.register_buffer("offset", torch.linspace(-1, 1, HID))

    def forward(self, x, pair, items, extras, point, box, scale, log, *, mask=None, note=""):
        log.append((threading.current_thread().name, x.shape[0], scale, note, id(log)))
        h = torch.tanh(self.proj(x) * scale + self.offset)
        h = h + self.mix(torch.tanh(self.mix(pair[0]))) * pair[1]   # mix used twice
        h = h + items[0] * items[1].unsqueeze(1) + extras["z"]
        h = h * point.x + point.y + box.lo - box.hi
        if mask is not None:
            h = h * mask
        out = self.head(h)
        back = out @ self.back.weight  # (batch, OUT) @ (OUT, HID)
        return {"out": out, "parts": (h.sum(1), [back]), "box": Box(box.lo * 2, h), "none": None}


def _inputs(batch: int, seed: int = 0) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(seed)

    def t(*shape):
        return torch.randn(batch, *shape, generator=g).requires_grad_()

    args: tuple[Any, ...] = (t(IN), (t(HID), t(HID)), [t(HID), t()], {"z": t(HID), "k": 7},
            Point(t(HID), t(HID)), Box(t(HID), t(HID), label="b"), 0.5, [])
    return args, {"mask": t(HID), "note": "hello"}


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in a nested structure, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj) for t in _tensors(obj[k])]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, Box):
        return _tensors([obj.lo, obj.hi, obj.area])
    return []


def _loss(outputs: Any) -> torch.Tensor:
    g = torch.Generator().manual_seed(123)
    total = sum((t * torch.randn(t.shape, generator=g)).sum() for t in _tensors(outputs))
    assert isinstance(total, torch.Tensor)  # the outputs hold a tensor
    return total


def _run(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    model.zero_grad(set_to_none=True)
    out = model(*args, **kwargs)
    _loss(out).backward()
    inner = model.module if isinstance(model, tandem.DataParallel) else model
    return {"out": [t.detach().clone() for t in _tensors(out)],
            "param_grads": {n: grad_of(p).clone() for n, p in inner.named_parameters()},
            "input_grads": [t.grad.clone() for t in _tensors((args, kwargs)) if t.is_leaf and t.grad is not None]}


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    worst = 0.0
    for key in a:
        xs, ys = a[key], b[key]
        if isinstance(xs, dict):
            assert xs.keys() == ys.keys()
            xs, ys = list(xs.values()), [ys[k] for k in xs]
        assert len(xs) == len(ys), key
        for x, y in zip(xs, ys):
            assert x.shape == y.shape, (key, x.shape, y.shape)
            # Mixed absolute/relative: replicas run the model on sub-batches, and BLAS
            # kernels chosen per batch size round float32 differently on some CPUs.
            x, y = x.double(), y.double()
            worst = max(worst, ((x - y).abs() / (1 + y.abs())).max().item())
    return worst


def _compare(batch: int, device_ids, **dp_kwargs) -> list:
    torch.manual_seed(0)
    plain = Nested()
    ours = tandem.DataParallel(copy.deepcopy(plain), device_ids, **dp_kwargs)
    args, kwargs = _inputs(batch)
    ref = _run(plain, args, kwargs)
    args, kwargs = _inputs(batch)
    got = _run(ours, args, kwargs)
    assert _max_diff(ref, got) <= TOL
    return args[-1]  # the log the replicas appended to


@pytest.mark.parametrize("batch, replicas", [(6, 3), (7, 3), (2, 2), (1, 1)])
def test_nested_inputs_kwargs_and_uneven_splits(batch: int, replicas: int) -> None:
    """Batch 7 over 3 devices splits 3/3/1 (torch.chunk); 2 over 3 uses two replicas."""
    log = _compare(batch, CPU3)
    assert len(log) == replicas
    sizes = [n for _, n, _, _, _ in log]
    assert sorted(sizes, reverse=True) == [c.shape[0] for c in torch.empty(batch).chunk(3)]
    # Non-tensor arguments reach every replica unchanged and by reference.
    assert all(entry[2:] == (0.5, "hello", id(log)) for entry in log)
    # Each replica ran in a thread of its own (one replica runs in the caller's).
    threads = {name for name, *_ in log}
    assert len(threads) == replicas
    assert (threads == {threading.current_thread().name}) == (replicas == 1)


def test_device_objects_and_output_device() -> None:
    _compare(7, [torch.device("cpu")] * 3, output_device=torch.device("cpu"))
    _compare(5, ["cpu", "cpu"], output_device=-1)   # torch's "-1 means CPU"


def test_split_along_another_dim() -> None:
    class Transposed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(IN, OUT)

        def forward(self, x):           # x: (IN, batch)
            return self.lin(x.t()).t()  # (OUT, batch)

    torch.manual_seed(0)
    plain = Transposed()
    ours = tandem.DataParallel(copy.deepcopy(plain), CPU3, dim=1)
    x = torch.randn(IN, 8)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = plain(x1), ours(x2)
    assert y2.shape == (OUT, 8) and (y1 - y2).abs().max() <= TOL
    y1.square().sum().backward()
    y2.square().sum().backward()
    assert (grad_of(x1) - grad_of(x2)).abs().max() <= TOL
    assert (grad_of(plain.lin.weight) - grad_of(ours.module.get_parameter("lin.weight"))).abs().max() <= TOL


def test_training_through_the_original_parameters() -> None:
    """optimizer.step() on the original module's parameters trains it as on the whole batch."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT))
    dp = tandem.DataParallel(copy.deepcopy(plain), CPU3)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, dp)]
    for _step in range(3):
        x, y = torch.randn(7, IN), torch.randn(7, OUT)
        for model, opt in zip((plain, dp), opts):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    for (name, p), q in zip(plain.named_parameters(), dp.module.parameters()):
        assert (p - q).abs().max() <= TOL, name


def test_batchnorm_running_stats_come_from_replica_zero() -> None:
    """As torch's DataParallel on distinct GPUs: each replica normalises its own
    chunk, and only replica 0's running statistics reach the original module.
    Replicas that share a device do not race on one buffer."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4)
    dp = tandem.DataParallel(copy.deepcopy(bn), CPU3)
    x = torch.randn(6, 4) * 3 + 1
    out = dp(x)
    for chunk, got in zip(x.chunk(3), out.chunk(3)):
        assert (nn.functional.batch_norm(chunk, None, None, training=True) - got).abs().max() <= TOL
    bn(x[:2])
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(bn, name), getattr(dp.module, name)), name


def test_no_grad_and_autocast_reach_the_replica_threads() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT))
    dp = tandem.DataParallel(plain, CPU3)
    x = torch.randn(7, IN)
    with torch.no_grad():
        out = dp(x)
    assert not out.requires_grad and (out - plain(x)).abs().max() <= TOL
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, out = plain(x), dp(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    # The replicas multiply chunks of 3, 3 and 1 rows, plain(x) all 7: other matrix products, whose
    # fp32 sums may round to a neighbouring bf16 value. Two bf16 steps of the largest output
    # (a step is at most 2^-7 of a value) bound that, and the hidden layer's step it carries.
    assert (out.float() - ref.float()).abs().max() <= 2 * 2.0 ** -7 * ref.float().abs().max()


def test_a_failing_replica_names_its_device() -> None:
    class FailsOnSmallChunks(nn.Module):
        def forward(self, x):
            if x.shape[0] < 2:
                raise ValueError(f"chunk of {x.shape[0]} is too small")
            return x * 2

    dp = tandem.DataParallel(FailsOnSmallChunks(), CPU3)
    with pytest.raises(ValueError, match=r"replica 2 on device cpu raised ValueError: chunk of 1") as info:
        dp(torch.randn(7, 2))       # chunks of 3, 3 and 1
    assert isinstance(info.value.__cause__, ValueError)   # the original, with its traceback

    class NeedsTwoArgs(Exception):
        def __init__(self, a, b):
            super().__init__(a, b)

    class Fails(nn.Module):
        def forward(self, x):
            raise NeedsTwoArgs(1, 2)

    with pytest.raises(RuntimeError, match=r"replica 0 on device cpu raised NeedsTwoArgs"):
        tandem.DataParallel(Fails(), CPU3)(torch.randn(3, 2))


def test_calls_the_module_directly_without_devices_or_with_one() -> None:
    calls = []

    class Spy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x, k=None):
            calls.append((threading.get_ident(), x.shape[0], k))
            return self.lin(x)

    x = torch.randn(4, 2)
    if not torch.cuda.is_available():
        dp = tandem.DataParallel(Spy())          # no CUDA: torch's behaviour, a plain call
        assert dp.device_ids == [] and dp.output_device is None
        assert torch.equal(dp(x, k=3), dp.module(x))
        assert calls[0] == (threading.get_ident(), 4, 3)
    calls.clear()
    one = tandem.DataParallel(Spy(), ["cpu"])
    assert torch.equal(one(x, k=1), one.module(x))
    assert calls[0] == (threading.get_ident(), 4, 1)
    assert list(one.state_dict()) == ["module.lin.weight", "module.lin.bias"]


def test_module_on_the_wrong_device_is_named() -> None:
    dp = tandem.DataParallel(nn.Linear(2, 2), ["meta", "cpu"])
    with pytest.raises(RuntimeError, match=r"parameter 'weight' is on cpu, .* device_ids\[0\] = meta"):
        dp(torch.randn(4, 2))


# The building blocks, one at a time.

def test_scatter_splits_nested_structures_and_copies_the_rest() -> None:
    devices = [torch.device("cpu")] * 3
    x = torch.arange(7.0)
    box = Box(torch.zeros(7, 2), torch.ones(7, 2), label="L")
    pieces = scatter((x, [x, "s"], {"a": x, "b": 1}, Point(x, None), box, (), {}), devices)
    assert len(pieces) == 3
    for piece, chunk in zip(pieces, x.chunk(3)):
        px, (lx, s), d, pt, b, empty_tuple, empty_dict = piece
        assert torch.equal(px, chunk) and torch.equal(lx, chunk) and s == "s"
        assert torch.equal(d["a"], chunk) and d["b"] == 1
        assert isinstance(pt, Point) and torch.equal(pt.x, chunk) and pt.y is None
        assert isinstance(b, Box) and b.label == "L" and b.lo.shape == (len(chunk), 2)
        assert b.area == 2 * len(chunk)       # recomputed by __post_init__
        assert empty_tuple == () and empty_dict == {}
    assert len(scatter(torch.arange(2.0), devices)) == 2
    assert scatter("text", devices) == ["text"] * 3


def test_scatter_kwargs_never_leaves_a_replica_without_inputs() -> None:
    devices = [torch.device("cpu")] * 3
    args, kwargs = scatter_kwargs((torch.arange(2.0),), {"flag": True}, devices)
    assert len(args) == len(kwargs) == 2 and all(kw == {"flag": True} for kw in kwargs)
    args, kwargs = scatter_kwargs((), {"x": torch.arange(5.0)}, devices)
    assert args == ((), (), ()) and [len(kw["x"]) for kw in kwargs] == [2, 2, 1]


def test_gather_joins_nested_outputs() -> None:
    cpu = torch.device("cpu")
    outs = [{"t": torch.full((n, 2), float(n)), "p": Point(torch.ones(n), None), "k": n}
            for n in (3, 1)]
    joined = gather(outs, cpu)
    assert joined["t"].shape == (4, 2) and joined["p"].x.shape == (4,) and joined["p"].y is None
    assert joined["k"] == [3, 1]
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        assert torch.equal(gather([torch.tensor(1.0), torch.tensor(2.0)], cpu), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="different keys"):
        gather([{"a": torch.ones(1)}, {"b": torch.ones(1)}], cpu)


def _tensor(module: nn.Module, path: str) -> torch.Tensor:
    """The tensor at ``path`` ("head.weight") of ``module``: a parameter or buffer, or a replica's copy of one."""
    owner, _, name = path.rpartition(".")
    tensor = getattr(module.get_submodule(owner), name)
    assert isinstance(tensor, torch.Tensor)
    return tensor


def test_replicas_share_parameters_and_copy_buffers() -> None:
    """See Note [replica sharing] in tandem/dp/replicate.py."""
    model = Nested()
    cpu = torch.device("cpu")
    r0, r1 = replicate(model, [cpu, cpu])
    head = _tensor(model, "head.weight")
    assert _tensor(r0, "head.weight") is head and _tensor(r1, "head.weight") is head
    assert _tensor(r1, "back.weight") is _tensor(r1, "head.weight")  # tying kept
    assert r0.offset is model.offset
    assert r1.offset is not model.offset and torch.equal(_tensor(r1, "offset"), _tensor(model, "offset"))
    assert r0 is not model and r0.proj is not model.proj
    assert model._parameters is not r0._parameters and model._modules is not r0._modules


def test_replicas_on_another_device_get_differentiable_copies() -> None:
    """The meta device stands in for a second GPU: it has no data, but copies to it
    are real copies with a place in the autograd graph."""
    model = Nested()
    cpu, meta = torch.device("cpu"), torch.device("meta")
    r0, r1, r2 = replicate(model, [cpu, meta, meta])
    w0, w1, w2 = (_tensor(r, "head.weight") for r in (r0, r1, r2))
    assert w0 is model.head.weight
    assert w1.device == meta and w1.grad_fn is not None and w1 is w2   # one copy per device
    assert _tensor(r1, "back.weight") is w1                             # tying kept
    assert r1.offset.device == meta and r1.offset is not r2.offset     # buffers: one per replica
    detached = replicate(model, [cpu, meta], detach=True)[1]
    copy_of_head = _tensor(detached, "head.weight")
    assert copy_of_head.device == meta and copy_of_head.grad_fn is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replicas_on_cuda_and_cpu() -> None:
    """Replicas on different devices get differentiable copies of the parameters."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT)).cuda()
    dp = tandem.DataParallel(copy.deepcopy(plain), ["cuda:0", "cpu", "cuda:0"])
    x = torch.randn(7, IN, device="cuda")
    ref, out = plain(x), dp(x)
    assert out.device == torch.device("cuda", 0) and (ref - out).abs().max() <= 1e-5
    ref.square().sum().backward()
    out.square().sum().backward()
    for p, q in zip(plain.parameters(), dp.module.parameters()):
        assert (grad_of(p) - grad_of(q)).abs().max() <= 1e-5
