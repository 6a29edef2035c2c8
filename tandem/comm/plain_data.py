"""What ranks exchange as Python objects, decoded so that nothing a peer sends
can run code here (Note [plain data]): :func:`encode`, :func:`decode`, and the
drop-in :func:`all_gather_object` and :func:`broadcast_object_list`.

# Note [plain data]
torch's object collectives (``all_gather_object``, ``broadcast_object_list``)
pickle on one side and unpickle on the other, and unpickling runs whatever the
bytes name: a process that reaches a rank's connections (a stranger on the
store's port, or a forged member of an elastic job) runs code on every rank it
sends to. tandem exchanges objects in many places (membership, buddy copies of
shards, checks, metrics, checkpoint agreement, the training state a
replacement receives), and every one of them is plain data: tensors, numbers,
strings, ``None``, dtypes and containers of them. So every such object is
written with ``torch.save`` and read with ``torch.load(weights_only=True)``,
torch's restricted unpickler, which builds only those (and the few classes a
caller names, e.g. tandem.recv's own spec): an object that names anything else
(a function, a class's constructor, ``os.system``) is refused with
:class:`RefusedObjectError`, naming the rank it came from, before anything of
it is built. The training state a replacement receives goes by
``tandem.send`` (tandem/comm/p2p.py), and the shards the survivors of a world
change exchange by :func:`all_to_all_with_tensors`: their dense tensors as
raw bytes, which
build nothing but tensors of the dtypes and shapes named beside them, and the
rest so. User objects passed through tandem (the Trainer's ``extra``
state, a loop's registered objects) must be plain data too, as they must be
for ``weights_only`` checkpoints; exchanging other objects stays possible with
torch's own helpers, by the user's choice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tandem._tree import map_tensors

__all__ = ["RefusedObjectError", "all_gather_ints", "all_gather_object", "all_to_all_with_tensors",
           "broadcast_object_list", "decode", "encode", "gather_payloads"]


class RefusedObjectError(RuntimeError):
    """A peer sent an object that is not plain data (Note [plain data]); nothing of it was built."""


def encode(obj: Any) -> torch.Tensor:
    """``obj`` as bytes in a uint8 tensor on the host (``torch.save``'s format)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def decode(data: bytes | torch.Tensor, *, sender: str, what: str = "an object",
           allow: Sequence[type] = ()) -> Any:
    """The object in ``data`` (from :func:`encode`), built only if it is plain
    data or of the classes in ``allow`` (Note [plain data]).

    Args:
        sender: who sent it ("rank 3"), for the error.
        what: what it was, for the error.
        allow: classes of the caller's own that may appear in it.

    Raises:
        RefusedObjectError: naming ``sender``, when it is not.
    """
    raw = data.cpu().numpy().tobytes() if isinstance(data, torch.Tensor) else data
    try:
        with _allowing(allow):
            return torch.load(io.BytesIO(raw), weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).split("WeightsUnpickler error:")[-1].strip().splitlines()[0] if str(e) else ""
        me = f"rank {dist.get_rank()}" if dist.is_initialized() else "this process"
        raise RefusedObjectError(
            f"{me} refused {what} from {sender}: it is not plain data (tensors, numbers, strings, "
            f"None and containers of them){': ' + reason if reason else ''}. tandem never unpickles "
            "anything else from a peer (Note [plain data] in tandem/comm/plain_data.py): a process that "
            "is not of this job, or a peer sending an object of its own class, is refused") from None


def gather_payloads(obj: Any, all_gather: Callable[[torch.Tensor], list[torch.Tensor]],
                    device: torch.device) -> list[torch.Tensor]:
    """Every rank's :func:`encode` of its ``obj``, in rank order, through
    ``all_gather`` (one tensor in, every rank's out): the lengths first, then
    the payloads padded to the longest."""
    payload = encode(obj).to(device)
    lengths = [int(n.item()) for n in all_gather(torch.tensor([payload.numel()], dtype=torch.int64, device=device))]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    return [chunk[:n] for chunk, n in zip(all_gather(padded), lengths)]


