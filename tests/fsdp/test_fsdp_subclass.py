"""Parameters whose tensor subclass gathers itself (torch's FSDP2 all-gather
extension, ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``: Note
[tensor-subclass gathers] in tandem/fsdp/unit_params.py) under
``tandem.fully_shard``, against torch's own ``fully_shard`` running the same
script.

The subclasses are defined here, on CPU: :class:`RowScaledTensor` sends its
shard as bfloat16 values plus one float32 scale per row (two tensors and a
metadata object), :class:`LegacyRowScaledTensor` the same through the 1-argument
``fsdp_pre_all_gather(mesh)``, :class:`PaddingBF16Tensor` (torch's test's
``BFloat16AllGatherTensor``) one bfloat16 tensor that pads itself on a rank
holding fewer rows, and :class:`PairTensor` (torch's test's ``TwoTensor``) whose
unsharded parameter is itself a subclass over the gathered outputs. One spawned
group of 2 gloo ranks trains every case (``reshard_after_forward`` True and
False, ``param_dtype=bfloat16``, ``CPUOffloadPolicy``) with both
implementations and returns losses, shards, the extension's calls and the
ledger's bytes; the tests compare them.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from test_fsdp import fully_shard_of
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.utils._python_dispatch import return_and_correct_aliasing

from tandem.testing import as_dtensor, prefixed, raised_by, run_distributed

WORLD = 2
STEPS = 4
CALLS: dict[str, int] = {}  # the extension's calls in this process, by kind


class _Wrapper(torch.Tensor):
    """A tensor holding a plain ``_data``; every op runs on it and wraps its result."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Any:
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, data.stride(), data.storage_offset(),
                                                   dtype=data.dtype, device=data.device)

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    @classmethod  # torch's stubs declare Tensor.__torch_dispatch__ a plain function, not a classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        out = func(*pytree.tree_map_only(cls, lambda x: x._data, args),
                   **pytree.tree_map_only(cls, lambda x: x._data, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, outer_size: Any, outer_stride: Any) -> torch.Tensor:
        return inner["_data"]

    def __repr__(self) -> str:  # type: ignore[override]  # mypy takes no typed override of torch's untyped one
        return f"{type(self).__name__}({self._data})"


def _finish_post(tensor: torch.Tensor, param_dtype: torch.dtype, out: torch.Tensor | None,
                 sent: tuple[torch.Tensor, ...]) -> Any:
    """The common end of the subclasses' ``fsdp_post_all_gather``."""
    if out is not None:
        CALLS["post_out"] = CALLS.get("post_out", 0) + 1
        # out is a leaf that requires grad, and the padded output's first rows (torch's
        # test's BFloat16AllGatherTensor copies all of them: pytorch#154836)
        with torch.no_grad(), _unsafe_preserve_version_counter(out):
            out.copy_(tensor[:out.size(0)])
        return None
    CALLS["post_new"] = CALLS.get("post_new", 0) + 1
    full = tensor.to(param_dtype)
    return full, (*sent, full)


class RowScaledTensor(_Wrapper):
    """Gathers bfloat16 values and one float32 scale per row, with a metadata dict."""

    def _send(self) -> tuple[tuple[torch.Tensor, torch.Tensor], dict]:
        CALLS["pre"] = CALLS.get("pre", 0) + 1
        scale = self._data.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        return ((self._data / scale).to(torch.bfloat16), scale), {"scheme": "row-scaled bf16"}

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: nn.Module, mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        assert mesh.ndim == 1 and mesh.size() == WORLD, mesh
        assert outer_size[1:] == self.shape[1:] and outer_stride == (outer_size[1], 1), (outer_size, outer_stride)
        assert isinstance(module, nn.Linear), type(module)
        CALLS[f"policy {mp_policy.param_dtype}"] = 1
        return self._send()

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype,
                             *, out: torch.Tensor | None = None) -> Any:
        assert metadata == {"scheme": "row-scaled bf16"}, metadata
        values, scale = outputs
        assert values.dtype == torch.bfloat16 and scale.dtype == torch.float32, (values.dtype, scale.dtype)
        return _finish_post(values.float() * scale, param_dtype, out, outputs)


