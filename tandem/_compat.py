"""The one place where tandem touches private torch APIs, each with why.

Everything here exists in torch 2.4 and later; if a future torch moves one, this
file is the only one to change.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:  # the public names of newer torch, for annotations only
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["accumulate_grad_node", "bind_group_defaults_before_init", "foreach_copy_", "is_opaque_backward_node",
           "not_traced", "not_traced_forward", "preserve_version_counters", "queue_backward_callback",
           "will_execute_in_this_backward"]

_F = TypeVar("_F", bound=Callable[..., Any])


def not_traced(fn: _F | None = None, *, recursive: bool = True) -> Any:
    """``torch.compiler.disable(fn, recursive=...)``, applied when ``fn`` is first called.

    Why: ``torch.compiler.disable`` imports ``torch._dynamo`` when it decorates,
    which is 1.4 s of the 3.2 s that ``import tandem`` took, paid by every process
    that imports tandem: the launcher and its agent, ``tandem plan``, a worker
    that never compiles. torch's own lazy form (``torch._disable_dynamo``, which
    torch uses inside itself for the same reason, torch 2.2 and later) imports it
    at the first call instead, and dynamo skips its wrapper (torch/_compile.py is
    on dynamo's skip list), so under ``torch.compile`` the function is excluded
    exactly as with the decorator: recursively, or only its own frame with
    ``recursive=False`` (though not at the top of a compiled module's forward:
    DDP's forward keeps torch's decorator, see there).
    """
    if fn is None:
        return lambda f: torch._disable_dynamo(f, recursive)
    return torch._disable_dynamo(fn, recursive)


class not_traced_forward:  # noqa: N801 - a decorator, named as one
    """``torch.compiler.disable(recursive=False)`` on a module's ``forward``, applied
    once ``torch._dynamo`` is loaded (by ``torch.compile``).

    Why: the decorator imports ``torch._dynamo`` (1.5 s of CPU, and with it
    ``torch.distributed.tensor``) where it is written, in every process that
    imports the module, compiling or not; the lazy form (:func:`not_traced`)
    adds a graph break at the top of a compiled module's forward. This
    descriptor stands in the class until the method is first looked up with
    dynamo loaded (``torch.compile(module)`` looks it up before it traces, and
    so does the wrapper's constructor, :meth:`apply_if_loaded`), and then puts the
    function decorated as torch decorates it in its place: what dynamo traces
    is the decorated forward, and a compiled model stays one graph. Before
    that, the plain function runs (nothing can trace it without dynamo).
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        self._name = fn.__name__
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        fn = self._fn
        if owner is not None and "torch._dynamo" in sys.modules:
            fn = torch.compiler.disable(fn, recursive=False)
            setattr(owner, self._name, fn)
        return fn if obj is None else types.MethodType(fn, obj)

    @staticmethod
    def apply_if_loaded(owner: type, name: str = "forward") -> None:
        """Decorate now if dynamo is loaded (a lookup does it)."""
        getattr(owner, name)


@not_traced  # run for real, never traced: see compiled autograd below
def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the current backward pass (graph task) has finished.

    Why: DDP must wait for the last bucket and write averaged gradients before
    ``loss.backward()`` returns; the autograd engine's final callbacks are the
    hook for that (torch's own DDP uses the same one). Must be called from inside
    backward (a tensor or gradient hook).

    Raises:
        RuntimeError: under compiled autograd, which traces the backward's hooks
            (Note [torch.compile] in tandem/ddp/compile.py); torch exposes that
            state as ``in_compiled_autograd_region`` (private, torch 2.4 to 2.13
            at least; where it is missing, torch's own assertion fires instead).
    """
    from torch._dynamo import compiled_autograd

    if getattr(compiled_autograd, "in_compiled_autograd_region", False):
        raise RuntimeError(
            "tandem's DistributedDataParallel and fully_shard do not support compiled autograd "
            "(torch._dynamo.config.compiled_autograd): their gradient hooks issue collectives, which "
            "compiled autograd would trace. Turn it off and compile the model instead "
            "(torch.compile(model)); tandem's gradient reductions still overlap the compiled backward")
    torch.autograd.Variable._execution_engine.queue_callback(fn)  # type: ignore[attr-defined]


def accumulate_grad_node(param: torch.Tensor) -> Any:
    """The autograd node that accumulates ``param``'s gradient (hold it to keep it alive).

    Why: DDP asks whether a backward pass will reach the parameters (below);
    the node is only reachable through a view's graph (torch's DDP does the same).
    """
    with torch.enable_grad():
        return param.view_as(param).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def will_execute_in_this_backward(node: Any) -> bool:
    """Whether the backward pass running now will execute ``node``.

    Why: ``torch.autograd.grad(out, inputs)`` runs a pass through the model's
    outputs that computes no parameter gradient (gradient penalties); DDP must
    not take that pass for the synchronised one. Call from inside backward.
    """
    return bool(torch._C._will_engine_execute_node(node))  # type: ignore[attr-defined]


@contextlib.contextmanager
def preserve_version_counters(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Write into ``tensors`` without bumping their autograd version counters.

    Why: broadcasting buffers from rank 0 overwrites them in place before each
    forward; that is not a modification autograd should complain about (torch's
    DDP does the same for the same reason).
    """
    preserve = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
    if preserve is None or not tensors:
        yield
        return
    with preserve(tuple(tensors)):
        yield


# Backward nodes that compute parameter gradients in a nested backward of their
# own, so the graph seen from the outputs does not reach those parameters.
# Why: reentrant activation checkpointing (torch.utils.checkpoint with
# use_reentrant=True) runs a fresh backward inside CheckpointFunctionBackward.
_OPAQUE_NODE_NAMES = frozenset({"CheckpointFunctionBackward"})


def is_opaque_backward_node(node: object) -> bool:
    return type(node).__name__ in _OPAQUE_NODE_NAMES


def foreach_copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i in one call.

    Why: writing averaged gradients back is one Python call per bucket instead of
    one per parameter; ``torch._foreach_copy_`` is what torch's optimizers use.
    """
    fn = getattr(torch, "_foreach_copy_", None)
    if fn is None:
        for d, s in zip(dst, src):
            d.copy_(s)
    else:
        fn(list(dst), list(src))


def storage_use_count(tensor: torch.Tensor) -> int | None:
    """How many tensors (and storage handles) share ``tensor``'s memory; None
    where this torch cannot tell.

    Why: DDP lets ``param.grad`` be a view of its bucket between steps (Note
    [gradients born in their bucket] in tandem/ddp/reduction.py) only while nothing
    outside the reducer holds a tensor on that memory, which would otherwise see
    the next step's gradients; one count per buffer per step tells, where a
    Python reference count would miss views derived from ``.grad``. torch's
    cudagraph trees read the same count for the same question.
    """
    fn = getattr(torch._C, "_storage_Use_Count", None)
    if fn is None:
        return None
    return int(fn(tensor.untyped_storage()._cdata))


def bind_group_defaults_before_init() -> None:
    """Import ``torch.distributed.nn.functional`` before any process group exists.

    Why: that module binds ``group.WORLD`` into the default arguments of its
    functions when first imported. If that happens after the group is created (the
    first ``optimizer.step()`` imports it through ``torch._dynamo``), the defaults
    keep the group alive after ``destroy_process_group()``, gloo's threads outlive
    the interpreter, and the process can abort at exit with "terminate called
    without an active exception". Imported first, the defaults hold nothing.
    """
    import torch.distributed.nn.functional  # noqa: F401


# ---------------------------------------------------------------- launcher (tandem.launch)

__all__ += ["rendezvous_info"]

from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousInfo


def rendezvous_info(store: torch.distributed.Store, rank: int, world_size: int,
                    master_addr: str, master_port: int) -> RendezvousInfo:
    """torch's ``RendezvousInfo`` with the workers' store at ``master_addr:master_port``.

    Why: tandem's launcher gives every attempt's workers a store of their own (see
    Note [one store per attempt] in ``tandem.launch.rendezvous``), which a
    rendezvous handler reports through ``RendezvousInfo.bootstrap_store_info``.
    Both classes are public from torch 2.4; before that ``next_rendezvous``
    returned a plain tuple and the agent chose the workers' store itself.
    """
    from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo

    return RendezvousInfo(store, rank, world_size,
                          RendezvousStoreInfo(master_addr=master_addr, master_port=master_port))



__all__ += ["matches_machine_hostname", "preset_static_store", "share_listening_store"]


def matches_machine_hostname(host: str) -> bool:
    """torch's rule for whether ``host`` names this machine (its hostname, one
    of its addresses, or loopback).

    Why: tandem hosts the c10d rendezvous' store itself (Note [the rendezvous'
    state] in ``tandem.launch.signed_rendezvous``) and decides who hosts it as
    torch does; the rule is a private function of torch's rendezvous utils.
    """
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return bool(_matches_machine_hostname(host))


def preset_static_store(handler: Any, store: torch.distributed.Store) -> None:
    """Give torch's static rendezvous handler the store it would make on its
    first ``next_rendezvous``.

    Why: the static handler makes a ``TCPStore`` listening on every interface
    (Note [a store on the job's address] in ``tandem.store.listening_store``),
    and only creates one when its private ``_store`` is unset (torch 2.4 to 2.13).
    """
    if not hasattr(handler, "_store"):
        raise RuntimeError(f"torch's static rendezvous handler {type(handler).__name__} has no _store "
                           "attribute in this torch version; tandem cannot give it a store")
    handler._store = store


def share_listening_store(handler: Any, make: Callable[[str, int], torch.distributed.TCPStore]) -> None:
    """Have torch's c10d rendezvous handler make the store it shares with the
    workers with ``make(addr, port)``.

    Why: from torch 2.6 the c10d handler of the round's rank 0 starts a
    ``TCPStore`` for the workers (which tandem replaces with a store per
    attempt, Note [one store per attempt] in ``tandem.launch.rendezvous``)
    listening on every interface (Note [a store on the job's address] in
    ``tandem.store.listening_store``); the one place it is made is the private
    ``_create_tcp_store_server``. Older versions make none, and this does nothing.
    """
    if hasattr(handler, "_create_tcp_store_server"):
        handler._create_tcp_store_server = make

# ---------------------------------------------------------------- fully_shard (tandem.fsdp)

__all__ += ["chunk_cat", "fsdp_policies"]


def chunk_cat(tensors: Sequence[torch.Tensor], num_chunks: int, out: torch.Tensor) -> None:
    """Write ``num_chunks`` rows into ``out`` (shape ``(num_chunks, n)``): row r is
    the concatenation of each tensor's r-th dim-0 chunk (``ceil(rows / num_chunks)``
    rows), zero-padded; casting to ``out``'s dtype.

    Why: this is the reduce-scatter input of fully_shard in one kernel;
    ``torch._chunk_cat`` is what torch's FSDP2 uses for it. The fallback does the
    same with one copy per tensor.
    """
    fn = getattr(torch, "_chunk_cat", None)
    if fn is not None:
        fn(list(tensors), dim=0, num_chunks=num_chunks, out=out)
        return
    offset = 0
    for t in tensors:
        rows = -(-t.shape[0] // num_chunks)
        width = rows * (t.numel() // max(1, t.shape[0]))
        dst = out.narrow(1, offset, width)
        padded = t.new_zeros((rows * num_chunks, *t.shape[1:]))
        padded[: t.shape[0]].copy_(t)
        dst.copy_(padded.view(num_chunks, width))
        offset += width


def fsdp_policies() -> tuple[type[MixedPrecisionPolicy], type[OffloadPolicy], type[CPUOffloadPolicy]]:
    """torch's ``(MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy)``.

    Why: tandem.fully_shard accepts torch's own policy objects, so that an FSDP2
    script runs with one import changed. They are public in
    ``torch.distributed.fsdp`` from torch 2.6; torch 2.4 and 2.5 have them in
    ``torch.distributed._composable.fsdp``.
    """
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
    except ImportError:
        from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
            CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy)
    return MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy


def dtensor_api() -> tuple[type[DTensor], type[Shard], type[Replicate]]:
    """``(DTensor, Shard, Replicate)``.

    Why: fully_shard's sharded parameters are DTensors, so that torch's
    optimizers, gradient clipping and distributed checkpoints handle them. The
    package is public as ``torch.distributed.tensor`` from torch 2.5; torch 2.4
    has it as ``torch.distributed._tensor``.
    """
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:
        from torch.distributed._tensor import DTensor, Replicate, Shard  # type: ignore[no-redef]
    return DTensor, Shard, Replicate


__all__ += ["clear_dtensor_sharding_cache", "dtensor_like", "dtensor_local", "dtensor_with_spec", "root_device_mesh",
            "set_dtensor_spec", "strided_shard"]


def dtensor_like(local: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """A DTensor over ``local`` with ``template``'s mesh, placements and global
    shape (``template`` a DTensor of the same layout, e.g. the sharded parameter
    whose gradient ``local`` is).

    Why: fully_shard wraps every gradient shard after every backward;
    ``DTensor.from_local`` takes ~400 us per call in its argument handling, the
    constructor with the template's spec ~4 us (torch's FSDP2 does the same,
    in its private ``_from_local_no_grad``).
    """
    return dtensor_with_spec(local, template._spec)  # type: ignore[attr-defined]


def dtensor_with_spec(local: torch.Tensor, spec: Any) -> torch.Tensor:
    """A DTensor over ``local`` with the layout ``spec`` (a ``DTensorSpec``:
    mesh, placements, global shape and stride); see :func:`dtensor_like`."""
    DTensor = dtensor_api()[0]
    try:
        # DTensor's private constructor.
        return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]
    except TypeError:  # a torch whose constructor differs: the public, slower way
        return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                                  shape=spec.shape, stride=spec.stride)


def set_dtensor_spec(t: torch.Tensor, template: torch.Tensor) -> None:
    """Give the DTensor ``t`` the layout (mesh, placements, global shape) of
    ``template``, keeping ``t`` the same object.

    Why: an elastic job lays a fully_shard unit out again over a new process
    group (Note [regrouped units] in tandem/fsdp/regroup.py); the sharded
    parameters must stay the objects the optimizer holds, and a DTensor's mesh
    is its private ``_spec`` (torch 2.4 to 2.13). The global shape, dtype and
    device, which the wrapper tensor itself carries, do not change.
    """
    t._spec = template._spec  # type: ignore[attr-defined]


def clear_dtensor_sharding_cache() -> None:
    """Forget DTensor's cached sharding propagation (an op's inputs' layouts ->
    its output's), in Python and in the C++ fast path.

    Why: the cache keys on ``DeviceMesh`` equality, which compares the ranks'
    layout but not the process group or this process's rank in it. After an
    elastic job's world shrinks and grows back (Note [regrouped units] in
    tandem/fsdp/regroup.py) the new world's mesh equals the first one, and a
    cached entry would hand out DTensors over the old mesh, with this
    process's old coordinate (a ``detach()`` in ``state_dict()`` did, and
    ``torch.distributed.checkpoint`` then saw two ranks write the same rows).
    torch clears it with ``torch.distributed.tensor.debug._clear_sharding_prop_cache``
    (torch 2.5 to 2.13).
    """
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # an older torch: the Python cache alone
        dtensor_api()[0]._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()  # type: ignore
        return
    _clear_sharding_prop_cache()


def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """The very tensor object a DTensor holds as its local shard.

    Why: fully_shard moves a sharded parameter's storage into another buffer
    with ``set_`` (Note [tiny units] in tandem/fsdp/api.py) and accumulates
    gradients into the local shard in place; ``to_local()`` on a
    ``Parameter(DTensor)`` returns a new alias in recent torch (gh-166156),
    on which ``set_`` would leave the parameter where it was.
    """
    return t._local_tensor  # type: ignore[attr-defined]


def root_device_mesh(mesh: Any) -> Any:
    """The DeviceMesh that ``mesh`` was sliced from (``mesh`` itself for a root).

    Why: fully_shard over ``mesh["dp"]`` of a model parallelised over
    ``mesh["tp"]`` describes its shards on the 2-D mesh of both (Note [2-D
    parameters] in tandem/fsdp/tensor_parallel.py). torch keeps the root in a
    private registry up to 2.8 (``_mesh_resources.get_root_mesh``) and on the
    mesh from 2.9 (``_get_root_mesh``).
    """
    if hasattr(mesh, "_get_root_mesh"):
        return mesh._get_root_mesh()
    from torch.distributed.device_mesh import _mesh_resources  # type: ignore[attr-defined]
    return _mesh_resources.get_root_mesh(mesh)


def strided_shard(dim: int, split_factor: int) -> Any:
    """DTensor's placement for rows sharded over one mesh dimension after another
    dimension sharded them first (``_StridedShard``, private, torch >= 2.5).

    Why: Note [2-D parameters] in tandem/fsdp/tensor_parallel.py.
    """
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError as e:
        raise NotImplementedError(
            f"fully_shard over a ColwiseParallel (dim-0) tensor-parallel parameter needs DTensor's "
            f"_StridedShard placement, which torch {torch.__version__} lacks; use torch >= 2.5, or "
            "tandem.DistributedDataParallel over mesh['dp']") from e
    return _StridedShard(dim, split_factor=split_factor)


# ---------------------------------------------------------------- the monitor (tandem.comm.monitor)

__all__ += ["default_store", "group_label", "own_tcp_client"]


def default_store() -> torch.distributed.Store:
    """The store the default process group was built on.

    Why: the monitor's heartbeats and debug-mode fingerprints go through the job's
    store rather than a collective, so that a stuck collective cannot stop them
    (Note [dead peers] in ``tandem.comm.peers``). torch exposes the store only
    through this private accessor (torch 2.0 to 2.13 at least).
    """
    return torch.distributed.distributed_c10d._get_default_store()


def set_group_timeout(timeout: datetime.timedelta, group: torch.distributed.ProcessGroup | None) -> None:
    """The timeout of ``group``'s collectives (None: the default group), after it
    was built under another (Note [arrivals] in tandem/control/elastic_group.py).

    Why: torch has no public setter; ``_set_pg_timeout`` exists since 2.2."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def own_tcp_client(store: torch.distributed.Store, *, below_prefixes: bool = False,
                   ) -> tuple[torch.distributed.Store, str] | None:
    """A client of ``store`` (with ``below_prefixes``: of the TCP store below its
    prefixes) with a connection of its own, and the TCP store's ``host:port``;
    None when ``store`` is not a TCP store (below its prefixes) or torch lacks
    ``Store.clone`` (before 2.7).

    Why: calls of two threads on one TCP client share its socket; the
    monitor's beats must not wait behind a call of the main thread that
    waits for a key (Note [cut off] in ``tandem.comm.cut_off``).
    """
    base = store
    while isinstance(base, torch.distributed.PrefixStore):
        base = base.underlying_store
    if not isinstance(base, torch.distributed.TCPStore) or not hasattr(store, "clone"):
        return None
    return (base if below_prefixes else store).clone(), f"{base.host}:{base.port}"


