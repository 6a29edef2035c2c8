"""PowerSGD: low-rank gradient compression with error feedback (Vogels et al.,
2019, https://arxiv.org/abs/1905.13727), with the knobs of torch's
``powerSGD_hook``.

Per bucket and step, after ``start_iter`` plain steps (Note [low-rank layout]
in low_rank.py for what is compressed)::

    M  = grad + error                     error feedback: what was lost last step
    P  = M @ orth(Q)                      Q: last step's (warm start) or random
    all-reduce [uncompressed / world | P]     collective 1
    P^ = orth(P)
    Q  = M.T @ P^
    all-reduce Q, Q /= world                  collective 2
    grad  = P^ @ Q.T                      the same on every rank
    error = M - grad                      this rank's loss, added back next step

# Note [powersgd order]
torch's powerSGD_hook issues its second and third collectives from future
callbacks, on the backend's thread; with several buckets in flight their order
differs across ranks and gloo aborts. This hook issues both collectives from the
calling thread, waits for each, and returns a completed future: every rank
issues the same collectives in the same order whatever the timing, on tandem's
DDP and on torch's alike. Computing Q needs the reduced P anyway, so only the
overlap of the last all-reduce with the rest of backward is given up.

# Note [powersgd random Q]
An initial Q is drawn from a generator seeded by (seed, m, r) alone, and without
warm start also by the step: the same on every rank, whatever the order in which
buckets present the parameters (torch's DDP orders a bucket's parameters
differently from tandem's before its rebuild), so tandem's DDP and torch's train
to the same parameters with this hook. Gradients of equal shape start from the
same Q, which the power iteration does not mind: each matrix is approximated on
its own.

# Note [powersgd memory]
Error and warm-start Q are kept per parameter (keyed by the parameter object,
held weakly), not per bucket index as in torch, so they survive DDP rebuilding its
buckets after the first step: compression may start at any step (torch requires
``start_powerSGD_iter >= 2``). A copy of the state (``copy.deepcopy`` or
``torch.save`` of the DDP model that holds it, Note [copying a DDP model] in
tandem/ddp/module.py) carries the memory as (parameter, tensor) pairs, so that
the keys become the copied model's parameters and the copy compresses on as the
original does.

# Note [powersgd in a new world]
Under ``--elastic`` a state over the default group follows the DDP model into
each new world (``follows_world``; ``DistributedDataParallel.reset_process_group``
keeps the hook and calls :meth:`PowerSGDState.regroup`). Its ranks must then
agree on what decides their collectives and their result: whether the step is
compressed (``iter``: a replacement starts from 0, and would all-reduce the whole
bucket while the members all-reduce [uncompressed | P], a collective of another
size), and each parameter's warm-start Q (the same on every member, since Q is
all-reduced; a replacement has none, and P = sum of M @ Q over ranks with
different Qs spans another space). So every rank takes rank 0's ``iter`` and Qs.
The error memory is cleared on every rank: it holds each rank's residual, and
the residuals sum to what compression lost last step over the old world; the
lost rank's is gone, so the survivors' alone would be a sum of another meaning.
A world change thus costs the last step's residual, as a restart of error
feedback does; with a compression that loses nothing (rank as large as the
gradient), training across a world change equals DDP's.
"""

# Annotations stay evaluated (no ``from __future__ import annotations``): torch's
# DDP compares a hook's ``bucket`` and return annotations with dist.GradBucket and
# Future[Tensor] by value, so that these hooks also work on torch's DDP.
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from tandem._compat import foreach_copy_
from tandem.comm.group import GroupComm
from tandem.comm_hooks._comm import hook_comm, is_default_group
from tandem.comm_hooks.allreduce import allreduce_hook
from tandem.comm_hooks.low_rank import LowRankPlan, orthogonalize_, plan_low_rank