class LegacyRowScaledTensor(RowScaledTensor):
    """:class:`RowScaledTensor` through the legacy ``fsdp_pre_all_gather(mesh)``."""

    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:  # type: ignore[override]
        CALLS["legacy"] = 1
        return self._send()


class PaddingBF16Tensor(_Wrapper):
    """torch's test's ``BFloat16AllGatherTensor``: one bfloat16 tensor, padded
    to the full chunk by the subclass on a rank holding fewer rows."""

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: nn.Module, mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        CALLS["pre"] = CALLS.get("pre", 0) + 1
        rows = math.ceil(outer_size[0] / mesh.size())
        padded = torch.zeros((rows, *outer_size[1:]), dtype=torch.bfloat16, device=self.device)
        padded[:self._data.size(0)].copy_(self._data)
        return (padded,), None

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype,
                             *, out: torch.Tensor | None = None) -> Any:
        (tensor,) = outputs
        return _finish_post(tensor, param_dtype, out, outputs)


class FailingTensor(_Wrapper):
    """A ``fsdp_pre_all_gather`` that raises (on every rank, so none waits)."""

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: nn.Module, mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        raise ValueError("no scale for this tensor")

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype,
                             *, out: torch.Tensor | None = None) -> Any:
        raise AssertionError("not reached")


class HalfDefinedTensor(_Wrapper):
    """Only ``fsdp_post_all_gather``: torch's FSDP2 requires the pair."""

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype,
                             *, out: torch.Tensor | None = None) -> Any:
        raise AssertionError("not reached")


class PairTensor(torch.Tensor):
    """torch's test's ``TwoTensor`` with its extension: two plain tensors ``a``
    and ``b``, every op run on each; both are gathered, and the unsharded
    parameter is a ``PairTensor`` over the gathered outputs themselves, so a
    later gather's ``out=`` finds its data already there."""

    a: torch.Tensor
    b: torch.Tensor

    @staticmethod
    def __new__(cls, a: torch.Tensor, b: torch.Tensor) -> Any:
        return torch.Tensor._make_wrapper_subclass(cls, a.shape, a.stride(), a.storage_offset(), dtype=a.dtype,
                                                   device=a.device, requires_grad=a.requires_grad)

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b

    @classmethod  # as above
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        a, b = (lambda x: x.a), (lambda x: x.b)
        out_a = func(*pytree.tree_map_only(cls, a, args), **pytree.tree_map_only(cls, a, kwargs))
        out_b = func(*pytree.tree_map_only(cls, b, args), **pytree.tree_map_only(cls, b, kwargs))
        leaves_a, spec = pytree.tree_flatten(out_a)
        leaves_b = pytree.tree_leaves(out_b)
        out = pytree.tree_unflatten([cls(x, y) if isinstance(x, torch.Tensor) else x
                                     for x, y in zip(leaves_a, leaves_b)], spec)
        return return_and_correct_aliasing(func, args, kwargs, out)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["a", "b"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, outer_size: Any, outer_stride: Any) -> torch.Tensor:
        return PairTensor(inner["a"], inner["b"])

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: nn.Module, mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        CALLS["pre"] = CALLS.get("pre", 0) + 1
        return (self.a, self.b), None

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype,
                             *, out: torch.Tensor | None = None) -> Any:
        a, b = outputs
        if out is not None:
            CALLS["post_out"] = CALLS.get("post_out", 0) + 1
            assert isinstance(out, PairTensor) and a.dtype == param_dtype
            assert a.untyped_storage().data_ptr() == out.a.untyped_storage().data_ptr()
            assert b.untyped_storage().data_ptr() == out.b.untyped_storage().data_ptr()
            return None
        CALLS["post_new"] = CALLS.get("post_new", 0) + 1
        return PairTensor(a, b), (a, b)


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a plain tensor (a DTensor's local shard)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    if isinstance(t, PairTensor):
        return t.a
    return t._data if isinstance(t, _Wrapper) else t


# ---------------------------------------------------------------------- the model and its training

class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden)
        self.out_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


