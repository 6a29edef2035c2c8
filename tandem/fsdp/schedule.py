"""When each unit of one root gathers, reshards and reduces: the forward hooks
fully_shard puts on each unit's module(s), the backward hooks they add, the
root's lazy init, prefetching, and one launch order for every rank.

The first unit to run forward becomes the root (as in torch's FSDP2) of every
unit under it: :func:`lazy_init` gives those units their process groups (Note
[two groups]) and gradient hooks, and one :class:`Schedule` then drives them
all, calling each unit's gather, reshard and reduction (unit.py).

# Note [two groups]
All-gathers and reduce-scatters go to two process groups over the same ranks.
Collectives are matched by their order of issue within a group, and the two
kinds interleave differently on different ranks as soon as one rank's
gradients arrive at another moment (a parameter it did not use, say). Within
each group the order is the same everywhere: gathers follow the units' forward
and backward order, which all ranks share, and reduce-scatters follow
:attr:`Schedule.reduce_order` (Note [reduce order] in schedule.py).

# Note [fully_shard under torch.compile]
Blocks may be compiled one by one, as torchtitan does with torch's FSDP2:
``torch.compile(block)`` before ``fully_shard`` (the compiled wrapper becomes
the unit's module), or after it (``torch.compile(sharded)`` or
``sharded.compile()``). Each block's forward is one graph, and a unit's
gathers and reductions run between graphs, where the hooks are: before
``fully_shard`` they are the compiled wrapper's hooks, which run outside its
graph; after it, dynamo meets them while tracing ``Module._call_impl``, so the
forward hooks are disabled for dynamo (torch's FSDP2 disables its own): they
gather through tandem's comm layer, and a collective traced into a graph would
bypass it. The backward hooks are run by the autograd engine, outside compiled
code. The graph reads the unit's ``unsharded`` parameters, the same objects at
every step (their storage is freed and allocated again), so one graph serves
every step and every block of a class.

# Note [reduce order]
A unit's reduce-scatter is launched as soon as its gradients are in *and*
every unit before it in ``reduce_order`` has launched: the reverse of this
iteration's forward order, then units that did not run. That is the order in
which backward completes units, so launches are rarely held back; a rank on
which some unit got no gradient (unused parameters) launches the rest of the
queue at the end of backward, in the same order as every other rank.

# Note [unit completion]
A unit's backward is over, so it can reshard and reduce, when either every one
of its parameters is trainable and has accumulated a gradient (post-accumulate-grad
hooks), or the gradient of the inputs of each of its forward calls in this
iteration has been computed (an autograd function on those inputs, as torch's
FSDP2 does): the second covers units with parameters this step did not use,
which would otherwise wait for the end of backward. The engine runs a
parameter's AccumulateGrad before any node created earlier in forward, so by
then every gradient the unit will get is in. A frozen parameter has no such
hook, and a node created before the trainable ones' may still read it (the
frozen base weight of a LoRA linear, for its input's gradient), so a unit with
one completes only by its inputs, or at the end of backward. A call whose inputs need no
gradient (the root's token ids) has no such node: such a unit completes by its
gradients, or at the end of backward.

# Note [prefetch]
torch's FSDP2 overlaps gathers with compute through CUDA streams, and on CPU
nothing overlaps. Here each gather is an async collective, so overlap needs no
streams: a unit's pre-forward launches the gather of the unit that ran after it
in the previous iteration, and its pre-backward the gather of the unit that
finished forward before it, unless set_modules_to_*_prefetch names others.

# Note [grouped modules]
``fully_shard([norm, head])`` makes one unit of several modules (torch's
FSDP2 takes a list so, for chunked losses: the model's forward runs ``norm``,
the loss calls ``head`` per chunk). The unit is gathered at the first of its
modules' pre-forwards in an iteration and resharded after the last of them
has run forward (``pending_forward`` holds the others); a module of the group
that the root's forward did not run is completed at the end of that forward.
Unlike torch, every module's output gets the pre-backward hook, not only the
last one's: backward may reach the modules in any order, and whichever comes
first gathers the unit. A group cannot be the root (torch refuses it too):
call fully_shard on a module that contains it.

# Note [recomputed forward]
Activation checkpointing (torch's non-reentrant ``checkpoint``) runs part of
a forward again inside backward. When the checkpointed code is inside a unit
(``checkpoint`` in a block's forward, or ``checkpoint_wrapper`` applied to
each block before ``fully_shard``, as torchtitan does), the unit's hooks do
not run again: the pre-backward hook on the unit's outputs gathered it when
backward reached them, before the engine gets to the checkpointed node, so the
recomputation finds the full parameters registered, and the unit completes
(reshards, reduces) only when their gradients are in, after it. When the
wrapper is outside the unit (checkpointing after ``fully_shard``), the
recomputation calls the unit's forward hooks in its backward: the unit is
gathered already (PRE_BACKWARD), and the hooks neither gather, track inputs,
reshard nor add backward hooks. Either way a unit is gathered once for its
backward (tests/fsdp/test_activation_checkpointing.py counts the all-gathers).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem._compat import not_traced, queue_backward_callback
from tandem._tree import iter_tensors, map_tensors, to_device
from tandem.control.elastic_group import new_world_group
from tandem.comm.group import GroupComm
from tandem.fsdp.unit import ShardedUnit, unit_of
from tandem.fsdp.unit_state import ReduceState, ShardState, UnitPhase

__all__ = ["Schedule", "lazy_init", "post_forward", "pre_forward"]

logger = logging.getLogger(__name__)


@not_traced  # Note [fully_shard under torch.compile]
def pre_forward(unit: ShardedUnit, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The forward pre-hook of a unit's module."""
    schedule = unit.schedule if unit.schedule is not None else lazy_init(unit, module)
    return schedule.pre_forward(unit, args, kwargs)