__all__ = ["PowerSGDConfig", "PowerSGDState", "powersgd_hook"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PowerSGDConfig:
    """PowerSGD's hyperparameters (torch's names in brackets)."""

    matrix_rank: int = 1
    """Rank r of each approximation P @ Q.T [matrix_approximation_rank]: bytes on the
    wire and accuracy both grow with it; start at 1 and double until accuracy holds."""
    start_iter: int = 1000
    """Synchronised steps reduced uncompressed before compression starts
    [start_powerSGD_iter]: early training is the most sensitive to gradient error."""
    min_compression_rate: float = 2.0
    """Compress an n x m gradient only if n*m > (n+m)*r*rate; the others travel
    uncompressed, all of a bucket's in one tensor [min_compression_rate]."""
    error_feedback: bool = True
    """Add what compression lost on this rank last step to this step's gradient
    [use_error_feedback]; without it PowerSGD rarely matches uncompressed accuracy."""
    warm_start: bool = True
    """Start each step's power iteration from last step's Q rather than a random
    matrix: a better approximation for no extra communication [warm_start]."""
    orthogonalization_epsilon: float = 0.0
    """Added to column norms when orthogonalising; zero columns are safe without it."""
    seed: int = 0
    """Seed of the random initial Qs; ranks must agree on it [random_seed]."""

    def __post_init__(self) -> None:
        if not isinstance(self.matrix_rank, int) or self.matrix_rank < 1:
            raise ValueError(f"PowerSGDConfig.matrix_rank must be an int >= 1, got {self.matrix_rank!r}")
        if not isinstance(self.start_iter, int) or self.start_iter < 0:
            raise ValueError(f"PowerSGDConfig.start_iter must be an int >= 0, got {self.start_iter!r}")
        if not self.min_compression_rate > 0:
            raise ValueError("PowerSGDConfig.min_compression_rate must be > 0, got "
                             f"{self.min_compression_rate!r}")
        if not self.orthogonalization_epsilon >= 0:
            raise ValueError("PowerSGDConfig.orthogonalization_epsilon must be >= 0, got "
                             f"{self.orthogonalization_epsilon!r}")


class PowerSGDState:
    """What :func:`powersgd_hook` keeps between steps: the step count, and each
    compressed parameter's error and Q. They are kept per parameter, so they
    survive DDP rebuilding its buckets and compression may start at any step;
    a copy of the DDP model (``copy.deepcopy``, ``torch.save``) carries them.

    Args:
        config: the hyperparameters (default ``PowerSGDConfig()``).
        process_group: ``None`` (the DDP's group), a ``ProcessGroup`` or a
            ``GroupComm``.

    Use one state per DDP model; it holds per-parameter memory of the size of the
    compressed gradients (with error feedback).
    """

    def __init__(self, config: PowerSGDConfig | None = None, process_group: Any = None) -> None:
        self.config = config if config is not None else PowerSGDConfig()
        if not isinstance(self.config, PowerSGDConfig):
            raise TypeError(f"config must be a PowerSGDConfig, got {type(config).__name__}")
        self.process_group = process_group
        self.iter = 0
        """Synchronised backwards seen (advanced at each backward's last bucket)."""
        # Per parameter (Note [powersgd memory]).
        self._residual: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._q: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._plans: dict[tuple[tuple[int, ...], ...], LowRankPlan] = {}

    def __getstate__(self) -> dict[str, Any]:
        if not is_default_group(self.process_group):
            # torch's PowerSGDState drops its group and takes the default one at load.
            raise TypeError(
                "a PowerSGDState over a process group other than the default one cannot be deep-copied "
                "or pickled; build a new PowerSGDState for the copy, over the group it reduces over")
        state = dict(self.__dict__)
        state["process_group"] = None
        state["_residual"] = list(self._residual.items())
        state["_q"] = list(self._q.items())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        residual = state.pop("_residual", None) or state.pop("_error", [])  # "_error": as tandem pickled it before
        self.__dict__.update(state)
        self._residual = WeakIdKeyDictionary(dict(residual))
        self._q = WeakIdKeyDictionary(dict(state["_q"]))

    @property
    def follows_world(self) -> bool:
        """Whether the hook goes on with the DDP model in a new world (its group is
        the default one): Note [powersgd in a new world]."""
        return is_default_group(self.process_group)

    def regroup(self, comm: GroupComm, parameters: list[torch.Tensor]) -> None:
        """A new world (Note [powersgd in a new world]): rank 0's step count and
        warm-start Qs on every rank, the error memory cleared. A collective of
        ``comm`` (the model's group); ``parameters`` are the model's, in the same
        order on every rank."""
        index = {id(p): i for i, p in enumerate(parameters)}
        mine = None
        if comm.rank == 0:
            mine = {"iter": self.iter, "q": {index[id(p)]: q for p, q in self._q.items() if id(p) in index}}
        sent = comm.all_gather_object(mine, tag="powersgd state for a new world")[0]
        self.iter = int(sent["iter"])
        self._q = WeakIdKeyDictionary({parameters[int(i)]: q.clone() for i, q in sent["q"].items()})
        self._residual = WeakIdKeyDictionary()

    @property
    def compressing(self) -> bool:
        """Whether the next backward is compressed (``iter >= start_iter``)."""
        return self.iter >= self.config.start_iter

    def plan(self, shapes: tuple[tuple[int, ...], ...]) -> LowRankPlan:
        """The bucket layout for gradients of ``shapes`` (cached)."""
        plan = self._plans.get(shapes)
        if plan is None:
            plan = plan_low_rank(shapes, self.config.matrix_rank, self.config.min_compression_rate)
            self._plans[shapes] = plan
            logger.info("PowerSGD: a bucket of %d tensors sends %d of %d elements "
                        "(%d matrices compressed at rank %d)", len(shapes), plan.numel_on_wire,
                        plan.total_numel, len(plan.compressed), self.config.matrix_rank)
        return plan

    def _add_residual(self, key: torch.Tensor, m: torch.Tensor) -> None:
        """Error feedback in: ``m += `` last step's error of parameter ``key``; the
        error memory then holds this compensated local gradient."""
        if not self.config.error_feedback:
            return
        error = self._residual.get(key)
        if error is None:
            self._residual[key] = m.clone()
        else:
            m.add_(error)
            error.copy_(m)

    def _keep_for_next_step(self, key: torch.Tensor, decompressed: torch.Tensor, q: torch.Tensor) -> None:
        """Error feedback out (error = compensated local gradient - ``decompressed``),
        and ``q`` kept for the next step's warm start."""
        if self.config.error_feedback:
            self._residual[key].sub_(decompressed)
        if self.config.warm_start:
            self._q[key] = q

    def _initial_q(self, key: torch.Tensor, q: torch.Tensor) -> None:
        """Fill ``q`` with last step's Q for parameter ``key``, or random numbers
        (Note [powersgd random Q])."""
        previous = self._q.get(key) if self.config.warm_start else None
        if previous is not None:
            q.copy_(previous)
            return
        draw = self.iter if not self.config.warm_start else 0
        seed = _mix(self.config.seed, *q.shape, draw)
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(seed),
                            dtype=torch.float32))