def _model(cls: type[torch.Tensor], dim: int, hidden: int) -> nn.Sequential:
    """Three MLPs whose weights are ``cls`` parameters (biases plain)."""
    torch.manual_seed(0)
    mlps = [MLP(dim, hidden) for _ in range(3)]
    for mlp in mlps:
        for lin in (mlp.in_proj, mlp.out_proj):
            w = lin.weight.detach()
            lin.weight = nn.Parameter(PairTensor(w.clone(), w.clone()) if cls is PairTensor else cls(w.clone()))
    return nn.Sequential(*mlps)


def _shard(model: nn.Sequential, impl: str, **kwargs: Any) -> None:
    if kwargs.get("offload_policy") == "cpu":  # CASES names it; the policy is made in the rank
        from torch.distributed.fsdp import CPUOffloadPolicy
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    shard = fully_shard_of(impl, min_unit_bytes=0)  # torch's units
    for mlp in model:
        shard(mlp, **kwargs)
    shard(model, **kwargs)


def _train(rank: int, impl: str, cls: type[torch.Tensor], dim: int = 8, hidden: int = 16, **kwargs: Any) -> dict:
    """Train ``STEPS`` steps; this rank's losses, shards, the extension's calls
    and (tandem) the bytes each unit's gathers sent in the last step."""
    from tandem.comm.monitor import current_monitor

    CALLS.clear()
    model = _model(cls, dim, hidden)
    _shard(model, impl, **kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    gen = torch.Generator().manual_seed(1 + rank)
    ledger = current_monitor().ledger
    losses, first = [], 0
    for step in range(STEPS):
        first = ledger.issued
        x = torch.randn(4, dim, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        losses.append(plain(loss.detach()))
    sent = [(e.op, e.tag, e.nbytes) for e in ledger.entries() if e.seq > first and e.op == "all_gather_into"]
    return {"losses": torch.stack(losses), "shards": {n: plain(p).clone() for n, p in model.named_parameters()},
            "types": {n: type(as_dtensor(p).to_local()).__name__ for n, p in model.named_parameters()},
            "calls": dict(CALLS), "gathers": sent}


def _refusals(rank: int) -> dict:
    from tandem.fsdp import fully_shard

    def failing_pre() -> None:
        model = _model(FailingTensor, 8, 16)
        _shard(model, "tandem")
        model(torch.randn(2, 8))

    def group_shard() -> None:
        # reshard_after_forward=k needs 1 < k < world, more than 2 ranks: the
        # post-forward reshard it makes is called here over the whole group.
        from tandem.fsdp.unit import unit_of

        model = _model(RowScaledTensor, 8, 16)
        _shard(model, "tandem")
        model(torch.randn(2, 8))
        unit = unit_of(model[0])
        assert unit is not None
        unit.unshard()
        unit.group_comm = unit.comm
        unit.reshard(keep_group_shard=True)

    def half_defined() -> None:
        lin = nn.Linear(4, 4)
        lin.weight = nn.Parameter(HalfDefinedTensor(lin.weight.detach().clone()))
        fully_shard(lin)

    return raised_by({"failing_pre": failing_pre, "group_shard": group_shard, "half_defined": half_defined})


CASES: dict[str, tuple[type[torch.Tensor], dict]] = {
    "reshard": (RowScaledTensor, {"reshard_after_forward": True}),
    "keep": (RowScaledTensor, {"reshard_after_forward": False}),
    "legacy": (LegacyRowScaledTensor, {"reshard_after_forward": True}),
    "uneven": (PaddingBF16Tensor, {"dim": 3, "hidden": 9, "reshard_after_forward": True}),
    "pair": (PairTensor, {"reshard_after_forward": True}),
    "offload": (RowScaledTensor, {"offload_policy": "cpu"}),
}


def _worker(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out: dict[str, Any] = {}
    for name, (cls, kwargs) in CASES.items():
        out[name] = {impl: _train(rank, impl, cls, **kwargs) for impl in ("tandem", "torch")}
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out["bf16"] = {impl: _train(rank, impl, RowScaledTensor, mp_policy=bf16) for impl in ("tandem", "torch")}
    out["refusals"] = _refusals(rank)
    return out


@functools.cache
def _results() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout=300)


# ---------------------------------------------------------------------- the tests

@pytest.mark.parametrize("case", [*CASES, "bf16"])
def test_training_equals_torchs_fsdp2(case: str) -> None:
    tol: dict[str, Any] = {"atol": 2e-3, "rtol": 2e-3} if case == "bf16" else {"atol": 1e-5, "rtol": 1e-5}
    for rank, result in enumerate(_results()):
        ours, torchs = result[case]["tandem"], result[case]["torch"]
        torch.testing.assert_close(ours["losses"], torchs["losses"], **tol, msg=prefixed(f"rank {rank}"))
        assert ours["shards"].keys() == torchs["shards"].keys()
        for name, shard in ours["shards"].items():
            torch.testing.assert_close(shard, torchs["shards"][name], **tol, msg=prefixed(f"rank {rank}, {name}"))
        assert ours["types"] == torchs["types"]  # the weights' shards are still the subclass
        assert any(t != "Tensor" for t in ours["types"].values())


@pytest.mark.parametrize("case", [*CASES, "bf16"])
def test_the_extension_is_called_as_torch_calls_it(case: str) -> None:
    """The same number of pre calls, of first posts (one per parameter, which
    make the unsharded parameter) and of posts filling ``out=``."""
    for result in _results():
        ours, torchs = result[case]["tandem"]["calls"], result[case]["torch"]["calls"]
        assert ours == torchs
        assert ours["post_new"] == 6 and ours["post_out"] > 0
        assert ("legacy" in ours) == (case == "legacy")
    assert "policy torch.bfloat16" in _results()[0]["bf16"]["tandem"]["calls"]


def test_the_gather_sends_the_subclasss_payload() -> None:
    """Each unit's weights travel as bfloat16 values and float32 row scales
    (their own gather), its biases in float32 (the plain one): not the float32
    weights."""
    dim, hidden = 8, 16
    weight_bytes = 2 * (hidden * dim // WORLD) * 2 + (hidden // WORLD + dim // WORLD) * 4  # bf16 + scales
    bias_bytes = (hidden // WORLD + dim // WORLD) * 4
    for rank, result in enumerate(_results()):
        for case in ("reshard", "keep"):
            sent = result[case]["tandem"]["gathers"]
            subclass = [n for _, tag, n in sent if tag.endswith(" subclasses")]
            flat = [n for _, tag, n in sent if not tag.endswith(" subclasses")]
            gathers = 2 if case == "reshard" else 1  # forward and backward, or forward only
            assert subclass == [weight_bytes] * (3 * gathers), (rank, case, sent)
            assert flat == [bias_bytes] * (3 * gathers), (rank, case, sent)
            assert weight_bytes < 2 * hidden * dim // WORLD * 4  # under the float32 weights' bytes


def test_a_failing_hook_names_the_parameter_the_rank_and_the_fix() -> None:
    for rank, result in enumerate(_results()):
        refusals = result["refusals"]
        kind, message = refusals["failing_pre"]
        assert kind == "ValueError"
        assert f"rank {rank}:" in message and "unit '0'" in message and "'in_proj.weight'" in message
        assert "fsdp_pre_all_gather" in message and "no scale for this tensor" in message
        assert "Fix the subclass" in message
        kind, message = refusals["group_shard"]
        assert kind == "NotImplementedError" and f"rank {rank}:" in message and "'in_proj.weight'" in message
        assert "reshard_after_forward=True or False" in message
        kind, message = refusals["half_defined"]
        assert kind == "TypeError" and "'weight'" in message and "define both" in message