class _GivenGloo:
    """Stands for ``ProcessGroupGloo`` in torch's ``distributed_c10d`` while
    :func:`given_gloo_backend` holds: called, it returns the backend given
    (once), else builds one as the class does; ``isinstance`` and attributes
    answer as the class's."""

    def __init__(self, real: Any, backend: Any) -> None:
        self.real = real
        self.given = [backend]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.given.pop() if self.given else self.real(*args, **kwargs)

    def __instancecheck__(self, obj: object) -> bool:
        return isinstance(obj, self.real)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@contextlib.contextmanager
def given_gloo_backend(backend: Any) -> Iterator[None]:
    """Within the block, the next gloo group torch creates
    (``init_process_group``, ``new_group``) takes ``backend``, a
    ``ProcessGroupGloo`` already connected, as its backend instead of
    connecting one of its own; everything else about the group is torch's.
    Raises RuntimeError at the block's end if torch did not take it.

    Why: building a gloo backend waits, without a way to stop it, until every
    rank has connected or its timeout has passed; built on a thread of its
    own, it can be given up when a rank is found dead meanwhile
    (Note [a death while the group is built] in tandem/control/elastic_group.py).
    Every torch from 2.4 on creates a group's gloo backend in
    ``_new_process_group_helper`` by calling the module's ``ProcessGroupGloo``
    with the group's store, rank, size and timeout, and checks the result
    with ``isinstance`` against the same name.
    """
    import torch.distributed.distributed_c10d as c10d

    real = c10d.ProcessGroupGloo
    stand_in = _GivenGloo(real, backend)
    c10d.ProcessGroupGloo = stand_in  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        c10d.ProcessGroupGloo = real  # type: ignore[misc]
    if stand_in.given:
        raise RuntimeError("torch created no gloo backend where tandem gave it one: this torch builds groups "
                           "otherwise (tandem._compat.given_gloo_backend)")


