"""Construction-time agreement: every rank holds the same model, and starts from
rank 0's values."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from tandem._compat import preserve_version_counters
from tandem.comm.group import GroupComm

__all__ = ["check_same_model_on_all_ranks", "broadcast_module_state", "model_signature"]

Entry = tuple[str, str, tuple[int, ...], str, bool]  # kind, name, shape, dtype, requires_grad

# Like torch, initial state is broadcast in chunks so that a large model is not
# flattened into one huge temporary.
_BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


def model_signature(named_params: Sequence[tuple[str, torch.Tensor]],
                    named_buffers: Sequence[tuple[str, torch.Tensor]]) -> list[Entry]:
    sig: list[Entry] = [("parameter", n, tuple(p.shape), str(p.dtype), bool(p.requires_grad))
                        for n, p in named_params]
    sig += [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in named_buffers]
    return sig


def check_same_model_on_all_ranks(signature: list[Entry], comm: GroupComm) -> None:
    """Raise the same ValueError on every rank if the signatures differ.

    One small all-gather of a digest in the common case; the full signatures are
    gathered only when the digests differ, to name the first difference.
    """
    digest = hashlib.sha256(repr(signature).encode()).digest()
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(torch.int64)
    digests = comm.all_gather(mine.to(comm.device), tag="model check")
    if all(torch.equal(d, digests[0]) for d in digests):
        return
    everyone = comm.all_gather_object(signature, tag="model check")
    raise ValueError(f"rank {comm.rank}: " + describe_first_difference(everyone))


def describe_first_difference(signatures: list[list[Entry]]) -> str:
    """Name the first parameter or buffer on which the ranks disagree, and how."""
    longest = max(len(s) for s in signatures)
    for k in range(longest):
        entries = [s[k] if k < len(s) else None for s in signatures]
        if all(e == entries[0] for e in entries):
            continue
        by_value: dict[str, list[int]] = {}
        for rank, e in enumerate(entries):
            by_value.setdefault(_describe_entry(e), []).append(rank)
        variants = "; ".join(f"{desc} on ranks {ranks}" for desc, ranks in by_value.items())
        counts = sorted({len(s) for s in signatures})
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
    rg = "" if kind == "buffer" else f", requires_grad={requires_grad}"
    return f"{kind} '{name}' of shape {tuple(shape)} and {dtype.replace('torch.', '')}{rg}"


def broadcast_module_state(tensors: Sequence[torch.Tensor], comm: GroupComm, *, src: int) -> None:
    """Overwrite ``tensors`` with group rank ``src``'s values, coalesced into few collectives."""
    chunk: list[torch.Tensor] = []
    size = 0
    with torch.no_grad(), preserve_version_counters(tensors):
        for t in tensors:
            chunk.append(t)
            size += t.numel() * t.element_size()
            if size >= _BROADCAST_CHUNK_BYTES:
                comm.broadcast_coalesced(chunk, src, tag="module state")
                chunk, size = [], 0
        if chunk:
            comm.broadcast_coalesced(chunk, src, tag="module state")
