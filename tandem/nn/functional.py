"""Batch normalisation over the global batch of a process group, as an autograd
function with one all-reduce in forward and one in backward.

# Note [sums, not means]
Ranks may hold different numbers of samples, zero included, so what crosses
the wire are per-channel sums and a count, which add up across ranks whatever
the split: forward all-reduces [sum(x), sum(x*x), n] and backward all-reduces
[sum(dy), sum(dy*xhat)]. A rank with no samples contributes zeros and still
joins both collectives, so its peers do not wait for it. Every rank then holds
the same global count N and can make the same decisions from it (N < 2 raises
on every rank, rather than hanging one).

sum(x*x) is not computed as such: in float32, E[x^2] - E[x]^2 loses every digit
when the mean is large next to the spread. Each rank computes its mean m and
variance v about the true mean (torch.var_mean, which is accurate), and the
residual r = sum(x - m), which says how far the rounded m is from the true mean.
From these, in float64, sum(x) = n*m + r and sum(x*x) = n*v + r*r/n + n*m*m + 2*m*r
are exact up to float32 rounding of small quantities, and the one cancellation
left, E[x^2] - E[x]^2 over the global batch, happens with 16 digits to spare.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from tandem.comm.group import GroupComm

__all__ = ["sync_batch_norm"]


def sync_batch_norm(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    running_mean: torch.Tensor | None, running_var: torch.Tensor | None, *,
                    momentum: float, eps: float, comm: GroupComm) -> torch.Tensor:
    """Training-mode batch norm whose statistics cover every rank of ``comm``.

    Input is ``(N, C, *)``; statistics are per channel over all other dimensions
    and all ranks. ``running_mean``/``running_var`` (both or neither) are updated
    in place with factor ``momentum``, using the unbiased global variance, as
    :func:`torch.nn.functional.batch_norm` does. Every rank of ``comm`` must call
    this together. The weight and bias gradients are this rank's share (summed
    over ranks, as DDP does, they are the global gradients), as with torch.

    Raises:
        ValueError: the ranks hold fewer than 2 values per channel in total
            (raised on every rank).
    """
    return _SyncBatchNorm.apply(input, weight, bias, running_mean, running_var, momentum, eps, comm)


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """View a (C,) vector so that it broadcasts over x's channel dimension."""
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # Half-precision inputs are normalised in float32, as torch's kernels do.
    return torch.promote_types(x.dtype, torch.float32)


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, momentum: float, eps: float,
                comm: GroupComm) -> torch.Tensor:
        channels = x.shape[1]
        xc = x.to(_compute_dtype(x))
        # See Note [sums, not means].
        stats = torch.zeros(2 * channels + 1, dtype=torch.float64, device=x.device)
        n_local = x.numel() // channels
        if n_local > 0:
            dims = _reduce_dims(x)
            var, mean = torch.var_mean(xc, dim=dims, correction=0)
            r = (xc - _per_channel(mean, x)).sum(dims).double()
            m, v = mean.double(), var.double()
            stats[:channels] = n_local * m + r
            stats[channels: 2 * channels] = n_local * v + r * r / n_local + n_local * m * m + 2 * m * r
            stats[-1] = n_local
        comm.all_reduce(stats, tag="sync_batchnorm forward")
        n = int(stats[-1].item())
        if n < 2:
            raise ValueError(
                f"rank {comm.rank}: SyncBatchNorm expected more than 1 value per channel when "
                f"training, got {n} over all {comm.size} ranks of its process group (this rank: "
                f"{n_local}); use a larger batch, or eval mode")
        mean64 = stats[:channels] / n
        var64 = (stats[channels: 2 * channels] / n - mean64 * mean64).clamp_(min=0)
        if running_mean is not None and running_var is not None:
            running_mean.mul_(1 - momentum).add_(mean64.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_((var64 * (n / (n - 1))).to(running_var.dtype),
                                                alpha=momentum)
        mean = mean64.to(xc.dtype)
        invstd = torch.rsqrt(var64 + eps).to(xc.dtype)
        y = (xc - _per_channel(mean, x)) * _per_channel(invstd, x)
        if weight is not None:
            y = y * _per_channel(weight.to(xc.dtype), x)
        if bias is not None:
            y = y + _per_channel(bias.to(xc.dtype), x)
        # save_for_backward takes None (documented); torch's stub says Tensor only.
        ctx.save_for_backward(x, weight, mean, invstd)  # type: ignore[arg-type]
        ctx.count = n  # type: ignore[attr-defined]
        ctx.comm = comm  # type: ignore[attr-defined]
        ctx.bias_dtype = None if bias is None else bias.dtype  # type: ignore[attr-defined]
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        dims = _reduce_dims(x)
        dyc = dy.to(mean.dtype)
        xhat = (x.to(mean.dtype) - _per_channel(mean, x)) * _per_channel(invstd, x)
        # Local sums; a rank with no samples gets zeros, and still joins the all-reduce.
        sum_dy = dyc.sum(dims)
        sum_dy_xhat = (dyc * xhat).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            channels = x.shape[1]
            global_sums = torch.cat([sum_dy, sum_dy_xhat])
            ctx.comm.all_reduce(global_sums, tag="sync_batchnorm backward")
            mean_dy = _per_channel(global_sums[:channels] / ctx.count, x)
            mean_dy_xhat = _per_channel(global_sums[channels:] / ctx.count, x)
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            grad_input = ((dyc - mean_dy - xhat * mean_dy_xhat) * _per_channel(scale, x)).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None
