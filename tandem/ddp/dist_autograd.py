"""DDP under ``torch.distributed.autograd``: the gradients live in the autograd context.

# Note [distributed autograd]
``dist_autograd.backward(context_id, [loss])`` (RPC training, e.g. a dense part
under DDP next to an embedding table on a parameter server) runs this rank's part
of the graph on the ordinary autograd engine, with one difference that matters to
DDP: a parameter's AccumulateGrad node is not executed. The engine captures the
gradient and adds it into the context instead (``dist_autograd.get_gradients``),
where ``DistributedOptimizer`` reads it. ``param.grad`` stays as it was, and hooks
registered with ``register_post_accumulate_grad_hook`` (the reducer's readiness
hook) do not fire. What does run: tensor hooks on the outputs, the AccumulateGrad
node's own post hooks (torch's ``DistAccumulateGradCaptureHook`` calls them after
adding the gradient into the context), and callbacks queued on the graph task, all
on the distributed engine's own CPU thread, where Python cannot see the context
(``dist_autograd._current_context()`` raises there). Without handling this, DDP
reduces nothing and no error is raised: the replicas drift apart.

torch's reducer hooks the AccumulateGrad node and, under a context, reads and
writes each gradient through the context (``Reducer::runGradCallbackForVariable``
in reducer.cpp). tandem does the same in Python:

* When a synchronised forward runs inside a context, the reducer notes the
  context's id and adds a post hook to each parameter's AccumulateGrad node
  (once). The hook does nothing where the post-accumulate-grad hook already took
  the gradient (a local ``backward()``); otherwise the gradient is in the
  forward's context: :meth:`ContextGrads.bind` makes the context's gradient
  tensor ``param.grad`` and the reducer proceeds as usual, so every path
  (buckets, in-place reduction, communication hooks) reads and writes it.
* At the end of backward, :meth:`ContextGrads.deliver` leaves the averaged
  gradients in the context's tensors (most paths wrote them in place already;
  a bucket view is copied in) and ``param.grad`` gets back its value from before,
  as in torch, where distributed autograd never touches ``param.grad``.

Limits: Python offers no way to add a gradient to a context, so a parameter
that gets no gradient on this rank cannot receive the average of the others
(``find_unused_parameters`` with a parameter used on some ranks only): every rank
raises, naming it (torch fails an internal assert there). ZeRO and
``fuse_optimizer`` step from tandem's own buffers and are refused under a context.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ContextGrads", "unsupported_under_context"]


class ContextGrads:
    """The gradients of one backward in distributed autograd context ``context_id``,
    bound to ``param.grad`` while the reducer works on them."""

    def __init__(self, context_id: int, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 rank: int) -> None:
        self.context_id = context_id
        self._params = params
        self._names = names
        self._rank = rank
        self._saved = [p.grad for p in params]      # given back by restore()
        self._bound: dict[int, torch.Tensor] = {}   # param index -> the context's tensor
        self._seen: dict[torch.Tensor, torch.Tensor] = {}  # the context's gradients, last read
        for p in params:
            # A parameter without a gradient in this backward contributes zeros,
            # not whatever .grad a local step left behind.
            p.grad = None

    def bind(self, i: int) -> None:
        """Parameter ``i``'s gradient has been added into the context: make the
        context's tensor its ``.grad``, so that the reducer reads and writes it."""
        param = self._params[i]
        grad = self._seen.get(param)
        if grad is None:  # arrived since the context was last read: read it again (once per arrival batch)
            import torch.distributed.autograd as dist_autograd
            self._seen = dist_autograd.get_gradients(self.context_id)
            grad = self._seen.get(param)
        if grad is None:  # the capture hook adds the gradient before the node's post hooks
            raise RuntimeError(
                f"rank {self._rank}: parameter '{self._names[i]}' got a gradient in a distributed "
                f"backward, but not in autograd context {self.context_id}, the one its forward ran "
                "in: run the forward and dist_autograd.backward(context_id, ...) in the same context")
        self._bound[i] = grad
        param.grad = grad

    def deliver(self, used_counts: Sequence[int] | None, world_size: int) -> None:
        """After the reduction: the averaged gradients into the context's tensors.

        ``used_counts``: per parameter, on how many ranks it got a gradient (None:
        on every rank, or the missing-gradient check has raised already)."""
        with torch.no_grad():
            for i, ctx_grad in self._bound.items():
                grad = self._params[i].grad
                if grad is None:  # check_finite='skip' dropped the step
                    ctx_grad.zero_()
                elif grad is not ctx_grad:  # a bucket view (gradient_as_bucket_view)
                    ctx_grad.copy_(grad)
        if used_counts is not None:
            partial = [self._names[i] for i, n in enumerate(used_counts) if 0 < n < world_size]
            if partial:
                raise RuntimeError(partly_used(self._rank, partial))

    def restore(self) -> None:
        """Give every ``param.grad`` back its value from before this backward."""
        for p, saved in zip(self._params, self._saved):
            p.grad = saved


def partly_used(rank: int, names: Sequence[str]) -> str:
    return (
        f"rank {rank}: under distributed autograd, parameters {list(names)} got a gradient on "
        "some ranks but not on others in this backward. DDP cannot put their averaged gradient "
        "into the autograd context of a rank that computed none (torch.distributed.autograd has "
        "no way to add one), so those ranks' DistributedOptimizer would skip them and the "
        "replicas would drift apart; every rank raises this error instead. Make every rank use "
        "these parameters in every step (e.g. add 0 * their output to the loss)")


def unsupported_under_context(rank: int, what: str) -> str:
    return (
        f"rank {rank}: DistributedDataParallel with {what} does not work under distributed "
        "autograd (this forward runs inside torch.distributed.autograd.context()): the optimizer "
        "steps from tandem's own gradient buffers, while DistributedOptimizer reads the context's "
        "gradients. Use the plain DDP (no ZeRO, no fuse_optimizer) with DistributedOptimizer")
