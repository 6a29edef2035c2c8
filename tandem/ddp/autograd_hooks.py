"""Autograd's side of the reducer: the hooks through which backward tells it
that a parameter's gradient is final (the post-accumulate-grad hook, Note [hook
fast path]; the AccumulateGrad node's under distributed autograd) and that the
synchronised backward has begun, which queues the end of backward (Note [end of
backward]).

# Note [hook fast path]
The post-accumulate-grad hook runs once per parameter per backward, in Python,
where torch's reducer runs C++; on a model of 400 small tensors it is most of
what DDP costs. In the steady state (after the first step, no static-graph hook
counts, the end-of-backward callback already queued, grad mode off) a gradient
of a bucket that copies its gradients in one batch (Note [copy granularity] in
bucket.py) needs nothing but a mark: the hook marks it and launches the bucket
when it is the last; everything else (a first or second arrival, a per-parameter
copy, create_graph) takes the general path through _ready. Both paths keep the
same state, so either may take any gradient.

# Note [end of backward]
The finishing callback is queued on the autograd graph task that runs the
outputs' gradients (a hook on each output tensor), not on whichever task fires a
parameter hook first: with reentrant activation checkpointing, parameter hooks
fire inside nested backward passes, and a callback queued there would run before
the outer backward is done. A pass through the outputs that computes no
parameter gradient (``torch.autograd.grad(out, x, create_graph=True)`` for a
gradient penalty) is not the synchronised backward: the output hook queues the
callback only if the pass will execute a parameter's AccumulateGrad node, or
an opaque node (a reentrant checkpoint, whose nested passes compute the
gradients of the parameters it hides; torch cannot take ``autograd.grad``
through those, so such a pass is always a full backward).
Under ``backward(create_graph=True)`` hooks run with grad mode on; the reducer's
copies and reductions run under no_grad, so reduced gradients carry no graph
(as with torch's DDP, whose reducer works outside autograd).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from tandem._compat import accumulate_grad_node, queue_backward_callback, will_execute_in_this_backward
from tandem.comm.group import GroupComm
from tandem.ddp.bucket import BucketState
from tandem.ddp.dist_autograd import ContextGrads
from tandem.ddp.finish import Finishing
from tandem.ddp.graph import opaque_nodes
from tandem.ddp.reducer_state import ReducerOptions, StepState
from tandem.ddp.write_back import views_escaped

__all__ = ["AutogradHooks"]


class AutogradHooks(Finishing):
    """The reducer's fifth layer: a hook on every parameter's gradient and on the outputs."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], comm: GroupComm,
                 options: ReducerOptions) -> None:
        super().__init__(named_params, comm, options)
        # Note [end of backward]: which passes compute parameter gradients.
        self._acc_nodes = [accumulate_grad_node(p) for p in self.params]
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                       for i, p in enumerate(self.params)]

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        # Note [end of backward]
        if not self._callback_queued and self._pass_computes_param_grads():
            self._queue_finish()

    def _pass_computes_param_grads(self) -> bool:
        if any(map(will_execute_in_this_backward, self._acc_nodes)):
            return True
        # Rare: an input-only pass (gradient penalty), or every parameter hidden
        # behind reentrant checkpoints, whose nested passes compute them.
        return any(map(will_execute_in_this_backward, opaque_nodes(self._output_nodes)))

    def _queue_finish(self) -> None:
        """First thing in a synchronised backward: queue the end-of-backward
        callback and mark the parameters known to be unused."""
        if not self._callback_queued:
            self._callback_queued = True
            self._output_nodes = []
            queue_backward_callback(self._finish)
            if self._rebind and views_escaped(self.buffer, self.buckets):
                self._rebase()
            for i in self._pending_unused:
                self._mark_unused(i)
            self._launch_complete()

    def _on_grad(self, i: int, param: torch.Tensor | None = None) -> None:
        # Hot path: runs once per parameter per backward (the post-accumulate-grad hook).
        if self.state is not StepState.ARMED:
            return  # no_sync, or a backward that no synchronised forward armed
        if self._fast and self._callback_queued and not torch.is_grad_enabled():
            # Note [hook fast path]: the steady state of a batched-copy bucket.
            b, pos = self._where[i]
            bucket = self.buckets[b]
            ready = bucket.ready
            if not (ready[pos] or bucket.copies_per_param or bucket.state is not BucketState.FILLING):
                self._locally_used[i] = True
                ready[pos] = True
                bucket.num_ready += 1
                if bucket.num_ready == bucket.size:
                    self._launch_complete()
                return
        if torch.is_grad_enabled():  # backward(create_graph=True): Note [end of backward]
            with torch.no_grad():
                self._on_grad(i, param)
            return
        if not self._callback_queued:
            self._queue_finish()
        self._locally_used[i] = True
        if self._static:
            self._hook_count[i] += 1
            if self._expected_count is None:
                if self._hook_count[i] == 1:
                    self._arrival.append(i)
                return  # first step of a static graph: everything is reduced at the end
            if self._hook_count[i] < self._expected_count[i]:
                return
        if self._ready(i) and self.steps == 0 and not self._static:
            self._arrival.append(i)

    def _on_context_grad(self, i: int, grad_inputs: object, grad_outputs: object) -> None:
        # The AccumulateGrad node's post hook (Note [distributed autograd] in dist_autograd.py).
        if self.state is not StepState.ARMED or self._locally_used[i] or self._context_id is None:
            return  # no synchronised backward, or a local one: _on_grad took the gradient
        if self._context_grads is None:
            # The engine's thread does not expose the backward's context to Python
            # (torch's reducer reads a C++ thread-local): the forward's context it is.
            self._context_grads = ContextGrads(self._context_id, self.params, self.names, self.comm.rank)
        self._context_grads.bind(i)
        self._on_grad(i)
