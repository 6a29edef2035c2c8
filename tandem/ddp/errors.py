"""The reducer's error messages: each names the value, the rank and the fix."""

from __future__ import annotations

__all__ = ["gradient_twice", "missing_gradients", "unfinished_backward"]


def missing_gradients(rank: int, per_rank: list[list[str]] | None, mine: list[str] | None = None,
                      late: bool = False) -> str:
    """Parameters that received no gradient, per rank (Note [missing-gradient flag] in reducer.py);
    ``per_rank`` None: only this rank's (``mine``) are known (inside tandem.join); ``late``: found
    at the end of the next backward (on CUDA, Note [late flag] in late_flag.py)."""
    if per_rank is None:
        lines = [f"  rank {rank}: {', '.join(repr(n) for n in mine)}" if mine else
                 f"  rank {rank}: none; another rank still training is missing some"]
        lines.append("  (inside tandem.join the other ranks are not asked which)")
    else:
        lines = [f"  rank {r}: {', '.join(repr(n) for n in names)}" for r, names in enumerate(per_rank) if names]
    return (f"rank {rank}: DistributedDataParallel: these parameters received no "
            + ("gradient in the previous backward (on CUDA this check is read one backward later, "
               "so that backward never waits for the GPU; their gradients in that step were zeros):\n"
               if late else "gradient in this backward:\n") + "\n".join(lines) + "\n"
            "Either they were not used in forward, or the outputs that use them did not reach "
            "the loss. If some parameters are legitimately unused, pass "
            "find_unused_parameters=True (or set requires_grad=False on parameters that never "
            "train). With static_graph=True, the used parameters must be the same every step.")


def unfinished_backward(rank: int, waiting: list[str]) -> str:
    return (f"rank {rank}: DistributedDataParallel: a new forward started before the "
            "previous backward finished reducing gradients; still waiting for "
            f"{', '.join(repr(n) for n in waiting[:10])}"
            f"{' ...' if len(waiting) > 10 else ''}. Make sure every forward's output "
            "reaches loss.backward(), or run forwards that are not trained under torch.no_grad()")


def gradient_twice(rank: int, name: str, bucket: int) -> str:
    return (f"rank {rank}: parameter '{name}' received its gradient "
            f"twice in one backward, after bucket {bucket} had taken it (it was used "
            "again, e.g. by a module called twice under reentrant activation checkpointing); "
            "pass static_graph=True if the graph is the same every step, or use "
            "torch.utils.checkpoint(..., use_reentrant=False)")