def group_label(group: torch.distributed.ProcessGroup | None) -> str:
    """A name for ``group`` that is the same on every member rank.

    Why: debug-mode fingerprints are keyed by group. torch names groups
    consistently across ranks (``group_name``, public on ProcessGroup in recent
    versions); the ranks list is the fallback, which two groups over the same
    ranks share (they then share one call counter, which is still consistent
    across ranks because every rank issues in program order).
    """
    if group is None:
        return "world"
    name = getattr(group, "group_name", None)
    if isinstance(name, str) and name:
        return name
    ranks = torch.distributed.get_process_group_ranks(group)
    return "ranks " + ",".join(map(str, ranks))


__all__ += ["dist_autograd_context_id"]


def dist_autograd_context_id() -> int | None:
    """The id of the distributed autograd context this thread runs in, or None.

    Why: under ``torch.distributed.autograd`` gradients land in the context, not in
    ``param.grad``, and DDP must reduce them there (Note [distributed autograd] in
    tandem/ddp/dist_autograd.py); torch's reducer reads the same thread-local in C++.
    Without an RPC agent there is no context: one flag read, no exception.
    """
    if not torch.distributed.rpc.is_available():
        return None
    if not torch._C._distributed_rpc._is_current_rpc_agent_set():  # type: ignore[attr-defined]
        return None
    import torch.distributed.autograd as dist_autograd
    try:
        context = dist_autograd._current_context()  # type: ignore[attr-defined]
    except RuntimeError:  # "Current thread doesn't have a valid autograd context"
        return None
    return int(context._context_id())