@not_traced  # Note [fully_shard under torch.compile]
def post_forward(unit: ShardedUnit, module: nn.Module, args: tuple, output: Any) -> Any:
    """The forward hook of a unit's module."""
    assert unit.schedule is not None
    return unit.schedule.post_forward(unit, module, output)


def lazy_init(root: ShardedUnit, root_module: nn.Module) -> Schedule:
    """Make ``root`` the root of every unit under ``root_module`` (its first forward)."""
    if len(root.modules) > 1:
        names = ", ".join(type(m).__name__ for m in root.modules)
        raise RuntimeError(f"fully_shard: the unit of a list of modules ({names}) ran forward first, as the root; "
                           "a group cannot be the root (Note [grouped modules]): call fully_shard on the model "
                           "that contains them too, and run forward through it")
    units: list[ShardedUnit] = []
    for path, module in root_module.named_modules():
        unit = unit_of(module)
        if unit is None or unit in units:
            continue
        if unit.params.on_meta:
            rank = dist.get_rank() if dist.is_initialized() else 0
            fqns = [f"{path}.{m.fqn}" if path else m.fqn for m in unit.params.managed]
            raise RuntimeError(
                f"rank {rank}: fully_shard parameters are still on the meta device ({', '.join(fqns[:4])}"
                f"{', ...' if len(fqns) > 4 else ''}): call model.to_empty(device=...) and initialise them "
                "(the model's init_weights() under tandem.fsdp.init_like_unsharded(), or load a state dict) "
                "before the first forward")
        if unit.schedule is not None:
            raise RuntimeError(
                f"fully_shard: '{path}' already ran forward as a root of its own; run forward through "
                "the outermost fully_shard module first (it becomes the root of the units inside it)")
        unit.params.name = path or "<root>"
        units.append(unit)
    schedule = Schedule(root, units)
    if root.auto_reshard_after_forward:
        root.reshard_after_forward = False
    reduce_comms: dict[tuple[int, ...], GroupComm] = {}
    group_comms: dict[tuple[tuple[int, ...], int], GroupComm] = {}
    for unit in units:
        unit.schedule = schedule
        ranks = tuple(dist.get_process_group_ranks(unit.comm.group or dist.group.WORLD))
        if ranks not in reduce_comms:
            reduce_comms[ranks] = _second_group(ranks, unit.comm)
        unit.reduce_comm = reduce_comms[ranks]
        unit.guard_comms()
        k = unit.reshard_after_forward
        if not isinstance(k, bool):
            key = (ranks, k)
            if key not in group_comms:
                group_comms[key] = _subgroup(ranks, k, unit.comm.rank)
            unit.group_comm = group_comms[key]
        unit.params.watch_grads(functools.partial(schedule.on_grad, unit))
    logger.info("fully_shard: root with %d units, %d parameters, %d elements, world %d",
                len(units), sum(len(u.params.managed) for u in units), sum(u.params.layout.numel for u in units),
                root.comm.size)
    return schedule


