"""A thin, typed view of one process group: the only way tandem's DDP and ZeRO
issue collectives.

Holding the group in an instance (rather than calling ``torch.distributed`` with
``group=None`` everywhere) keeps the process group explicit, and gives tests one
place to observe every collective: append a callable to ``observers`` and it is
called with a :class:`CollectiveEvent` before each collective is issued.

# Note [gloo's reduce-scatter]
gloo has no reduce-scatter of its own: torch's ``reduce_scatter_tensor`` on
gloo clones the whole input and all-reduces the clone (the same bytes on the
wire as an all-reduce: BENCHMARKS.md, "Across nodes"), then copies the rank's
chunk out. The clone is an input's worth of memory held until the wait, and
the call took longer than the all-reduce itself: 43 ms against 28 for 28 MiB
on 2 ranks (one thread each, on this repository's 2-core machine). Where the
output is this rank's chunk of the input (in place), :meth:`GroupComm.reduce_scatter`
on gloo all-reduces the input in place instead: no clone, one collective, the
same bytes, and the chunk holds this rank's sum as asked (the other chunks
hold theirs). The ledger still records a reduce-scatter. ZeRO's buckets and
fully_shard's reduction inputs are such scratch inputs; NCCL keeps its
reduce-scatter, which sends half an all-reduce's bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tandem._compat import all_gather_into_tensor, group_label, reduce_scatter_tensor
from tandem.comm.failure_gate import FailureGate
from tandem.comm.ledger import LedgerEntry
from tandem.comm.monitor import current_monitor
from tandem.comm.peers import Waiter, wait_watching_peers
from tandem.comm.plain_data import decode, gather_payloads

__all__ = ["CollectiveEvent", "GroupComm", "Work"]



_DTYPE_NAMES = {dt: str(dt).removeprefix("torch.") for dt in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.uint8, torch.int8, torch.bool)}


@dataclass(frozen=True)
class CollectiveEvent:
    """One collective as issued by this rank."""

    op: str            # "all_reduce", "broadcast", "all_gather", ...
    numel: int         # elements sent by this rank
    dtype: torch.dtype | None
    tag: str           # who issued it and why: "bucket 3", "buffers", ...


class Work:
    """An async collective's handle; ``wait()`` blocks until it completed.

    Waiting also marks the collective completed in the ledger; a gloo wait
    watches the peers and raises :class:`~tandem.comm.peers.PeerLostError` when
    one dies (Note [dead peers] in :mod:`tandem.comm.peers`).
    """

    __slots__ = ("_work", "_entry", "_comm")

    def __init__(self, work: Any, entry: LedgerEntry | None = None,
                 comm: GroupComm | None = None) -> None:
        self._work = work
        self._entry = entry
        self._comm = comm

    def wait(self) -> None:
        if self._comm is None:
            if self._work is not None:
                self._work.wait()
            return
        if self._work is not None and (self._entry is None or not self._entry.completed):
            self._comm._wait(self._work, self._entry)
        if self._entry is not None:
            self._comm.ledger.complete(self._entry)

    def is_completed(self) -> bool:
        """Whether the collective has completed (a synchronous one always has)."""
        done = self._work is None or self._work.is_completed()
        if done and self._entry is not None and self._comm is not None:
            self._comm.ledger.complete(self._entry)
        return done

    def get_future(self) -> torch.futures.Future:
        """A future completed with the collective's output tensors (a list), for
        communication hooks that chain work on the result (async collectives only)."""
        if self._work is None:
            raise RuntimeError("a synchronous collective has no future: issue it with async_op=True")
        future = self._work.get_future()
        entry, comm = self._entry, self._comm
        if entry is not None and comm is not None:
            future.add_done_callback(lambda _: comm.ledger.complete(entry))
        return future


class GroupComm:
    """Collectives over one process group (the default group when ``group`` is None).

    Each collective is written to the process's ledger (:mod:`tandem.comm.ledger`)
    and, in debug mode, checked against the other ranks' before it is issued
    (:mod:`tandem.comm.fingerprint`).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call tandem.init() (or "
                "torch.distributed.init_process_group) before building tandem's DDP")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.observers: list[Callable[[CollectiveEvent], None]] = []
        self.monitor = current_monitor()
        self.ledger = self.monitor.ledger
        self.label = group_label(group)
        self.members = (list(range(self.size)) if group is None
                        else dist.get_process_group_ranks(group))
        self.backend = str(dist.get_backend(group))  # "gloo", "nccl", "cpu:gloo,cuda:nccl", "fake", ...
        # gloo waits are sliced and watch the peers; NCCL has its own watchdog.
        self._watched = self.size > 1 and self.monitor.peers is not None and \
            dist.get_backend(group) == "gloo"
        self._waiter = Waiter()  # its thread starts at the first reduce-scatter watched
        # Note [a broken step goes on] in failure_gate.py: set by an elastic loop's fully_shard model.
        self.gate: FailureGate | None = None

    def __reduce__(self) -> Any:
        # A live process group cannot travel: say what holds it and what to do,
        # not pickle's "cannot pickle 'ProcessGroup' object".
        raise TypeError(
            f"rank {self.rank}: a GroupComm over process group {self.label!r} (ranks {self.members}) cannot be "
            "pickled or deep-copied: it holds a "
            "live process group. A DistributedDataParallel whose communication hook state is (or holds) "
            "a GroupComm other than the model's own (ddp.comm) cannot be copied with its hook: remove "
            "the hook or copy the wrapped module (ddp.module), and register the hook on the copy with a "
            "GroupComm of its own")

    def global_rank(self, group_rank: int) -> int:
        """The global rank of this group's rank ``group_rank``."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def _issue(self, op: str, tensor: torch.Tensor | None, tag: str) -> LedgerEntry:
        numel = 0 if tensor is None else tensor.numel()
        if self.observers:
            event = CollectiveEvent(op, numel, None if tensor is None else tensor.dtype, tag)
            for observe in self.observers:
                observe(event)
        entry = self.ledger.issue(op, tag, numel,
                                  "" if tensor is None else _DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype)),
                                  self.label, 0 if tensor is None else numel * tensor.element_size())
        if self.monitor.fingerprints is not None and self.size > 1:
            self.monitor.fingerprints.check(self.label, self.members, entry,
                                            () if tensor is None else tuple(tensor.shape))
        return entry

    def _issued(self, work: Any, entry: LedgerEntry, async_op: bool) -> Work:
        handle = Work(work, entry, self)
        if not async_op:
            handle.wait()
        return handle

    def _run(self, op: str, tensor: torch.Tensor, tag: str, launch: Callable[[], Any], async_op: bool) -> Work:
        """Issue a collective (``launch()`` returns its work): not at all while the
        gate is broken, and as completed when the gate claims its failure (Note
        [a broken step goes on] in failure_gate.py)."""
        if self.gate is not None and self.gate.broken:
            return Work(None)
        entry = self._issue(op, tensor, tag)
        try:
            work = launch()
        except Exception as e:
            if self.gate is None or not self.gate.claims(e):
                raise
            return Work(None)
        return self._issued(work, entry, async_op)

    def _wait(self, work: Any, entry: LedgerEntry | None) -> None:
        try:
            if not self._watched or self.monitor.peers is None:
                work.wait()
                return
            during = (lambda: f"{entry.describe()} of step {entry.step}") if entry is not None \
                else (lambda: "a collective")
            wait_watching_peers(work, self.monitor.peers, self.members, during)
        except Exception as e:
            if self.gate is None or not self.gate.claims(e):
                raise

    def all_reduce(self, tensor: torch.Tensor, *, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   tag: str = "", async_op: bool = False) -> Work:
        return self._run("all_reduce", tensor, tag,
                         lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, tag: str = "",
                  async_op: bool = False) -> Work:
        """Broadcast from group rank ``src``."""
        return self._run("broadcast", tensor, tag, lambda: dist.broadcast(
            tensor, src=self.global_rank(src), group=self.group, async_op=True), async_op)

    def all_gather(self, tensor: torch.Tensor, *, tag: str = "") -> list[torch.Tensor]:
        out = [torch.zeros_like(tensor) if self.gate is not None else torch.empty_like(tensor)
               for _ in range(self.size)]
        self._run("all_gather", tensor, tag, lambda: dist.all_gather(out, tensor, group=self.group, async_op=True),
                  False)
        return out

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, tag: str = "",
                       async_op: bool = False, via: Any = None) -> Work:
        """Sum ``input`` (``size`` equal chunks) across ranks; this rank's chunk of
        the sum lands in ``output``, which may be this rank's chunk of ``input``
        (in place: NCCL and gloo allow it; on gloo the other chunks then hold
        their sums too, Note [gloo's reduce-scatter]) and must not overlap it
        otherwise. A group of one copies. ``via``: a callable issuing it instead
        of torch's collective, with torch's ``ReduceScatter`` signature
        (fully_shard's ``set_custom_reduce_scatter``), still written to the ledger."""
        if self.size == 1:
            output.copy_(input)
            return self._issued(None, self._issue("reduce_scatter", input, tag), False)
        all_reduce = via is None and self.in_place_scatter_all_reduces(input.device) and \
            _is_chunk(output, input, self.rank)

        def launch() -> Any:
            if via is not None:
                work = via(output_tensor=output, input_tensor=input, group=self._process_group(),
                           op=dist.ReduceOp.SUM, async_op=True)
            elif all_reduce:  # Note [gloo's reduce-scatter]
                work = dist.all_reduce(input, group=self.group, async_op=True)
            else:
                work = reduce_scatter_tensor(output, input, group=self.group, async_op=True)
            # Its wait ignores a timeout on gloo: a watched wait goes through a thread.
            return self._waiter.submit(work) if self._watched else work
        return self._run("reduce_scatter", input, tag, launch, async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, tag: str = "",
                   async_op: bool = False) -> Work:
        """Split ``input`` into ``size`` equal chunks along its first dimension and
        send chunk r to rank r; ``output``'s chunk r is what rank r sent this rank.
        A group of one copies."""
        if self.size == 1:
            output.copy_(input)
            return self._issued(None, self._issue("all_to_all", input, tag), False)
        return self._run("all_to_all", input, tag, lambda: dist.all_to_all_single(
            output, input, group=self.group, async_op=True), async_op)

    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor, *, tag: str = "",
                        async_op: bool = False, via: Any = None) -> Work:
        """Concatenate every rank's ``input`` into ``output`` (``size`` times its
        length), in rank order. A group of one copies. ``via``: a callable
        issuing it instead of torch's collective, with torch's ``AllGather``
        signature (fully_shard's ``set_custom_all_gather``), still written to
        the ledger."""
        if self.size == 1:
            output.copy_(input)
            return self._issued(None, self._issue("all_gather_into", input, tag), False)

        def launch() -> Any:
            if via is not None:
                return via(output_tensor=output, input_tensor=input, group=self._process_group(), async_op=True)
            return all_gather_into_tensor(output, input, group=self.group, async_op=True)
        return self._run("all_gather_into", input, tag, launch, async_op)

    def _process_group(self) -> dist.ProcessGroup:
        """The process group object (the default one for ``group=None``)."""
        return self.group if self.group is not None else dist.group.WORLD  # type: ignore[return-value]

    def all_gather_object(self, obj: Any, *, tag: str = "") -> list[Any]:
        """Gather an object of plain data (tensors, numbers, strings, containers)
        from every rank (slow; for set-up and error paths). Each is decoded
        without running code (Note [plain data] in plain_data.py).

        Raises:
            RefusedObjectError: a rank sent something else, naming it.
        """
        payloads = gather_payloads(obj, lambda t: self.all_gather(t, tag=tag), self.device)
        return [decode(p, sender=f"rank {self.global_rank(r)}", what=tag or "an object")
                for r, p in enumerate(payloads)]

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

    def in_place_scatter_all_reduces(self, device: torch.device) -> bool:
        """Whether a reduce-scatter in place on ``device`` runs as an all-reduce in
        place (gloo: Note [gloo's reduce-scatter]), so that a caller whose output is
        elsewhere does better to reduce in place and copy its chunk out."""
        return self.size > 1 and self.backend_on(device) == "gloo"

    def backend_on(self, device: torch.device) -> str:
        """The backend that runs this group's collectives on ``device`` ("gloo", "nccl", ...)."""
        return _backend_for(self.backend, device)

    def wait_blocks_host(self, device: torch.device) -> bool:
        """Whether waiting on one of this group's collectives on ``device`` holds
        the calling thread until the collective has completed: gloo's and MPI's
        waits do, and every wait on CPU tensors; a device backend's (NCCL) only
        orders the device's current stream after the collective and returns,
        and the fake backend's collectives (tandem.testing.fake_world) are
        complete when issued. fully_shard chooses how many reduce-scatters to
        keep in flight by it (Note [reductions in flight] in tandem/fsdp/schedule.py)."""
        backend = _backend_for(self.backend, device)
        if backend == "fake":
            return False
        return device.type == "cpu" or backend in ("gloo", "mpi")

    @property
    def device(self) -> torch.device:
        """Where this group's backend wants its tensors: the current CUDA device for nccl."""
        backend = dist.get_backend(self.group)
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _is_chunk(output: torch.Tensor, input: torch.Tensor, rank: int) -> bool:
    """Whether ``output`` is chunk ``rank`` of the contiguous ``input`` (an in-place reduce-scatter)."""
    return (input.is_contiguous() and output.is_contiguous() and output.dtype == input.dtype
            and output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr()
            and output.data_ptr() == input.data_ptr() + rank * output.numel() * output.element_size()
            and input.numel() % max(output.numel(), 1) == 0)


def _backend_for(backend: str, device: torch.device) -> str:
    """The backend that runs a group's collectives on ``device``: a group built
    with one per device type names them ``"cpu:gloo,cuda:nccl"``."""
    if ":" not in backend:
        return backend
    pairs = dict(part.split(":", 1) for part in backend.split(","))
    return pairs.get(device.type, backend)