# ---------------------------------------------------------------- torch.compile (tandem.ddp.compile)

__all__ += ["enter_ddp_forward", "exit_ddp_forward"]

from torch.nn.parallel import DistributedDataParallel as _TorchDDP  # noqa: E402


def enter_ddp_forward(hint: Any) -> Any:
    """Tell ``torch.compile`` that a DDP forward is running, with ``hint``'s
    ``bucket_bytes_cap``; returns what to pass to :func:`exit_ddp_forward`.
    Call it, and its pair, from code that dynamo does not trace (the write must
    happen for real, before the inner module's frame is compiled).

    Why: dynamo splits the graph of a frame it compiles at DDP bucket boundaries
    (its DDPOptimizer, Note [torch.compile] in tandem/ddp/compile.py) only while
    ``torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()``
    returns something, and reads nothing from it but ``bucket_bytes_cap``; that
    classmethod returns the private class attribute ``_active_ddp_module``, which
    torch's DDP sets around its inner module call (torch 2.0 to 2.13 at least).
    """
    previous = getattr(_TorchDDP, "_active_ddp_module", None)
    _TorchDDP._active_ddp_module = hint  # type: ignore[attr-defined]
    return previous


def exit_ddp_forward(previous: Any) -> None:
    """Undo :func:`enter_ddp_forward` (nested DDP forwards restore the outer one)."""
    _TorchDDP._active_ddp_module = previous  # type: ignore[attr-defined]


