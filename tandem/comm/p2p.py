"""Point-to-point messages whose receiver need not know what comes:
:func:`send` / :func:`recv` and their async forms :func:`isend` / :func:`irecv`.

``torch.distributed.send``/``recv`` move one tensor into a buffer the receiver
allocated in advance, so the receiver must know its shape and dtype. Pipeline
stages do not always (the sequence length changes from batch to batch), and an
activation is often several tensors. Here a message carries its own description.

# Note [shape handshake]
A message is three parts, each a torch.distributed p2p op between the same two
ranks, with a tag of its own (gloo matches by source and tag):

1. the header: two int64, a magic number and the byte length of the spec;
2. the spec: the structure (a tensor, or tuples, namedtuples, lists and dicts
   of tensors and plain values), with every tensor replaced by a slot that holds
   its dtype, shape and requires_grad, and the sender's rank; written with
   ``torch.save`` and read as plain data (Note [plain data] in plain_data.py:
   nothing a peer sends can run code here), a namedtuple by its class's name,
   which the receiver must have imported;
3. the data: every tensor, contiguous, in slot order.

The receiver reads the header, then the spec, allocates every tensor, and
receives the data into them. A peer that sent something else (a raw
``dist.send``, or a message cut short) fails the magic or the spec check, with
an error naming both ranks. Received tensors are leaves; a slot's
``requires_grad`` is set on them (a pipeline stage then backpropagates into
them). Messages between two ranks arrive in the order they were sent; receives
from one peer must be completed (``wait``) in the order they were posted.

The header is received into a buffer of :data:`HEADER_CAPACITY` bytes, far
more than a header's 16: gloo fills a larger receive buffer with a shorter
message, but aborts the process (``gloo::EnforceNotMet``, SIGABRT) when a
message is longer than the buffer posted for it. A foreign message of up to
that many bytes is therefore refused with tandem's error; a longer one
still aborts inside gloo.

These are not collectives: they are not written to the ledger, whose sequence
numbers are equal across all ranks (Note [sequence numbers] in ledger.py).

# Note [late peers]
A gloo send or receive waits for its peer as long as the group's timeout, and
still notices within seconds a peer that died. A watched wait looks at the
peers' heartbeats between slices of half a second (Note [dead peers] in
peers.py); but gloo's ``wait(timeout)`` on a send or receive that times out
closes the connection (the peer's send then fails with "Connection closed by
peer"), and its ``is_completed()`` stays False until the work is waited on.
So a send's or receive's work is never waited on with a timeout here: a
:class:`~tandem.comm.peers.Waiter` thread, one per peer and direction (the
works of one pair complete in the order they were posted), waits on it
without one, and the caller's slices wait on that thread. A sender late by
seconds is waited for; one that died is named by its heartbeat.

# Note [one wait for a message's parts]
A message is several works between the same two ranks: a send's header, spec
and tensors, a receive's tensors once its spec is read. They are all handed
to that pair's waiter thread at once, which waits on them in the order they
were posted, and the caller waits, watching the peer, on the last one only: the
works of one pair complete in that order, so when the last is done every one
before it has run, and any error one of them raised is raised then. One
handover between the caller's thread and the waiter for a message, not one
per tensor: on a loaded host each handover is a wake-up that waits for a core.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from tandem.comm.monitor import current_monitor
from tandem.comm.peers import PeerLostError, wait_watching_peers
from tandem.comm.plain_data import RefusedObjectError, decode, encode

__all__ = ["HEADER_CAPACITY", "PendingRecv", "PendingSend", "irecv", "isend", "recv", "send"]

HEADER_CAPACITY = 64 * 1024
"""Bytes posted for a header: a foreign message up to this long is refused, not an abort (Note [shape handshake])."""

_MAGIC = 0x7A4D5032  # "tandem p2p", version 2 of the header
# The header goes with torch's default tag, so that a raw dist.send meets the magic check.
_TAG_HEADER, _TAG_SPEC, _TAG_DATA = 0, 7302, 7303


@dataclass(frozen=True)
class _Slot:
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


@dataclass(frozen=True)
class _Spec:
    sender: int
    structure: Any


@dataclass(frozen=True)
class _Named:
    """A namedtuple in a spec: its class by module and name, looked up among the
    receiver's imported modules (never imported for the message), and its values."""
    module: str
    name: str
    values: tuple[Any, ...]

    def build(self, values: list[Any], src: int) -> tuple[Any, ...]:
        cls: Any = sys.modules.get(self.module)
        for part in self.name.split("."):
            cls = getattr(cls, part, None)
        if not (isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")):
            raise RefusedObjectError(
                f"rank {dist.get_rank()}: tandem.recv got a {self.module}.{self.name} from rank {src}, which is "
                "not a namedtuple class imported here; import its module before receiving")
        return cast(tuple, cls(*values))


class PendingSend:
    """An :func:`isend` in flight; :meth:`wait` returns once every part has gone."""

    def __init__(self, works: list[Any], keep: list[torch.Tensor], dst: int, group: dist.ProcessGroup | None) -> None:
        self._works = works
        self._keep = keep  # the buffers must live until the sends complete
        self._dst, self._group = dst, group

    def wait(self) -> None:
        _wait_all(self._works, self._dst, self._group, "send", f"tandem.send of a message to rank {self._dst}")
        self._works = []
        self._keep = []

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


class PendingRecv:
    """An :func:`irecv` posted; :meth:`wait` returns the received object."""

    def __init__(self, src: int, group: dist.ProcessGroup | None, device: torch.device | None) -> None:
        self._src, self._group, self._device = src, group, device
        self._header = torch.zeros(HEADER_CAPACITY // 8, dtype=torch.int64)
        self._work = _post(lambda: dist.irecv(self._header, src=src, group=group, tag=_TAG_HEADER), src,
                           f"tandem.recv from rank {src}")
        self._result: Any = None
        self._done = False

    def wait(self) -> Any:
        if not self._done:
            _wait_all([self._work], self._src, self._group, "recv",
                  f"tandem.recv of the header of a message from rank {self._src}", header=True)
            self._result = _finish_recv(self._header[:2], self._src, self._group, self._device)
            self._done = True
        return self._result


def send(obj: Any, dst: int, *, group: dist.ProcessGroup | None = None) -> None:
    """Send ``obj`` (a tensor, or tuples, namedtuples, lists and dicts of tensors
    and plain values: numbers, strings, None, dtypes) to global rank ``dst``,
    shapes and dtypes included, so the receiver needs to know neither; returns
    when it has gone. The receiver refuses any other object (it never unpickles
    code a peer sent), and must have imported the class of a namedtuple."""
    # Note [shape handshake]; the refusal: Note [plain data] in plain_data.py.
    isend(obj, dst, group=group).wait()


def isend(obj: Any, dst: int, *, group: dist.ProcessGroup | None = None) -> PendingSend:
    """:func:`send`, returning at once; ``wait()`` on the result before changing
    the tensors."""
    me = _check_peer(dst, "send to", group)
    tensors: list[torch.Tensor] = []
    structure = _replace_tensors(obj, tensors)
    spec = _encode(_Spec(sender=me, structure=structure))
    header = torch.tensor([_MAGIC, spec.numel()], dtype=torch.int64)
    data = [t.detach().contiguous() for t in tensors]
    def post() -> list[Any]:
        works = [dist.isend(header, dst=dst, group=group, tag=_TAG_HEADER),
                 dist.isend(spec, dst=dst, group=group, tag=_TAG_SPEC)]
        return works + [dist.isend(t, dst=dst, group=group, tag=_TAG_DATA) for t in data if t.numel()]

    works = _post(post, dst, f"tandem.send to rank {dst}")
    return PendingSend(works, [header, spec, *data], dst, group)


def recv(src: int, *, group: dist.ProcessGroup | None = None, device: torch.device | str | None = None) -> Any:
    """Receive what global rank ``src`` sent with :func:`send` or :func:`isend`,
    allocating every tensor from the message's own description.

    Args:
        src: the sender's global rank.
        group: the process group both sides use (default: the world).
        device: where the tensors are allocated (default: the CPU for gloo, the
            current CUDA device for nccl).

    Raises:
        RuntimeError: the peer sent something that is not a tandem message, or
            sent it from another rank than ``src``; the message names both ranks.
        PeerLostError: the sender died (gloo).
    """
    return irecv(src, group=group, device=device).wait()


def irecv(src: int, *, group: dist.ProcessGroup | None = None,
          device: torch.device | str | None = None) -> PendingRecv:
    """:func:`recv`, posted now and completed by ``wait()`` (which returns the object)."""
    _check_peer(src, "receive from", group)
    return PendingRecv(src, group, None if device is None else torch.device(device))


# ---------------------------------------------------------------------- helpers
def _check_peer(peer: int, what: str, group: dist.ProcessGroup | None) -> int:
    if not dist.is_initialized():
        raise RuntimeError(f"tandem.{what.split()[0]}: torch.distributed is not initialised; call tandem.init()")
    me = dist.get_rank()
    world = dist.get_world_size()
    if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < world:
        raise ValueError(f"rank {me}: cannot {what} rank {peer!r}: ranks are 0..{world - 1}")
    if peer == me:
        raise ValueError(f"rank {me}: cannot {what} itself (rank {peer}); pass another rank")
    if group is not None and peer not in dist.get_process_group_ranks(group):
        raise ValueError(f"rank {me}: cannot {what} rank {peer}: it is not in the group "
                         f"{dist.get_process_group_ranks(group)}")
    return me


def _replace_tensors(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.layout is not torch.strided:
            raise TypeError(f"rank {dist.get_rank()}: tandem.send sends dense tensors, got a {obj.layout} one")
        tensors.append(obj)
        return _Slot(len(tensors) - 1, obj.dtype, tuple(obj.shape), obj.requires_grad)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        cls = type(obj)
        return _Named(cls.__module__, cls.__qualname__, tuple(_replace_tensors(v, tensors) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_replace_tensors(v, tensors) for v in obj)
    if isinstance(obj, dict):
        return {k: _replace_tensors(v, tensors) for k, v in obj.items()}
    return obj


def _fill(structure: Any, make: Callable[[_Slot], torch.Tensor], src: int) -> Any:
    if isinstance(structure, _Slot):
        return make(structure)
    if isinstance(structure, _Named):
        return structure.build([_fill(v, make, src) for v in structure.values], src)
    if isinstance(structure, (tuple, list)):
        return type(structure)(_fill(v, make, src) for v in structure)
    if isinstance(structure, dict):
        return {k: _fill(v, make, src) for k, v in structure.items()}
    return structure


def _encode(spec: _Spec) -> torch.Tensor:
    return encode(spec)


def _finish_recv(header: torch.Tensor, src: int, group: dist.ProcessGroup | None,
                 device: torch.device | None) -> Any:
    me = dist.get_rank()
    magic, length = (int(v) for v in header.tolist())
    if magic != _MAGIC or not 0 < length < 1 << 31:
        raise RuntimeError(
            f"rank {me}: tandem.recv from rank {src} got a header {header.tolist()} that is not a tandem "
            f"message: rank {src} sent with torch.distributed.send (or a message was cut short); "
            "send with tandem.send on one side and receive with tandem.recv on the other")
    payload = torch.empty(length, dtype=torch.uint8)
    _wait_all([dist.irecv(payload, src=src, group=group, tag=_TAG_SPEC)], src, group, "recv",
          f"tandem.recv of the spec of a message from rank {src}")
    spec = decode(payload, sender=f"rank {src}", what="the spec of a tandem.recv message",
                  allow=(_Spec, _Slot, _Named))
    if not isinstance(spec, _Spec) or spec.sender != src:
        sender = spec.sender if isinstance(spec, _Spec) else "?"
        raise RuntimeError(f"rank {me}: tandem.recv expected a message from rank {src} but this one says it "
                           f"comes from rank {sender}; check that both sides name each other")
    target = device if device is not None else _default_device(group)
    works: list[Any] = []

    def make(slot: _Slot) -> torch.Tensor:
        t = torch.empty(slot.shape, dtype=slot.dtype, device=target)
        if t.numel():
            works.append(dist.irecv(t, src=src, group=group, tag=_TAG_DATA))
        return t

    obj = _fill(spec.structure, make, src)
    _wait_all(works, src, group, "recv", f"tandem.recv of the data of a message from rank {src}")
    return _fill_requires_grad(obj, spec.structure)


def _fill_requires_grad(obj: Any, structure: Any) -> Any:
    if isinstance(structure, _Slot):
        return obj.requires_grad_(structure.requires_grad) if structure.dtype.is_floating_point \
            or structure.dtype.is_complex else obj
    if isinstance(structure, _Named):
        structure = structure.values
    if isinstance(structure, (tuple, list)):
        for o, s in zip(obj, structure):
            _fill_requires_grad(o, s)
    elif isinstance(structure, dict):
        for k, s in structure.items():
            _fill_requires_grad(obj[k], s)
    return obj


def _default_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _post(post: Callable[[], Any], peer: int, during: str) -> Any:
    """Post a send or receive; gloo refuses at once one to a peer whose
    connection closed: name the peer if its heartbeat says it is gone."""
    try:
        return post()
    except RuntimeError as e:
        monitor = current_monitor()
        lost = monitor.peers.diagnose([peer]) if monitor.peers is not None else {}
        if lost:
            raise PeerLostError(dist.get_rank(), lost, during) from e
        raise


def _wait_all(works: list[Any], peer: int, group: dist.ProcessGroup | None, direction: str,
              during: str, *, header: bool = False) -> None:
    """Wait for sends to ``peer``, or receives from it, in the order they were
    posted, watching ``peer`` (Note [late peers]) over the last one only (Note
    [one wait for a message's parts]); ``header``: the receive of a message's
    header (Note [mismatched waits] in wait_board.py)."""
    if not works:
        return
    monitor = current_monitor()
    if monitor.peers is None or dist.get_backend(group) != "gloo":
        for work in works:
            work.wait()
        return
    waiter = monitor.p2p_waiter(peer, direction, group)
    threaded = [waiter.submit(work) for work in works]
    wait_watching_peers(threaded[-1], monitor.peers, [peer], lambda: during, header=header)
    for done in threaded[:-1]:
        done.wait()  # run before the last: raises what its own wait raised, if anything
