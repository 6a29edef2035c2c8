"""Agreement checks: at construction, every rank holds the same model and starts
from rank 0's values; at each synchronised step, optionally, the gradients are
finite (the helpers of Note [check_finite] in finite.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from tandem._compat import preserve_version_counters
from tandem.comm.group import GroupComm
from tandem.dtensor import is_distributed, local_tensor

__all__ = ["NonFinite", "NonFiniteReport", "broadcast_module_state", "check_same_model_on_all_ranks",
           "check_tensor_parallel", "model_signature", "nonfinite_mark", "nonfinite_names",
           "signature_digest"]

Entry = tuple[str, str, tuple[int, ...], str, bool]  # kind, name, shape, dtype, requires_grad

# Like torch, initial state is broadcast in chunks so that a large model is not
# flattened into one huge temporary.
_BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


def model_signature(named_params: Sequence[tuple[str, torch.Tensor]],
                    named_buffers: Sequence[tuple[str, torch.Tensor]],
                    options: Mapping[str, Any] | None = None) -> list[Entry]:
    """What must agree across ranks: parameters, buffers, and ``options`` that
    change which collectives a step issues (compared by ``repr``)."""
    sig: list[Entry] = [("parameter", n, tuple(p.shape), str(p.dtype), bool(p.requires_grad))
                        for n, p in named_params]
    sig += [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in named_buffers]
    sig += [("option", n, (), repr(v), False) for n, v in (options or {}).items()]
    return sig


def signature_digest(signature: list[Entry]) -> list[int]:
    """``signature``'s SHA-256 as four int64s: what the ranks compare."""
    digest = hashlib.sha256(repr(signature).encode()).digest()
    return [int.from_bytes(digest[i:i + 8], "little", signed=True) for i in range(0, 32, 8)]


def check_same_model_on_all_ranks(signature: list[Entry], comm: GroupComm,
                                  digests: Sequence[Sequence[int]] | None = None) -> None:
    """Raise the same ValueError on every rank if the signatures differ.

    One small all-gather of a digest in the common case (or none: ``digests``,
    every rank's :func:`signature_digest`, gathered by the caller with numbers of
    its own); the full signatures are gathered only when the digests differ,
    to name the first difference.
    """
    if digests is None:
        mine = torch.tensor(signature_digest(signature), dtype=torch.int64, device=comm.device)
        digests = [d.tolist() for d in comm.all_gather(mine, tag="model check")]
    if all(list(d) == list(digests[0]) for d in digests):
        return
    everyone = comm.all_gather_object(signature, tag="model check")
    raise ValueError(f"rank {comm.rank}: " + describe_first_difference(everyone))


def describe_first_difference(signatures: list[list[Entry]]) -> str:
    """Name the first parameter or buffer on which the ranks disagree, and how;
    options (``model_signature``'s) only when the models agree."""
    model = [[e for e in s if e[0] != "option"] for s in signatures]
    options = [[e for e in s if e[0] == "option"] for s in signatures]
    for part in (model, options):
        longest = max(len(s) for s in part)
        for k in range(longest):
            entries = [s[k] if k < len(s) else None for s in part]
            if all(e == entries[0] for e in entries):
                continue
            by_value: dict[str, list[int]] = {}
            for rank, e in enumerate(entries):
                by_value.setdefault(_describe_entry(e), []).append(rank)
            variants = "; ".join(f"{desc} on ranks {ranks}" for desc, ranks in by_value.items())
            if part is options:
                return (f"DistributedDataParallel needs the same options on every rank, but "
                        f"{variants}. Pass the same arguments on every rank.")
            counts = sorted({len(s) for s in part})
            count_note = (f" (ranks hold different numbers of parameters and buffers: {counts})"
                          if len(counts) > 1 else "")
            return ("DistributedDataParallel needs the same model on every rank, but entry "
                    f"{k} differs: {variants}{count_note}. Build the model identically on "
                    "every rank (same code, same constructor arguments) before wrapping it.")
    raise AssertionError("signatures differ but no entry does")


def _describe_entry(e: Entry | None) -> str:
    if e is None:
        return "nothing"
    kind, name, shape, dtype, requires_grad = e
    if kind == "option":
        return f"option {name}={dtype}"
    rg = "" if kind == "buffer" else f", requires_grad={requires_grad}"
    return f"{kind} '{name}' of shape {tuple(shape)} and {dtype.replace('torch.', '')}{rg}"