__all__ += ["TorchDispatchMode", "allocation_events"]

# Why: init_like_unsharded (tandem/fsdp/init.py) intercepts the random ops of
# nn.init on DTensors before DTensor's dispatch does; a dispatch mode is the
# only scoped hook below autograd. Public in spirit (documented as "Python
# dispatch" and used by torch's own FlopCounterMode), private in module name.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


def allocation_events(prof: Any) -> list[tuple[int, int, int]]:
    """``(time_ns, address, bytes)`` of every allocation (positive) and free
    (negative) that a ``torch.profiler.profile(profile_memory=True)`` session
    recorded, in time order. The size of a free of a block allocated before
    the session may be wrong (the profiler's table of sizes keeps stale
    entries); match frees to the session's own allocations by address.

    Why: tandem.testing.memory measures the peak bytes a piece of code holds
    on CPU, where torch has no allocator statistics (``torch.cuda`` has); the
    profiler's allocation events, one per allocation and free of the CPU
    allocator (``storage.resize_`` included, which a dispatch mode never sees),
    are only exposed through this experimental event tree.
    """
    from torch._C._profiler import _EventType

    out: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            out.append((node.start_time_ns, int(fields.ptr), int(fields.alloc_size)))
        stack.extend(node.children)
    out.sort()
    return out