def all_gather_object(object_list: list[Any], obj: Any, group: dist.ProcessGroup | None = None) -> None:
    """``torch.distributed.all_gather_object``, with every rank's object decoded as
    plain data (Note [plain data]): ``object_list[r]`` is rank r's ``obj``."""
    size = dist.get_world_size(group)

    def all_gather(t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(out, t, group=group)
        return out

    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    for r, payload in enumerate(gather_payloads(obj, all_gather, _device(group))):
        object_list[r] = decode(payload, sender=f"rank {ranks[r]}", what="an all_gather_object's object")


def all_gather_ints(values: Sequence[int], group: dist.ProcessGroup | None = None) -> list[list[int]]:
    """Every rank's ``values`` (as many on every rank, each fits an int64), in
    group rank order: one all-gather of a tensor, where :func:`all_gather_object`
    needs two (the lengths, then the payloads) and decodes each rank's. For the
    few numbers a world change agrees on, whose latency its members wait on."""
    if not values:
        raise ValueError("all_gather_ints: no values to gather")
    size = dist.get_world_size(group)
    mine = torch.tensor(list(values), dtype=torch.int64, device=_device(group))
    out = torch.empty(size, mine.numel(), dtype=torch.int64, device=mine.device)
    dist.all_gather(list(out.unbind(0)), mine, group=group)
    return [[int(v) for v in row] for row in out.tolist()]


def broadcast_object_list(object_list: list[Any], src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """``torch.distributed.broadcast_object_list`` (``src`` a global rank), with the
    objects decoded as plain data on every other rank (Note [plain data])."""
    device = _device(group)
    mine = dist.get_rank() == src
    payload = encode(list(object_list)).to(device) if mine else None
    length = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    data = payload if payload is not None else torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, group=group)
    if not mine:
        received = decode(data, sender=f"rank {src}", what="a broadcast_object_list's objects")
        if not isinstance(received, list) or len(received) != len(object_list):
            raise RefusedObjectError(f"rank {dist.get_rank()} refused a broadcast_object_list from rank {src}: "
                                     f"it holds {type(received).__name__}, not a list of {len(object_list)}")
        object_list[:] = received


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a tensor of an object sent by :func:`all_to_all_with_tensors` is in its buffer of bytes."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """In bytes, a multiple of :data:`_ALIGN`."""
    device: str


_ALIGN = 16  # bytes: every dtype's elements can be viewed at such an offset


def all_to_all_with_tensors(objs: Sequence[Any], group: dist.ProcessGroup | None = None) -> list[Any]:
    """``objs[j]`` to group rank j, from every rank: returns what each rank sent
    this one, in group rank order. Each object's dense tensors go as they are,
    in one buffer of bytes, and the rest as plain data (Note [plain data]): a
    shard's bytes are nearly all tensors, which are then neither pickled nor
    unpickled. One all-to-all of bytes after one of their lengths; each tensor
    received is a copy of its own, on the device it was on at its sender."""
    device = _device(group)
    size = dist.get_world_size(group)
    if len(objs) != size:
        raise ValueError(f"all_to_all_with_tensors: {len(objs)} object(s) for a group of {size} rank(s)")
    packed = [_pack(obj, device) for obj in objs]
    sent_lengths = torch.tensor([n for head, body in packed for n in (head.numel(), body.numel())],
                                dtype=torch.int64, device=device)
    got_lengths = torch.empty_like(sent_lengths)
    dist.all_to_all_single(got_lengths, sent_lengths, group=group)
    ins = [_aligned(head.numel()) + body.numel() for head, body in packed]
    payload = torch.zeros(sum(ins), dtype=torch.uint8, device=device)
    at = 0
    for (head, body), n in zip(packed, ins):
        payload[at:at + head.numel()] = head
        payload[at + _aligned(head.numel()):at + n] = body
        at += n
    heads = [int(h) for h in got_lengths.view(size, 2)[:, 0].tolist()]
    outs = [_aligned(h) + int(b) for h, b in zip(heads, got_lengths.view(size, 2)[:, 1].tolist())]
    out = torch.empty(sum(outs), dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, payload, output_split_sizes=outs, input_split_sizes=ins, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    received, at = [], 0
    for r, (h, n) in enumerate(zip(heads, outs)):
        received.append(_unpack(out[at:at + h], out[at + _aligned(h):at + n], sender=f"rank {ranks[r]}",
                                what="an all_to_all's tensor-free part"))
        at += n
    return received


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _pack(obj: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``obj`` in two parts of bytes on ``device``: its plain part, with each dense
    tensor replaced by its :class:`_Slot`, and the bytes of those tensors, each at
    an offset of a multiple of :data:`_ALIGN`."""
    parts: list[torch.Tensor] = []
    end = 0

    def slot(t: torch.Tensor) -> Any:
        nonlocal end
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_quantized:
            return t  # sent as plain data (Note [plain data])
        offset = _aligned(end)
        if offset > end:
            parts.append(torch.zeros(offset - end, dtype=torch.uint8, device=device))
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
        parts.append(data)
        end = offset + data.numel()
        return _Slot(t.dtype, tuple(t.shape), offset, str(t.device))

    skeleton = encode(map_tensors(slot, obj)).to(device)
    return skeleton, torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def _unpack(skeleton: torch.Tensor, buffer: torch.Tensor, *, sender: str, what: str) -> Any:
    """The object :func:`_pack` made these two parts of, each tensor a copy of its own."""
    tree = decode(skeleton, sender=sender, what=what, allow=(_Slot,))
    return _walk_slots(tree, lambda s: buffer[s.offset:s.offset + _nbytes(s)].view(s.dtype).view(s.shape)
                       .to(s.device, copy=True))


def _nbytes(slot: _Slot) -> int:
    return math.prod(slot.shape) * torch.empty(0, dtype=slot.dtype).element_size()


def _walk_slots(obj: Any, fn: Callable[[_Slot], Any]) -> Any:
    """``obj`` with ``fn`` applied to each slot in it (dicts, lists and tuples rebuilt)."""
    if isinstance(obj, _Slot):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _walk_slots(v, fn)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_walk_slots(v, fn) for v in obj)
    return obj


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def _allowing(classes: Sequence[type]) -> Iterator[None]:
    if not classes:
        yield
        return
    scoped = getattr(torch.serialization, "safe_globals", None)  # torch 2.5+
    if scoped is not None:
        with scoped(list(classes)):
            yield
    else:  # torch 2.4: the process-wide list (these are tandem's own classes)
        torch.serialization.add_safe_globals(list(classes))
        yield
