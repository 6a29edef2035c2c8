"""Pipeline stages that are data-parallel through tandem: torch's
``torch.distributed.pipelining.PipelineStage`` for a stage module wrapped in
``tandem.DistributedDataParallel`` or ``tandem.fully_shard``.

Use it where torch's would go::

    from tandem.pipelining import PipelineStage
    stage = PipelineStage(tandem.DistributedDataParallel(piece, device_mesh=mesh["dp"]),
                          stage_index, num_stages, device, group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches, loss_fn=loss_fn)

torch's ``PipelineStage`` defers the reduction to the last backward only for
torch's own DDP and FSDP classes; under it, tandem's DDP would average the
first micro-batch's gradients and add the others' unreduced, so that replicas
drift apart. This :class:`PipelineStage` runs every forward of a tandem DDP stage under
``no_sync()`` and reduces the gradients of all micro-batches once, in the last
backward of the step, with the same collectives on every replica. A
``fully_shard`` stage reduce-scatters once per step instead of once per
micro-batch, and keeps its parameters gathered between micro-batches.

In its first step, torch's schedule infers the stages' shapes by running each
stage module once more, outside the schedule. tandem's DDP ignores that pass;
under ``fully_shard`` it costs one more gather and, on stages after the first,
one reduce-scatter of zeros, which changes no gradient.
"""

# Note [pipeline stage adapter]
# torch's ``PipelineStage`` special-cases torch's own DDP and FSDP classes: it runs
# every micro-batch's forward and backward but the last backward under
# ``no_sync()``, and before the last backward calls the reducer's
# ``prepare_for_backward`` on that micro-batch's stage output (a schedule runs
# several forwards before their backwards, and the backward runs from
# ``torch.autograd.backward`` on activations, not from ``loss.backward()``).
# tandem's wrappers are other classes, and torch's stage treats them as plain
# modules: tandem's DDP arms its reducer in every forward and would average the
# first micro-batch's gradients at the end of its backward, then add the other
# micro-batches' local gradients to that average unreduced, so that replicas
# drift apart. :class:`PipelineStage` gives tandem's wrappers the same
# treatment torch gives its own: forwards under ``no_sync()``, and the reducer
# armed (``ddp.prepare_for_backward``) on the output of the
# last backward, so that the gradients of every micro-batch are summed locally and
# reduced once, in the last backward, with the same collectives on every replica.
# A ``fully_shard`` stage is correct under torch's stage as it is (each backward
# reduce-scatters its micro-batch's gradients and adds them to the sharded
# ``.grad``); the adapter makes it reduce in the last backward only
# (``set_requires_gradient_sync``), one reduce-scatter per step instead of one
# per micro-batch, and keeps the parameters gathered between micro-batches.
#
# In its first step, torch's schedule infers the stages' shapes by running each
# stage module once more, outside the schedule: a forward (not under ``no_sync``)
# and ``torch.autograd.grad`` to the stage's inputs only. tandem's DDP ignores
# that pass (it computes no parameter gradient, so it is not a synchronised
# backward: Note [end of backward] in tandem/ddp/reducer.py); under
# ``fully_shard`` it costs one more gather and, on stages after the first, one
# reduce-scatter of zeros, the same on every replica, which changes no gradient.

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from tandem.ddp import DistributedDataParallel
from tandem.fsdp import FSDPModule

__all__ = ["PipelineStage"]


# Note [pipeline stage adapter] at the top of this file.
class PipelineStage(_TorchPipelineStage):
    """A ``torch.distributed.pipelining.PipelineStage`` whose module is wrapped in
    ``tandem.DistributedDataParallel`` or ``tandem.fully_shard``: the gradients of
    all micro-batches are reduced once, in the last backward of a schedule step,
    as torch's stage does for torch's own wrappers. Any other module runs as in
    ``PipelineStage``.

    Takes ``PipelineStage``'s arguments. For the single-stage schedules whose
    backward is whole: tested with ``ScheduleGPipe`` and ``Schedule1F1B``; the
    zero-bubble ones, which split it into input and weight halves, are refused.

    Raises:
        NotImplementedError: torch's ``PipelineStage`` predates the hook this
            class overrides (``backward_maybe_with_nosync(backward_type,
            bwd_kwargs, last_backward)``; torch 2.4's takes the chunk id instead).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        hook = inspect.signature(_TorchPipelineStage.backward_maybe_with_nosync).parameters
        if "last_backward" not in hook:
            raise NotImplementedError(
                f"tandem.pipelining.PipelineStage needs torch's PipelineStage.backward_maybe_with_nosync("
                f"backward_type, bwd_kwargs, last_backward), but torch {torch.__version__} has {list(hook)}; "
                "upgrade torch")
        super().__init__(*args, **kwargs)

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.submod, DistributedDataParallel):
            with self.submod.no_sync():  # the reducer is armed in the last backward instead
                return self.submod(*args, **kwargs)
        return super().forward_maybe_with_nosync(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False,
                                   ) -> Any:
        submod = self.submod
        if isinstance(submod, (DistributedDataParallel, FSDPModule)) and backward_type != "full":
            raise NotImplementedError(
                f"stage {self.stage_index}: a {backward_type!r} backward (a zero-bubble schedule) is not "
                f"supported with a tandem {type(submod).__name__} stage; use ScheduleGPipe or Schedule1F1B")
        if isinstance(submod, DistributedDataParallel):
            if last_backward:
                # torch's DDP: reducer.prepare_for_backward(outputs). The accumulated
                # gradients of the earlier micro-batches join this backward's.
                submod.prepare_for_backward(bwd_kwargs["stage_output"])
        elif isinstance(submod, FSDPModule):
            submod.set_requires_gradient_sync(last_backward)
            submod.set_reshard_after_backward(last_backward)  # no gather between micro-batches
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