# ---------------------------------------------------------------- checkpoints (tandem.checkpoint.flat)

__all__ += ["flatten_state_dict"]


def flatten_state_dict(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A nested state dict as torch.distributed.checkpoint flattens it: dotted keys
    to leaves, and the mapping from each key back to its path.

    Why: tandem's DCP load planner (Note [flat shards in DCP] in
    tandem/checkpoint/flat.py) sets itself up as the default planner does, minus
    its re-allocation of meta tensors, which drops the values it does not know;
    the flattening must be DCP's own so that keys match what DCP saved
    (``torch.distributed.checkpoint._nested_dict``, torch 2.2 to 2.13 at least).
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    return flatten(state_dict)


__all__ += ["forget_default_group", "reset_group_names"]

# Groups left behind by forget_default_group, never destroyed (see there).
_FORGOTTEN: list[Any] = []


def reset_group_names() -> None:
    """Name the next process group as every other rank does.

    Why: torch names each new group by a counter of the process
    (``_world.group_count``), and the group's keys in the store carry that
    name, so ranks that build a group together must have counted alike. An
    elastic job's attempt to build a generation's group that failed (a member
    died as it was built: Note [arrivals] in tandem/control/elastic_group.py) counted
    a group on the ranks that got as far as ``init_process_group``, and not on
    the ones that saw the death first: in the next generation their keys
    differed and every member waited for the others' until the timeout. The
    bookkeeping is torch's private ``_world`` (torch 2.4 to 2.13).
    """
    from torch.distributed import distributed_c10d as c10d

    c10d._world.group_count = 0


