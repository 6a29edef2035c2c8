"""Pure bucket planning: which parameters share a flat gradient buffer, and where.

Nothing here touches a process group, a hook or a tensor's storage; the plan is a
function of names, sizes, dtypes, devices, an order and byte caps, so it can be
tested with grids of sizes in one process, and ZeRO can shard the same layout.

# Note [bucket order]
Gradients become ready roughly in reverse registration order (the last layer's
first), so buckets are filled in that order and launched in index order. Every
rank must launch the same buckets in the same order (gloo and nccl match
collectives by issue order), so the order is a plan input that all ranks agree
on: the reverse registration order at construction, and later the order in which
rank 0 saw gradients arrive (broadcast to all ranks, see reducer.py).

# Note [flat buffer layout]
All buckets of one (device, dtype) live in one contiguous flat tensor, one slice
per bucket, in bucket order. Inside a bucket, parameters sit back to back in
fill order. Each bucket's slice is padded to a multiple of ``pad_to`` elements
(the world size), so that ZeRO can reduce-scatter a bucket into equal per-rank
shards of the same buffer (as Megatron-LM's param-and-grad buffer does). A bucket
may reserve ``extra`` trailing elements before the padding for control values
that travel with its reduction (see Note [missing-gradient flag] in reducer.py).

# Note [solo buckets]
Torch's assignment packs parameters into buckets up to the cap, so a large
parameter shares its bucket with its neighbours and its gradient is copied into
the bucket and back. With ``solo_bytes`` (DDP's plain path, Note [in-place
reduction] in reduction.py), a parameter of at least that size gets a bucket of
its own whatever the cap, which the reducer all-reduces on ``param.grad`` itself:
two passes over its memory saved, for one more collective whose latency (tens
to hundreds of microseconds on gloo) is small against reducing 4 MiB or more.
The other parameters are bucketed as torch would among themselves. The bucket
holding the control elements must be launched last (its flag is only known at
the end of backward); when the bucket that fills last is a solo one, the last
shared bucket is moved after it instead, so that the solo can stay in place.
A solo bucket is not part of the flat buffer: its own staging tensor is
allocated only if a step ever needs it (a gradient that cannot be reduced in
place), so that a large parameter's gradient is held once, as in torch.

On an accelerator the trade is different: the two passes are cheap for the
GPU (over a 9 MiB gradient about 6 us of an H100's time), while each collective
costs the host: on an H100, NCCL's all-reduce took about 60 us of the
autograd thread per launch, where DDP's gradient hooks run. GPT-2 small with
4 MiB solo buckets made 40 collectives a backward (37 solo) where torch's DDP
makes about 20, and that host work left the GPU idle (BENCHMARKS.md, "On a GPU").
So off the CPU a parameter is solo only from the bucket cap up, a size torch
would give a bucket of its own too (``solo_threshold``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["ParamInfo", "BucketSpec", "BucketPlan", "plan_buckets", "plan_ddp_buckets", "DEFAULT_FIRST_BUCKET_BYTES",
           "DEFAULT_BUCKET_CAP_MB", "FLAG_SLOTS", "SOLO_BYTES", "solo_threshold"]

DEFAULT_BUCKET_CAP_MB = 25
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES
FLAG_SLOTS = 1  # control elements in the last bucket: Note [missing-gradient flag] in reducer.py
SOLO_BYTES = 4 * 1024 * 1024  # Note [solo buckets]: on the CPU; see solo_threshold
_MB = 1024 * 1024


@dataclass(frozen=True)
class ParamInfo:
    """What planning needs to know about one parameter."""

    name: str
    numel: int
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        return self.numel * _element_size(self.dtype)


@dataclass(frozen=True)
class BucketSpec:
    """One bucket: a slice ``[buffer_offset, buffer_offset + padded_numel)`` of the
    flat buffer of its (device, dtype)."""

    index: int
    params: tuple[int, ...]          # parameter indices, in fill order
    offsets: tuple[int, ...]         # element offset of each parameter inside the bucket
    numel: int                       # elements used by parameters
    extra: int                       # reserved control elements after the parameters
    padded_numel: int                # numel + extra rounded up to a multiple of pad_to
    dtype: torch.dtype
    device: torch.device
    buffer_offset: int               # where the bucket starts in its flat buffer
    solo: bool = False               # a solo bucket: in no flat buffer (Note [solo buckets])

    @property
    def nbytes(self) -> int:
        return self.padded_numel * _element_size(self.dtype)


@dataclass(frozen=True)
class BucketPlan:
    buckets: tuple[BucketSpec, ...]
    buffer_numel: dict[tuple[torch.device, torch.dtype], int]  # total size of each flat buffer

    def bucket_of(self) -> dict[int, tuple[int, int]]:
        """param index -> (bucket index, position inside the bucket)."""
        return {p: (b.index, pos) for b in self.buckets for pos, p in enumerate(b.params)}

    def describe(self) -> str:
        sizes = [b.nbytes for b in self.buckets]
        if not sizes:
            return "0 buckets"
        return (f"{sum(len(b.params) for b in self.buckets)} params in {len(sizes)} buckets, "
                f"first {_fmt_bytes(sizes[0])}, largest {_fmt_bytes(max(sizes))}")


def cap_bytes_from_mb(bucket_cap_mb: float | None,
                      bucket_cap_mb_list: Sequence[float] | None = None) -> list[int]:
    """Byte caps per bucket index, as torch derives them: with no cap given, a
    small first bucket (1 MiB) so that the first reduction starts early, then
    25 MiB; with a cap given, that cap for every bucket; with a list, one cap per
    bucket (the last repeated)."""
    if bucket_cap_mb_list:
        if any(c <= 0 for c in bucket_cap_mb_list):
            raise ValueError(f"bucket_cap_mb_list must be positive, got {list(bucket_cap_mb_list)}")
        return [max(1, int(c * _MB)) for c in bucket_cap_mb_list]
    if bucket_cap_mb is None:
        return [DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * _MB]
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    return [max(1, int(bucket_cap_mb * _MB))]


def plan_buckets(params: Sequence[ParamInfo], order: Sequence[int], caps: Sequence[int], *,
                 pad_to: int = 1, last_bucket_extra: int = 0,
                 solo_bytes: int | Mapping[str, int] | None = None) -> BucketPlan:
    """Assign parameters to buckets.

    Args:
        params: all parameters that need gradient reduction, by index.
        order: the fill order, a permutation of ``range(len(params))``
            (see Note [bucket order]).
        caps: byte caps; bucket k of a (device, dtype) closes once it holds at
            least ``caps[min(k, len(caps) - 1)]`` bytes. A parameter larger than
            the cap gets a bucket of its own.
        pad_to: each bucket's size is rounded up to a multiple of this.
        last_bucket_extra: control elements reserved in the bucket launched last.
        solo_bytes: a parameter of at least this many bytes gets a bucket of its
            own, without closing or counting toward the others (Note [solo
            buckets]); a mapping: per device type; None: torch's assignment.

    Returns:
        A plan whose buckets are numbered in launch order: by the position in
        ``order`` of their last parameter, i.e. the order in which they fill.
    """
    if sorted(order) != list(range(len(params))):
        raise ValueError(f"order must be a permutation of range({len(params)}), got {list(order)}")
    if not caps or min(caps) <= 0:
        raise ValueError(f"caps must be a non-empty list of positive byte counts, got {list(caps)}")
    if pad_to < 1:
        raise ValueError(f"pad_to must be >= 1, got {pad_to}")

    open_buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    open_bytes: dict[tuple[torch.device, torch.dtype], int] = {}
    closed_count: dict[tuple[torch.device, torch.dtype], int] = {}
    groups: list[list[int]] = []  # closed and open buckets, in creation order
    solos: set[int] = set()
    for idx in order:
        p = params[idx]
        solo_at = solo_bytes.get(p.device.type) if isinstance(solo_bytes, Mapping) else solo_bytes
        if solo_at is not None and p.nbytes >= solo_at:
            groups.append([idx])
            solos.add(idx)
            continue
        key = (p.device, p.dtype)
        if key not in open_buckets:
            open_buckets[key] = []
            open_bytes[key] = 0
            groups.append(open_buckets[key])
        open_buckets[key].append(idx)
        open_bytes[key] += p.nbytes
        k = closed_count.get(key, 0)
        if open_bytes[key] >= caps[min(k, len(caps) - 1)]:
            closed_count[key] = k + 1
            del open_buckets[key]

    # Launch order = completion order when gradients arrive in fill order: by the
    # position of each bucket's last parameter. (With one dtype this is also the
    # order of first parameters; with several, a bucket that closes early is not
    # held back behind one of another dtype that opened earlier but fills later.)
    position = {idx: pos for pos, idx in enumerate(order)}
    groups.sort(key=lambda g: position[g[-1]])
    if last_bucket_extra and groups and groups[-1][0] in solos:
        # Note [solo buckets]: the control elements go to the last shared bucket,
        # launched last, so that every solo bucket can be reduced in place.
        shared = [k for k, g in enumerate(groups) if g[0] not in solos]
        if shared:
            groups.append(groups.pop(shared[-1]))

    buckets = []
    fill: dict[tuple[torch.device, torch.dtype], int] = {}
    for b, members in enumerate(groups):
        first = params[members[0]]
        key = (first.device, first.dtype)
        offsets, numel = [], 0
        for idx in members:
            offsets.append(numel)
            numel += params[idx].numel
        extra = last_bucket_extra if b == len(groups) - 1 else 0
        padded = -(-(numel + extra) // pad_to) * pad_to
        solo = members[0] in solos and not extra
        start = 0 if solo else fill.get(key, 0)
        buckets.append(BucketSpec(index=b, params=tuple(members), offsets=tuple(offsets),
                                  numel=numel, extra=extra, padded_numel=padded,
                                  dtype=first.dtype, device=first.device, buffer_offset=start, solo=solo))
        if not solo:
            fill[key] = start + padded
    return BucketPlan(buckets=tuple(buckets), buffer_numel=fill)


def plan_ddp_buckets(params: Sequence[ParamInfo], order: Sequence[int], caps: Sequence[int], world_size: int,
                     *, zero: bool, gradient_as_bucket_view: bool, check_finite: bool) -> BucketPlan:
    """The plan tandem's DDP makes (GradReducer): buckets padded to the world size,
    the flag in the last, and solo buckets only where in-place reduction can apply
    (Note [solo buckets]; not under ZeRO, gradient_as_bucket_view or check_finite)."""
    solo = None if (zero or gradient_as_bucket_view or check_finite) else \
        {p.device.type: solo_threshold(p.device, caps) for p in params}
    return plan_buckets(params, order, caps, pad_to=world_size, last_bucket_extra=FLAG_SLOTS, solo_bytes=solo)


def solo_threshold(device: torch.device, caps: Sequence[int]) -> int:
    """The bytes from which a parameter on ``device`` gets a solo bucket (Note
    [solo buckets]): SOLO_BYTES on the CPU, the bucket cap on an accelerator."""
    return SOLO_BYTES if device.type == "cpu" else max(SOLO_BYTES, caps[-1])


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _fmt_bytes(n: int) -> str:
    if n >= _MB:
        return f"{n / _MB:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} B"
