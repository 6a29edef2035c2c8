"""Hooks that skip communication: ``noop_hook`` always, ``noop_when`` when asked.

# Note [no-op hooks and no_sync]
tandem's DDP never calls a hook under ``no_sync()`` (or with
``require_backward_grad_sync = False``): no reduction happens there at all, so
no hook needs a wrapper to be a no-op under ``no_sync``. What ``noop_when`` adds
is deciding at backward time instead of at forward time. A no-op hook returns
the bucket as it is, and the bucket holds this rank's accumulated gradients, so
each ``param.grad`` keeps its local value: the same gradients as a backward under
``no_sync``, and the next synchronised backward reduces the accumulated sum.
Unlike ``no_sync``, the DDP's bookkeeping still runs (the missing-gradient check,
the used-parameter map of ``find_unused_parameters``), so every rank must still
run the backward, and every rank must make the same decision.
"""

# Annotations stay evaluated (no ``from __future__ import annotations``): torch's
# DDP compares a hook's ``bucket`` and return annotations with dist.GradBucket and
# Future[Tensor] by value, so that these hooks also work on torch's DDP.
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["NoopWhen", "noop_hook", "noop_when"]


def noop_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Leave the bucket as it is: no communication, each rank keeps its local gradients.

    For headroom analysis, as torch's ``noop_hook``: if training is barely faster
    with it, communication is not the bottleneck. Ranks drift apart; do not train
    with it.

    Args:
        state: ignored.
        bucket: the ``GradBucket``.

    Returns:
        A completed future holding the bucket's buffer, unchanged.
    """
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


class NoopWhen:
    """``hook``, except in backwards where ``skip()`` returned True: there no
    bucket is communicated, and each rank keeps its local gradients, as under
    ``no_sync()``; the next synchronised backward reduces their sum.

    ``skip()`` is called once per backward, at its first bucket (bucket 0 is
    always reduced first), and the answer holds for every bucket of that
    backward. It must return the same on every rank, and every rank must still
    run the backward.

    Args:
        hook: the hook to run when not skipping; it receives the registered state.
        skip: a callable with no arguments.
    """

    def __init__(self, hook: Callable[[Any, Any], torch.futures.Future[torch.Tensor]],
                 skip: Callable[[], bool]) -> None:
        if not callable(hook) or not callable(skip):
            raise TypeError(f"noop_when(hook, skip) needs two callables, got {hook!r} and {skip!r}")
        self.hook = hook
        self.skip = skip
        self.skipping = False
        """Whether the current (or last) backward skips communication."""
        self.__qualname__ = self.__name__ = f"noop_when({getattr(hook, '__name__', repr(hook))})"
        # Skipping issues no collective, which is as safe for buckets in flight
        # together as one (Note [hook order] in tandem/ddp/grad_bucket.py).
        self.tandem_single_collective = getattr(hook, "tandem_single_collective", False)

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # Note [no-op hooks and no_sync]: what a skipped backward keeps and still runs.
        if bucket.index() == 0:
            self.skipping = bool(self.skip())
        if self.skipping:
            return noop_hook(state, bucket)
        return self.hook(state, bucket)


def noop_when(hook: Callable[[Any, Any], torch.futures.Future[torch.Tensor]],
              skip: Callable[[], bool]) -> NoopWhen:
    """Wrap ``hook`` so that backwards for which ``skip()`` is True communicate
    nothing and keep local gradients, as under ``no_sync()``.

    Use it to decide whether to synchronise after the forward has run, e.g. for
    gradient accumulation whose boundary is known only at backward time::

        hook = comm_hooks.noop_when(comm_hooks.fp16_compress_hook,
                                    lambda: micro_step % accumulate != accumulate - 1)
        ddp.register_comm_hook(None, hook)

    Warning:
        ``skip()`` must give the same answer on every rank, or ranks
        issue different collectives and hang. With a stateful hook (PowerSGD),
        skipped backwards do not advance its step count.

    Args:
        hook: any communication hook (tandem's, torch's or your own).
        skip: called once per backward, at bucket 0.

    Returns:
        The wrapped hook (a :class:`NoopWhen`).
    """
    return NoopWhen(hook, skip)