def check_tensor_parallel(named_params: Sequence[tuple[str, torch.Tensor]], group_ranks: Sequence[int],
                          rank: int, zero_stage: int) -> None:
    """Raise if DDP over ``group_ranks`` would average different shards of a
    tensor-parallel parameter (Note [tensor-parallel parameters] in
    tandem/dtensor.py): the data-parallel group must hold one rank of each
    tensor-parallel group. ZeRO's flat shards of DTensors are not supported."""
    for name, p in named_params:
        if not is_distributed(p):
            continue
        if zero_stage:
            raise ValueError(
                f"rank {rank}: parameter '{name}' is a tensor-parallel DTensor, which "
                f"DistributedDataParallel(zero_stage={zero_stage}) cannot shard; use zero_stage=0, or "
                "tandem.fully_shard(model, mesh=mesh['dp']) to shard a tensor-parallel model")
        mesh = p.device_mesh  # type: ignore[attr-defined]
        tp_ranks = [int(r) for r in mesh.mesh.flatten().tolist()] if mesh.ndim == 1 else []
        shared = sorted(set(tp_ranks) & set(group_ranks) - {rank})
        if shared:
            raise ValueError(
                f"rank {rank}: parameter '{name}' is sharded by tensor parallelism over ranks {tp_ranks}, "
                f"and DistributedDataParallel's group {list(group_ranks)} also holds ranks {shared}, "
                "which keep other shards of it: averaging them would mix different tensors. Pass "
                "device_mesh=mesh['dp'], the data-parallel dimension of the mesh you parallelised over")
        return  # one parameter's mesh tells: tensor parallelism uses one mesh


def broadcast_module_state(tensors: Sequence[torch.Tensor], comm: GroupComm, *, src: int) -> None:
    """Overwrite ``tensors`` with group rank ``src``'s values, coalesced into few
    collectives. A DTensor's local shard is what is broadcast (Note
    [tensor-parallel parameters] in tandem/dtensor.py)."""
    chunk: list[torch.Tensor] = []
    size = 0
    tensors = [local_tensor(t) for t in tensors]
    with torch.no_grad(), preserve_version_counters(tensors):
        for t in tensors:
            chunk.append(t)
            size += t.numel() * t.element_size()
            if size >= _BROADCAST_CHUNK_BYTES:
                comm.broadcast_coalesced(chunk, src, tag="module state")
                chunk, size = [], 0
        if chunk:
            comm.broadcast_coalesced(chunk, src, tag="module state")


# ---------------------------------------------------------------- finite gradients

class NonFinite(str, Enum):
    """What ``DistributedDataParallel(check_finite=...)`` does when the gradients of
    a synchronised step hold NaN or Inf (Note [check_finite] in finite.py)."""

    RAISE = "raise"  # raise on every rank, naming the ranks and parameters
    SKIP = "skip"    # drop the step's gradients on every rank; ddp.found_nonfinite says so

    @classmethod
    def parse(cls, value: bool | str | NonFinite | None, name: str = "check_finite") -> NonFinite | None:
        """``False``/``None``: no check; ``True``: raise; ``"raise"``, ``"skip"``."""
        if value is None or value is False:
            return None
        if value is True:
            return cls.RAISE
        if isinstance(value, str):
            try:
                return cls(value)
            except ValueError:
                pass
        raise ValueError(f"{name} must be False, True, 'raise' or 'skip', got {value!r}")


def nonfinite_mark(t: torch.Tensor) -> torch.Tensor:
    """A float32 scalar on ``t``'s device: 0 if every element of ``t`` is finite,
    NaN otherwise. One pass over ``t`` and no device sync; min and max of finite
    values are finite, so unlike a sum it cannot overflow into a false alarm."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    lo, hi = torch.aminmax(t.detach().reshape(-1))
    return (lo * 0 + hi * 0).to(torch.float32)  # inf * 0 and nan * 0 are nan


def nonfinite_names(named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """The names whose tensors hold NaN or Inf (one device sync; for error paths)."""
    if not named:
        return []
    bad = torch.stack([nonfinite_mark(t) for _, t in named]).isnan().tolist()
    return [name for (name, _), b in zip(named, bad) if b]


@dataclass(frozen=True)
class NonFiniteReport:
    """Where a synchronised step's non-finite gradients were: the same on every rank."""

    step: int
    """The synchronised backward it happened in, counted from 0."""
    before: tuple[tuple[str, ...], ...] | None
    """Per rank, the parameters whose local gradient was non-finite before
    reduction (None: not gathered, inside ``tandem.join``)."""
    after: tuple[str, ...]
    """The parameters whose reduced gradient is non-finite (under ZeRO, of any
    rank's shard)."""

    @property
    def ranks(self) -> list[int]:
        """The ranks whose own gradients were non-finite."""
        return [r for r, names in enumerate(self.before or ()) if names]

    def describe(self) -> str:
        if self.before is None:
            return (f"non-finite gradient in parameters {_quoted(self.after)} after reduction "
                    f"(step {self.step}; inside tandem.join the ranks are not asked which one)")
        lines = [f"rank {r}: non-finite gradient in parameters {_quoted(self.before[r])} before "
                 f"reduction (step {self.step})" for r in self.ranks]
        if not lines:
            lines = [f"no rank's gradient was non-finite before reduction, but the reduction "
                     f"overflowed in parameters {_quoted(self.after)} (step {self.step}): a "
                     "compressing comm hook's cast, or the sum of very large gradients"]
        return "; ".join(lines)


def _quoted(names: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
