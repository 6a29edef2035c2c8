"""A thin, typed view of one process group: the only way tandem's DDP and ZeRO
issue collectives.

Holding the group in an instance (rather than calling ``torch.distributed`` with
``group=None`` everywhere) keeps the process group explicit, and gives tests one
place to observe every collective: append a callable to ``observers`` and it is
called with a :class:`CollectiveEvent` before each collective is issued.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CollectiveEvent", "GroupComm", "Work"]

# torch 2.13 renamed the tensor forms of these collectives (the old names warn);
# torch 2.4 has only the old ones.
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class CollectiveEvent:
    """One collective as issued by this rank."""

    op: str            # "all_reduce", "broadcast", "all_gather", ...
    numel: int         # elements sent by this rank
    dtype: torch.dtype | None
    tag: str           # who issued it and why: "bucket 3", "buffers", ...


class Work:
    """An async collective's handle; ``wait()`` blocks until it completed."""

    __slots__ = ("_work",)

    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()

    def is_completed(self) -> bool:
        """Whether the collective has completed (a synchronous one always has)."""
        return self._work is None or self._work.is_completed()

    def get_future(self) -> torch.futures.Future:
        """A future completed with the collective's output tensors (a list), for
        communication hooks that chain work on the result (async collectives only)."""
        if self._work is None:
            raise RuntimeError("a synchronous collective has no future: issue it with async_op=True")
        return self._work.get_future()


class GroupComm:
    """Collectives over one process group (the default group when ``group`` is None)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call tandem.init() (or "
                "torch.distributed.init_process_group) before building tandem's DDP")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.observers: list[Callable[[CollectiveEvent], None]] = []

    def global_rank(self, group_rank: int) -> int:
        """The global rank of this group's rank ``group_rank``."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def _notify(self, op: str, tensor: torch.Tensor | None, tag: str) -> None:
        if self.observers:
            event = CollectiveEvent(op, 0 if tensor is None else tensor.numel(),
                                    None if tensor is None else tensor.dtype, tag)
            for observe in self.observers:
                observe(event)

    def all_reduce(self, tensor: torch.Tensor, *, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   tag: str = "", async_op: bool = False) -> Work:
        self._notify("all_reduce", tensor, tag)
        return Work(dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, tag: str = "",
                  async_op: bool = False) -> Work:
        """Broadcast from group rank ``src``."""
        self._notify("broadcast", tensor, tag)
        return Work(dist.broadcast(tensor, src=self.global_rank(src), group=self.group,
                                   async_op=async_op))

    def all_gather(self, tensor: torch.Tensor, *, tag: str = "") -> list[torch.Tensor]:
        self._notify("all_gather", tensor, tag)
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor, group=self.group)
        return out

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, tag: str = "",
                       async_op: bool = False) -> Work:
        """Sum ``input`` (``size`` equal chunks) across ranks; this rank's chunk of
        the sum lands in ``output``. ``output`` must not alias ``input``. A group
        of one copies."""
        self._notify("reduce_scatter", input, tag)
        if self.size == 1:
            output.copy_(input)
            return Work(None)
        return Work(_reduce_scatter_tensor(output, input, group=self.group, async_op=async_op))

    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor, *, tag: str = "",
                        async_op: bool = False) -> Work:
        """Concatenate every rank's ``input`` into ``output`` (``size`` times its
        length), in rank order. A group of one copies."""
        self._notify("all_gather_into", input, tag)
        if self.size == 1:
            output.copy_(input)
            return Work(None)
        return Work(_all_gather_into_tensor(output, input, group=self.group, async_op=async_op))

    def all_gather_object(self, obj: Any, *, tag: str = "") -> list[Any]:
        """Gather a picklable object from every rank (slow; for set-up and error paths)."""
        buf = io.BytesIO()
        torch.save(obj, buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        device = self.device
        sizes = self.all_gather(torch.tensor([payload.numel()], device=device), tag=tag)
        longest = int(max(int(s.item()) for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: payload.numel()] = payload.to(device)
        chunks = self.all_gather(padded, tag=tag)
        return [torch.load(io.BytesIO(c[: int(s.item())].cpu().numpy().tobytes()), weights_only=False)
                for c, s in zip(chunks, sizes)]

    def broadcast_coalesced(self, tensors: Sequence[torch.Tensor], src: int = 0, *,
                            tag: str = "") -> None:
        """Broadcast many tensors from ``src`` with one collective per (device, dtype)."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.device, t.dtype), []).append(t)
        for members in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in members])
            self.broadcast(flat, src, tag=tag)
            if self.rank != src:
                with torch.no_grad():
                    offset = 0
                    for t in members:
                        n = t.numel()
                        t.copy_(flat[offset: offset + n].view_as(t))
                        offset += n

    @property
    def device(self) -> torch.device:
        """Where this group's backend wants its tensors: the current CUDA device for nccl."""
        backend = dist.get_backend(self.group)
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
