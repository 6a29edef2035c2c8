"""``FSDPModule``: the methods ``fully_shard`` adds to a module (torch's FSDP2
API), each acting on the module's unit or on every unit under it, and the
handle ``unshard(async_op=True)`` returns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from tandem.comm.failure_gate import FailureGate
from tandem.fsdp.arguments import check_reshard
from tandem.fsdp.convert import adopt_sharded_tensors
from tandem.fsdp.regroup import reset_process_group, units_of
from tandem.fsdp.unit import ShardedUnit, unit_of
from tandem.fsdp.unit_state import ShardState

__all__ = ["FSDPModule", "UnshardHandle"]


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: ``wait()`` finishes the gather."""

    def __init__(self, unit: ShardedUnit) -> None:
        self._unit = unit

    def wait(self) -> None:
        if self._unit.state is ShardState.GATHERING:
            self._unit.wait_gather()


class FSDPModule:
    """The methods ``fully_shard`` adds to a module (torch's ``FSDPModule`` API)."""

    def reshard(self) -> None:
        """Free the full parameters now (registering the sharded ones)."""
        _unit(self).reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather the full parameters now; with ``async_op`` return a handle to wait on."""
        unit = _unit(self)
        if unit.state in (ShardState.SHARDED, ShardState.GROUP_SHARDED):
            unit.launch_gather()
        handle = UnshardHandle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward accumulates full gradients locally, without communication
        (torch DDP's ``no_sync``); the next backward with True reduces the sum."""
        for unit in _units(self, recurse):
            unit.requires_grad_sync = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters the gradients in backward but keeps the
        result as a partial sum instead of all-reducing it across the replicas;
        the next backward with True all-reduces the sum (torch's method). No
        effect on a 1-D mesh."""
        # Note [hybrid sharding] in unit.py.
        for unit in _units(self, recurse):
            unit.requires_all_reduce = bool(requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        for unit in _units(self, recurse):
            unit.reshard_after_forward = check_reshard(reshard_after_forward, unit.comm.size) is not False
            unit.auto_reshard_after_forward = False

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False keeps the full parameters after a backward without gradient sync
        (while accumulating with ``set_requires_gradient_sync(False)``, the next
        forward then needs no gather). A backward that syncs gradients always
        reshards: the optimizer step that follows would leave kept parameters stale."""
        for unit in _units(self, recurse):
            unit.reshard_after_backward = bool(reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these modules' units when this one's forward starts (default: the
        unit that ran next in the previous iteration)."""
        _unit(self).forward_prefetch = [_unit(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these modules' units when this one's backward starts (default: the
        unit whose forward finished just before this one's)."""
        _unit(self).backward_prefetch = [_unit(m) for m in modules]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's unit's summed gradients by ``factor`` instead of
        the data-parallel size (not its submodules', as in torch)."""
        if factor <= 0:
            raise ValueError(f"gradient divide factor must be positive, got {factor}")
        _unit(self).divide_factor = float(factor)

    set_reduce_scatter_divide_factor = set_gradient_divide_factor

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with sums only, dividing afterwards: what tandem always does,
        so the gradients are the same either way; with ``enable`` the hook of
        :meth:`set_all_reduce_hook` sees the sums before the division, as in
        torch."""
        # Sums always: Note [gradient flags] in unit.py.
        _unit(self).overrides.force_sum = bool(enable)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Call ``hook(reduced)`` on this unit's reduced gradient shard (flat, in
        ``reduce_dtype``, laid out as the shards): after the reduce-scatter,
        or under HSDP after the all-reduce across replicas; it may change it in
        place (a custom all-reduce over another group), before the sharded
        ``.grad`` is set. As in torch, it sees the mean, or the sum with
        :meth:`set_force_sum_reduction_for_comms`.

        Raises:
            NotImplementedError: ``stream`` is given (tandem reduces on the
                current stream; drop the argument).
        """
        if stream is not None:
            raise NotImplementedError(
                "set_all_reduce_hook(stream=...): tandem runs the hook on the current stream, after the "
                "reduction it follows; call set_all_reduce_hook(hook) without a stream")
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook: hook must be callable (reduced gradient) -> None, got {hook!r}")
        _unit(self).overrides.all_reduce_hook = hook

    def set_custom_all_gather(self, comm: Any) -> None:
        """Gather this unit with ``comm``, torch's ``AllGather``: its
        ``allocate(size, dtype=, device=)`` makes the output buffer and
        ``comm(output_tensor=, input_tensor=, group=, async_op=True)`` issues the
        collective (it must return a work handle, or None when done).

        Raises:
            ValueError: the unit's ``comm_policy`` quantizes its gathers.
        """
        _check_comm(comm, "set_custom_all_gather")
        _check_not_quantized(_unit(self), "weight_bits", "set_custom_all_gather")
        _unit(self).overrides.all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce-scatter this unit's gradients with ``comm``, torch's
        ``ReduceScatter``: ``allocate`` makes the input and output buffers,
        ``comm(output_tensor=, input_tensor=, group=, op=ReduceOp.SUM,
        async_op=True)`` issues it. The input is tandem's: each rank's chunk
        ends with one flag per parameter (1 where this rank produced a
        gradient), which a custom reduction must sum like the rest.

        Raises:
            ValueError: the unit's ``comm_policy`` quantizes its reductions.
        """
        # The flags: Note [gradient flags] in unit.py.
        _check_comm(comm, "set_custom_reduce_scatter")
        _check_not_quantized(_unit(self), "grad_bits", "set_custom_reduce_scatter")
        _unit(self).overrides.reduce_scatter = comm

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this unit is not gathered for its backward, whose gradients
        need no parameter values (an embedding's); as in torch, for experts
        who know so: a backward that reads them fails or reads freed memory."""
        _unit(self).unshard_in_backward = bool(unshard_in_backward)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """True: a parameter that no rank used in a backward gets a zero sharded
        gradient instead of None (torch's meaning). Ranks using different
        parameters need nothing set: tandem reduces every parameter of a
        unit on every rank."""
        # Note [gradient flags] in unit.py.
        for unit in _units(self, recurse):
            unit.reduce_scatter_unused_params = bool(reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """At most ``max_input_buffers`` reduce-scatters in flight, each holding
        its full-size input, when one of these units launches its own (by
        default 1, as torch's, where a wait does not hold the host (NCCL), 2
        where it does (gloo))."""
        # Note [reductions in flight] in schedule.py.
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int) or max_input_buffers < 1:
            raise ValueError(f"set_reduce_scatter_max_input_buffers: max_input_buffers={max_input_buffers!r} must be "
                             "an int >= 1 (1: each reduce-scatter finishes before the next starts)")
        for unit in _units(self, recurse):
            unit.max_reduce_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """tandem always reduce-scatters on a process group of its own, apart
        from the all-gathers': True is accepted as it is.

        Raises:
            NotImplementedError: ``enable=False``: one group for gathers and
                reduce-scatters would let them interleave differently on
                different ranks; remove the call.
        """
        if not enable:  # Note [two groups] in schedule.py
            raise NotImplementedError(
                "set_separate_reduce_scatter_group(False): tandem's reduce-scatters need a process group "
                "apart from the all-gathers' (Note [two groups] in tandem/fsdp/schedule.py: on one group they "
                "would interleave differently on ranks whose gradients arrive at other moments); remove the call")

    def set_post_optim_event(self, event: Any) -> None:
        """The root's next forward waits for ``event`` (recorded after the
        optimizer step) before its first gather, once; tandem issues gathers
        on the current stream, which is also ordered after the step."""
        _unit(self).overrides.gather_after = event

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """False is tandem's behaviour (buffers from torch's allocator).

        Raises:
            NotImplementedError: ``enable=True``: the process group's own
                allocator (NCCL zero-copy) is not supported; remove the call.
        """
        if enable:
            raise NotImplementedError(
                "set_allocate_memory_from_process_group_for_comm(True): tandem allocates its collective "
                "buffers with torch's caching allocator, not the process group's; remove the call (or give "
                "set_custom_all_gather / set_custom_reduce_scatter a comm whose allocate() uses it)")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Raises NotImplementedError: symmetric-memory all-gathers are not
        supported; remove the call (or give :meth:`set_custom_all_gather` a comm
        whose ``allocate`` returns symmetric memory)."""
        raise NotImplementedError(
            f"set_symm_mem_for_comm({backend!r}): tandem's all-gather buffers come from torch's caching "
            "allocator, not symmetric memory; remove the call, or give set_custom_all_gather a comm whose "
            "allocate() returns symmetric memory")

    def reset_iter_state(self) -> None:
        """After an exception stopped a forward or backward: finish the
        collectives in flight and drop this iteration's gradients (unsynced
        sums and HSDP partial sums included), reshard every unit and clear the
        iteration's tracking, as torch does; the next iteration runs normally.
        Call it on the root (the module whose forward ran first).

        Raises:
            RuntimeError: called on a module that is not the root.
        """
        unit = _unit(self)
        schedule = unit.schedule
        if schedule is None:
            return  # no forward yet: nothing to reset
        if schedule.root is not unit:
            raise RuntimeError(
                f"reset_iter_state() was called on {type(self).__name__} (unit '{unit.name}'), which is not the "
                f"root: call it on the root module (unit '{schedule.root.name}', the first to run forward)")
        schedule.reset()

    def reset_process_group(self) -> None:
        """Lay every unit under this module out again over the current default
        group, after an elastic job replaced it: the same parameter objects (so
        an optimizer's references and state stay valid), with zeros in the
        shards until the caller loads them. No communication. Collectives are issued again
        after a failure the handler of :meth:`set_failure_handler` claimed.

        Raises:
            RuntimeError: a sharded parameter still holds a gradient.
        """
        reset_process_group(cast(nn.Module, self))  # Note [regrouped units] in regroup.py

    def set_failure_handler(self, handler: Callable[[BaseException], bool] | None) -> None:
        """Let a collective that fails in this model's forward or backward be
        recovered from, as ``DistributedDataParallel.set_failure_handler`` does for
        its reduction (an elastic loop's): ``handler(error)`` returns True when
        it claims the failure, and the step then goes on without communication
        until :meth:`reset_process_group` lays the units out for the new world.
        None removes it. Call it on the root; it covers every unit under it.
        """
        # Note [a broken step goes on] in tandem/comm/failure_gate.py.
        gate = None if handler is None else FailureGate(handler)
        for unit in _units(self, True):
            unit.gate = gate
            unit.guard_comms()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for torch compatibility; every backward finishes its reductions."""

    # Note [copying a sharded model]: torch's fully_shard refuses deepcopy
    # ("FSDP does not support deepcopy. Please use state dict for
    # serialization.") and its modules fail to pickle (their FSDP<class> cannot
    # be looked up); so do tandem's, with an error that names the fix. A copy
    # would need its own units, shard buffers and schedule over the group, which
    # rebuilding the model does better. A shallow copy.copy works, as in torch.
    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise _cannot_copy(self, "deep-copied")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise _cannot_copy(self, "pickled (torch.save)")

    def __copy__(self) -> Any:
        cls = type(self)
        new = cls.__new__(cls)
        new.__dict__.update(self.__dict__)
        return new

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``to_empty``/``to``/``cuda`` on a sharded model (Note [meta init] in api.py)."""
        # nn.Module._apply calls each child's _apply before converting this module's
        # own parameters; a child whose tiny unit was merged into this module's
        # (Note [tiny units] in api.py) would adopt the unit half converted. The outermost
        # call adopts each unit once, when all of its parameters are converted.
        units = [unit for unit in _units(self, True) if not unit.applying]
        for unit in units:
            unit.reshard()
            unit.applying = True
        try:
            result = super()._apply(fn, recurse)  # type: ignore[misc]
        finally:
            for unit in units:
                unit.applying = False
        for unit in units:
            adopt_sharded_tensors(unit)
        return result


# ---------------------------------------------------------------------- helpers

def _unit(module: Any) -> ShardedUnit:
    unit = unit_of(module)
    if unit is None:
        raise ValueError(f"{type(module).__name__} is not a fully_shard module")
    return unit


def _check_comm(comm: Any, method: str) -> None:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(f"{method}: comm must be a torch.distributed.fsdp AllGather/ReduceScatter (a callable with "
                        f"an allocate(size, dtype=, device=) method), got {comm!r}")


def _check_not_quantized(unit: ShardedUnit, field: str, method: str) -> None:
    """A custom collective replaces the one a ``comm_policy`` quantizes: refuse the pair."""
    policy = unit.config.comm_policy
    if policy is not None and getattr(policy, field) is not None:
        raise ValueError(
            f"rank {dist.get_rank() if dist.is_initialized() else 0}: {method} on fully_shard unit '{unit.name}', "
            f"whose comm_policy={policy} quantizes that collective: a custom one would replace it. Use one or "
            f"the other: fully_shard it with QuantizedCommPolicy({field}=None), or drop the {method} call")


def _cannot_copy(module: Any, how: str) -> TypeError:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return TypeError(
        f"rank {rank}: a {type(module).__name__} sharded by tandem.fully_shard cannot be {how}: its "
        "parameters are this rank's shards, bound to its process group (torch's fully_shard refuses "
        "this too). Copy its state instead: build the model again, fully_shard it the same way and "
        "load_state_dict(model.state_dict()) (sharded, no communication), or save model.state_dict() "
        "with torch.distributed.checkpoint (its DTensors' full_tensor() gathers a full one, a collective)")


def _units(module: Any, recurse: bool) -> list[ShardedUnit]:
    return units_of(module) if recurse else [_unit(module)]