def _mix(*values: int) -> int:
    """A 63-bit seed from small integers, the same in every process (unlike hash()
    of strings)."""
    seed = 0
    for v in values:
        seed = (seed * 0x100000001B3 + v + 0x9E3779B97F4A7C15) % (1 << 63)
    return seed


def powersgd_hook(state: PowerSGDState,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce a bucket with PowerSGD low-rank compression.

    For the first ``state.config.start_iter`` synchronised steps the bucket is
    averaged uncompressed (as :func:`~tandem.comm_hooks.allreduce_hook`, so those
    steps equal training without a hook exactly). Afterwards each gradient
    worth compressing is replaced by a rank-r approximation of the average
    gradient, and the others are averaged exactly; two all-reduces per bucket,
    both issued from the calling thread in a fixed order, so that every rank
    issues the same collectives in the same order (on gloo too). The returned
    future is already complete.

    Args:
        state: a :class:`PowerSGDState`, one per model.
        bucket: the ``GradBucket`` (tandem's or torch's).

    Returns:
        A future holding the bucket's reduced gradients (its own buffer).
    """
    # Both collectives from this thread, waited for: Note [powersgd order].
    comm = hook_comm(state.process_group, bucket)
    last = bucket.is_last()
    if not state.compressing:
        if last:
            state.iter += 1
            if state.compressing:
                logger.info("PowerSGD: compression starts after %d uncompressed steps", state.iter)
        return allreduce_hook(comm, bucket)
    _reduce_low_rank(state, comm, bucket)
    if last:
        state.iter += 1
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def _reduce_low_rank(state: PowerSGDState, comm: GroupComm, bucket: Any) -> None:
    """The compressed step of the module docstring, for one bucket, in place."""
    grads = bucket.gradients()
    plan = state.plan(tuple(tuple(g.shape) for g in grads))
    buffer = bucket.buffer()
    # Collective 1 carries [uncompressed / world | P] (Note [low-rank layout]).
    first = buffer.new_empty(plan.uncompressed_numel + plan.p_numel)
    flat_unc = first.narrow(0, 0, plan.uncompressed_numel)
    flat_q = buffer.new_empty(plan.q_numel)
    unc_grads = [grads[i] for i in plan.uncompressed]
    if unc_grads:
        torch.cat([g.reshape(-1) for g in unc_grads], out=flat_unc)
        flat_unc.mul_(1.0 / comm.size)  # averaged as without a hook
    factors = _factor_views(plan, grads, bucket.parameters(),
                            first.narrow(0, plan.uncompressed_numel, plan.p_numel), flat_q)
    for key, m, p, q in factors:
        state._add_residual(key, m)
        state._initial_q(key, q)
        orthogonalize_(q, state.config.orthogonalization_epsilon)
        torch.mm(m, q, out=p)

    comm.all_reduce(first, tag=f"hook powersgd uncompressed+P bucket {bucket.index()}")
    if unc_grads:
        foreach_copy_(unc_grads, _split_like(flat_unc, unc_grads))
    if not factors:
        return  # nothing compressed in this bucket (the same on every rank: shapes decide)
    for _, m, p, q in factors:
        orthogonalize_(p, state.config.orthogonalization_epsilon)
        torch.mm(m.T, p, out=q)

    comm.all_reduce(flat_q, tag=f"hook powersgd Q bucket {bucket.index()}")
    flat_q.mul_(1.0 / comm.size)
    for key, m, p, q in factors:
        torch.mm(p, q.T, out=m)
        state._keep_for_next_step(key, m, q)


def _factor_views(plan: LowRankPlan, grads: list[torch.Tensor], params: list[torch.Tensor],
                  flat_p: torch.Tensor, flat_q: torch.Tensor,
                  ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(parameter, M, P, Q) per compressed gradient: M a view of the bucket, P
    and Q views of the collectives' flat tensors."""
    out = []
    for s in plan.compressed:
        m = grads[s.index].view(s.rows, s.cols)
        p = flat_p.narrow(0, s.p_offset, s.rows * s.rank).view(s.rows, s.rank)
        q = flat_q.narrow(0, s.q_offset, s.cols * s.rank).view(s.cols, s.rank)
        out.append((params[s.index], m, p, q))
    return out


def _split_like(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive views of ``flat`` shaped like each tensor of ``like``."""
    views, offset = [], 0
    for t in like:
        views.append(flat.narrow(0, offset, t.numel()).view_as(t))
        offset += t.numel()
    return views