def _second_group(ranks: tuple[int, ...], comm: GroupComm) -> GroupComm:
    """The reduce-scatter group (Note [two groups])."""
    if comm.size == 1:
        return comm
    if len(ranks) == dist.get_world_size():  # an elastic job's members wait for each other first
        return GroupComm(new_world_group("fully_shard reduce-scatters"))
    return GroupComm(dist.new_group(list(ranks), use_local_synchronization=True))


def _subgroup(ranks: tuple[int, ...], k: int, rank: int) -> GroupComm:
    """The group of ``k`` consecutive ranks holding this rank, for reshard_after_forward=k."""
    start = rank // k * k
    return GroupComm(dist.new_group(list(ranks[start:start + k]), use_local_synchronization=True))


class Schedule:
    """The iteration state of one root and all units under it."""

    def __init__(self, root: ShardedUnit, units: list[ShardedUnit]) -> None:
        self.root = root
        self.units = units                          # pre-order under the root
        self.pre_forward_order: list[ShardedUnit] = []
        self.post_forward_order: list[ShardedUnit] = []
        self.last_pre_forward_order: list[ShardedUnit] = []
        self.reduce_order: list[ShardedUnit] = []   # Note [reduce order]
        self.next_reduce = 0
        self.in_forward = False
        self.in_backward = False
        self._callback_queued = False

    # ------------------------------------------------------------------ forward
    def pre_forward(self, unit: ShardedUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if unit.phase is UnitPhase.PRE_BACKWARD:  # Note [recomputed forward]
            unit.unshard()
            return _cast_inputs(unit, args, kwargs)
        if unit is self.root and not self.in_forward:
            self._begin_forward()
            if unit.config.device.type != "cpu":
                args, kwargs = to_device(args, unit.config.device), to_device(kwargs, unit.config.device)
        if not unit.pending_forward:  # Note [grouped modules]
            unit.pending_forward = {id(m) for m in unit.modules}
        unit.phase = UnitPhase.FORWARD
        unit.unshard()
        if torch.is_grad_enabled():
            args, kwargs = self._track_inputs(unit, args, kwargs)
        if unit not in self.pre_forward_order:
            self.pre_forward_order.append(unit)
        targets = unit.forward_prefetch
        if targets is None:
            targets = _after(self.last_pre_forward_order, unit)
        for target in targets:
            if target.state in (ShardState.SHARDED, ShardState.GROUP_SHARDED):
                target.launch_gather()
        return _cast_inputs(unit, args, kwargs)

    def post_forward(self, unit: ShardedUnit, module: nn.Module, output: Any) -> Any:
        if unit.phase is UnitPhase.PRE_BACKWARD:  # Note [recomputed forward]
            return _cast_output(unit, output)
        grad = torch.is_grad_enabled()
        if grad:
            hook = functools.partial(self._pre_backward, unit)
            for t in iter_tensors(output):
                if t.requires_grad:
                    t.register_hook(hook)
        unit.pending_forward.discard(id(module))
        if not unit.pending_forward:  # Note [grouped modules]: the last of the group to run
            self._finish_forward(unit, grad)
        if unit is self.root:
            self._end_forward()
        return _cast_output(unit, output)

    def _finish_forward(self, unit: ShardedUnit, grad: bool) -> None:
        reshard = unit.reshard_after_forward
        if not grad and unit.auto_reshard_after_forward:
            reshard = True  # no backward will follow to use the root's parameters
        if reshard is True:
            unit.reshard()
        elif reshard is not False:  # an int: keep a slice for the smaller group
            unit.reshard(keep_group_shard=True)
        unit.phase = UnitPhase.IDLE
        if unit not in self.post_forward_order:
            self.post_forward_order.append(unit)

    def _track_inputs(self, unit: ShardedUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Route the inputs through _InputsDone (Note [unit completion])."""
        tensors = [t for t in iter_tensors((args, kwargs)) if t.requires_grad]
        unit.forward_calls += 1
        if not tensors:
            unit.untracked_calls += 1
            return args, kwargs
        done = functools.partial(self._inputs_done, unit)
        replaced = dict(zip(map(id, tensors), _InputsDone.apply(done, *tensors)))
        swap = functools.partial(_swap, replaced)
        return map_tensors(swap, args), map_tensors(swap, kwargs)

    def _begin_forward(self) -> None:
        event = self.root.overrides.gather_after  # set_post_optim_event: waited once, then dropped
        if event is not None:
            event.wait()
            self.root.overrides.gather_after = None
        self.in_forward = True
        self.pre_forward_order = []
        self.post_forward_order = []
        for u in self.units:
            u.forward_calls = u.untracked_calls = u.inputs_done = 0
            u.pending_forward.clear()  # Note [grouped modules]: modules called after the last forward

    def _end_forward(self) -> None:
        self.in_forward = False
        grad = torch.is_grad_enabled()
        for u in self.units:  # Note [grouped modules]: a group whose other modules did not run
            if u.pending_forward and u is not self.root:
                u.pending_forward.clear()
                self._finish_forward(u, grad)
        self.last_pre_forward_order = list(self.pre_forward_order)
        for u in self.units:  # a prefetch the forward did not use: finish it, keep nothing
            if u.state is ShardState.GATHERING and u not in self.pre_forward_order:
                u.reshard()

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, unit: ShardedUnit, grad: torch.Tensor) -> torch.Tensor:
        self._enter_backward()
        if unit.phase is not UnitPhase.PRE_BACKWARD:
            unit.phase = UnitPhase.PRE_BACKWARD
            if unit.unshard_in_backward:  # False: its backward reads no parameter (set_unshard_in_backward)
                unit.unshard()
            targets = unit.backward_prefetch
            if targets is None:
                targets = _before(self.post_forward_order, unit)
            for target in targets:
                if (target.phase is not UnitPhase.PRE_BACKWARD and target.unshard_in_backward
                        and target.state in (ShardState.SHARDED, ShardState.GROUP_SHARDED)):
                    target.launch_gather()
        return grad

    def on_grad(self, unit: ShardedUnit, param: torch.Tensor) -> None:
        """A post-accumulate-grad hook of one of ``unit``'s unsharded parameters."""
        self._enter_backward()
        if unit.grad_ready():
            self._complete(unit)

    def _inputs_done(self, unit: ShardedUnit) -> None:
        unit.inputs_done += 1
        if not unit.untracked_calls and unit.inputs_done == unit.forward_calls:
            self._complete(unit)

    def _complete(self, unit: ShardedUnit) -> None:
        """Note [unit completion]: reshard and queue the reduction; both triggers
        may fire in one backward, the second does nothing."""
        if unit.completed:
            return
        unit.mark_ready()
        if _reshards_after_backward(unit):
            unit.reshard()
        self._launch_ready()

    def _enter_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            queue_backward_callback(self._finish_backward)
        if not self.in_backward:
            self.in_backward = True
            ran = list(reversed(self.last_pre_forward_order))
            self.reduce_order = [u for u in ran + [u for u in self.units if u not in ran]
                                 if u.params.num_trainable]
            self.next_reduce = 0
            for u in self.units:
                u.reset_step()

    def _launch_ready(self) -> None:
        while self.next_reduce < len(self.reduce_order):
            unit = self.reduce_order[self.next_reduce]
            if unit.reduce_state is not ReduceState.READY:
                return
            if unit.requires_grad_sync:
                self._finish_reductions(keep=unit.reduce_buffers - 1)  # Note [reductions in flight]
                unit.launch_reduce()
            else:
                unit.skip_reduce()
            self.next_reduce += 1

    def _finish_reductions(self, keep: int = 0) -> None:
        """Finish the reductions in flight that have completed, then the oldest
        until at most ``keep`` remain.

        # Note [reductions in flight]
        A reduce-scatter holds its input (the unit's gradients, full size, in
        ``reduce_dtype``) until it is finished, so before a unit launches its
        own, the reductions in flight are finished (waited for) until fewer
        than the cap remain; those that have completed are finished first
        either way. The cap (``set_reduce_scatter_max_input_buffers(k)``,
        torch's name and meaning) depends on what a wait costs, unless set:

        - 1 where a wait does not hold the host (NCCL: it orders the compute
          stream after the collective and returns; the fake backend: done when
          issued), as torch's FSDP2 by default: one input buffer alive, the
          next unit's copy-in runs after the previous reduce-scatter on the
          device, as FSDP2's event wait orders it. Two here kept a second
          full-size buffer alive at the peak of backward (a collective the
          host ran ahead of has not completed when the next unit launches):
          +0.24 GiB over FSDP2 for a 1.4B GPT checkpointed at 8 ranks.
        - 2 where a wait holds the host until the collective completes (gloo,
          CPU tensors): backward goes on while the previous unit's
          reduce-scatter runs, and blocks only when the one launched a unit
          earlier is still running; blocking on the previous one at every
          launch stalled backward for a tenth of the step on 2 gloo ranks
          (BENCHMARKS.md). torch's FSDP2 waits for each reduce-scatter there
          as it issues it.

        Under HSDP a reduction has two stages (Note [hybrid sharding] in
        unit.py): a completed reduce-scatter launches its all-reduce here, and
        only in reduce order, so that every replicate group issues the same
        all-reduces in the same order: a unit whose reduce-scatter is still
        running holds back the all-reduces of the units after it.
        """
        in_flight = [u for u in self.reduce_order[:self.next_reduce] if u.reducing]
        held_back = False
        for i, unit in enumerate(in_flight):
            if len(in_flight) - i > keep:
                unit.finish_reduce()
                continue
            while unit.reducing and unit.reduce_done:
                if unit.reduce_state is ReduceState.IN_FLIGHT and held_back:
                    break
                unit.advance_reduce()
            held_back = held_back or unit.reduce_state is ReduceState.IN_FLIGHT

    def reset(self) -> None:
        """Forget an iteration that an exception stopped (FSDPModule.reset_iter_state):
        finish the collectives in flight, drop their gradients, reshard every
        unit, and clear what the hooks track; the next forward starts afresh."""
        for unit in self.units:
            unit.discard_reduce()
            unit.reshard()
            unit.phase = UnitPhase.IDLE
            unit.pending_forward.clear()
            unit.forward_calls = unit.untracked_calls = unit.inputs_done = 0
        self.pre_forward_order, self.post_forward_order = [], []
        self.reduce_order, self.next_reduce = [], 0
        self.in_forward = self.in_backward = self._callback_queued = False

    def _finish_backward(self) -> None:
        for unit in self.reduce_order[self.next_reduce:]:
            unit.mark_ready()  # not complete yet: zeros (Note [gradient flags] in unit.py)
        self._launch_ready()
        self._finish_reductions()
        for unit in self.units:
            unit.wait_host_grads()  # Note [gradients to the host] in unit.py
            if _reshards_after_backward(unit):
                unit.reshard()
            unit.phase = UnitPhase.IDLE
        self.in_backward = False
        self._callback_queued = False


class _InputsDone(torch.autograd.Function):
    """Identity in forward; its backward runs once the unit's backward for this
    call is over (Note [unit completion])."""

    @staticmethod
    def forward(ctx: Any, done: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.done = done
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.done()
        return (None, *grads)


def _swap(replaced: dict[int, torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    return replaced.get(id(t), t)


def _reshards_after_backward(unit: ShardedUnit) -> bool:
    """reshard_after_backward=False keeps a unit gathered only across backwards
    without gradient sync: after a synchronising one the optimizer steps the
    shards, and kept full parameters would be stale in the next forward (torch's
    FSDP2 keeps them, and trains on the stale values)."""
    return unit.reshard_after_backward or unit.requires_grad_sync


def _after(order: list[ShardedUnit], unit: ShardedUnit) -> list[ShardedUnit]:
    if unit in order:
        i = order.index(unit)
        if i + 1 < len(order):
            return [order[i + 1]]
    return []


def _before(order: list[ShardedUnit], unit: ShardedUnit) -> list[ShardedUnit]:
    if unit in order:
        i = order.index(unit)
        if i > 0:
            return [order[i - 1]]
    return []


def _cast_inputs(unit: ShardedUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    dtype = unit.config.param_dtype
    if dtype is None or not unit.config.cast_forward_inputs:
        return args, kwargs
    return map_tensors(functools.partial(_cast, dtype), args), map_tensors(functools.partial(_cast, dtype), kwargs)


def _cast_output(unit: ShardedUnit, output: Any) -> Any:
    dtype = unit.config.output_dtype
    if dtype is None:
        return output
    return map_tensors(functools.partial(_cast, dtype), output)


def _cast(dtype: torch.dtype, t: torch.Tensor) -> torch.Tensor:
    return t.to(dtype) if torch.is_floating_point(t) else t
