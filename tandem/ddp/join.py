"""Uneven inputs: ranks that run out of batches shadow the collectives of those
that still train, so nobody hangs and every rank ends with the same model.

Built on torch's generic join algorithm (``torch.distributed.algorithms.join``):
its context manager counts the ranks still training each iteration and runs the
joined ranks' hooks; tandem's DDP supplies the hook that mirrors, collective for
collective, what one DDP iteration issues (Note [join mirror]).

# Note [join mirror]
Per iteration, a training rank issues, in this order: the join count (an
all-reduce, by the context manager's notify), the one-time bucket-order
broadcast, the buffer broadcast (from the highest training rank, agreed by an
all-reduce MAX) when buffers are synchronised, an all-reduce saying whether
this backward synchronises, then one all-reduce per bucket and, when used
parameters are tracked, the used-parameter map. A joined rank's main hook
issues the same sequence with zeros for gradients. When all ranks have joined,
the model of the last rank to join (the highest such rank) is broadcast to all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from torch.distributed.algorithms.join import Join, Joinable, JoinHook

if TYPE_CHECKING:
    from tandem.ddp.model_sync import ModelSync
    from tandem.ddp.reducer import GradReducer

__all__ = ["DDPJoinHook", "MirroredDDP", "join"]


class MirroredDDP(Protocol):
    """What the join hook needs from a DDP model: the steps of one iteration that
    a joined rank mirrors (Note [join mirror]). ``tandem.ddp.module``'s wrapper
    provides them; this module depends on the protocol, not on the wrapper,
    which imports this module."""

    require_forward_param_sync: bool
    forward_sync_buffers: bool
    _divide_by_initial_world_size: bool

    @property
    def reducer(self) -> GradReducer | None: ...

    @property
    def model_sync(self) -> ModelSync: ...

    def _will_sync_buffers(self) -> bool: ...


def join(joinables: list[Joinable], *, enable: bool = True, throw_on_early_termination: bool = False,
         divide_by_initial_world_size: bool = True, **kwargs: Any) -> Join:
    """A context manager for training with uneven inputs across ranks.

    Inside it, a rank whose data runs out keeps answering the collectives of the
    ranks that still train, until every rank has run out; then all ranks hold
    the model of the last rank to finish::

        with tandem.join([ddp_model]):
            for batch in loader:          # loaders of different lengths per rank
                loss_fn(ddp_model(batch)).backward()
                optimizer.step()

    Args:
        joinables: the DDP models (and any other ``Joinable``, such as torch's
            ZeroRedundancyOptimizer) used in the loop.
        enable: False turns the context into a no-op.
        throw_on_early_termination: raise on every rank as soon as one rank runs
            out of data, instead of shadowing.
        divide_by_initial_world_size: True (the default) averages gradients over
            the initial world size, so joined ranks count as zero gradients;
            False averages over the ranks still training.

    Raises:
        RuntimeError: on every rank, with ``throw_on_early_termination=True``,
            once any rank has run out of inputs.
    """
    return Join(list(joinables), enable=enable,
                throw_on_early_termination=throw_on_early_termination,
                divide_by_initial_world_size=divide_by_initial_world_size, **kwargs)


class DDPJoinHook(JoinHook):
    """Mirror one DDP iteration's collectives on a rank that has joined."""

    def __init__(self, ddp: MirroredDDP, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        sync = ddp.model_sync
        reducer = ddp.reducer
        if reducer is not None:
            reducer.before_forward()
        if ddp._will_sync_buffers():
            sync.buffers(sync.common_rank(candidate=False))
        should_sync = sync.agree_on_grad_sync(joined=True, wanted=False)
        ddp.require_forward_param_sync = should_sync
        if should_sync and reducer is not None:
            reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        sync = ddp.model_sync
        sync.final_model(sync.common_rank(candidate=is_last_joiner), buffers=ddp.forward_sync_buffers)