def forget_default_group() -> None:
    """Unset the default process group without shutting it down.

    Why: an elastic job (Note [elastic default group] in tandem.control.elastic_group)
    replaces the default group after a peer died. ``destroy_process_group`` and
    ``ProcessGroup.abort`` join gloo's worker threads, and a worker can be
    blocked in a collective with a peer that is alive but has left the group
    (it started the next bucket's all-reduce, the peer did not), until the
    group's timeout (10 minutes). So the old group is kept, unreachable, in
    ``_FORGOTTEN`` (what is blocked in it ends when the new world's members cut
    its connections, Note [severing a forgotten group] in
    ``tandem.comm.connections``, or at its timeout) and torch's registry is
    cleared as ``destroy_process_group`` clears it for the default group. The
    bookkeeping is torch's private ``_world`` (torch 2.4 to 2.13).
    """
    import ctypes

    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    pg = c10d.GroupMember.WORLD
    forgotten_before = len(_FORGOTTEN)
    _FORGOTTEN.extend(world.pg_map)
    c10d._update_default_pg(None)
    for name in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
                 "pg_coalesce_state"):
        getattr(world, name).clear()
    if hasattr(c10d, "_unregister_all_process_groups"):
        c10d._unregister_all_process_groups()
    world.group_count = 0
    if pg is not None and pg not in _FORGOTTEN:
        _FORGOTTEN.append(pg)
    # Never destroyed, not even as the interpreter exits: its destructor would wait
    # for the blocked workers (up to the group's timeout) and hold up the exit.
    for group in _FORGOTTEN[forgotten_before:]:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


# ---------------------------------------------------------------- testing (tandem.testing)

__all__ += ["fake_store"]


def fake_store() -> torch.distributed.Store:
    """The store for ``init_process_group("fake", ...)``: one rank of a world of N
    in one process, whose collectives return at once and leave their outputs as
    they are.

    Why: torch's fake process group is the way to run one rank of a large world
    for real (its shards, gathered units, kernels) without the other ranks. Its
    ``FakeStore`` lives in ``torch.testing._internal.distributed.fake_pg``, and
    importing that module is also what registers the ``"fake"`` backend on
    torch before 2.10 (later ones have it built in; torch 2.4 to 2.13 all have
    the module).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


__all__ += ["all_gather_into_tensor", "reduce_scatter_tensor"]

# Why: torch 2.13 renamed the tensor forms of these collectives (the old names
# warn); torch 2.4 has only the old ones.
reduce_scatter_tensor = getattr(torch.distributed, "reduce_scatter_single", None) or \
    torch.distributed.reduce_scatter_tensor
all_gather_into_tensor = getattr(torch.distributed, "all_gather_single", None) or \
    torch.distributed.all_gather_into_tensor
