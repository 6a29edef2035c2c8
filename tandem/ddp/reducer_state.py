"""The reducer's state (:class:`ReducerState`, the first layer of
:class:`tandem.ddp.reducer.GradReducer`): its options, the step it is in, the
buckets and their flat buffer (planned at construction, re-planned in arrival
order, moved to new memory when a kept gradient holds the old), and the
questions every later stage asks of that state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto

import torch

from tandem._compat import storage_use_count
from tandem.comm.group import CollectiveEvent, GroupComm
from tandem.ddp.bucket import Bucket, BucketState, GradBuffer
from tandem.ddp.checks import NonFinite
from tandem.ddp.comm_stats import CommStats, gradient_bytes
from tandem.ddp.dist_autograd import ContextGrads
from tandem.ddp.errors import missing_gradients, unfinished_backward
from tandem.ddp.finite import FiniteCheck
from tandem.ddp.fused import BucketStepper
from tandem.ddp.grad_bucket import CommHook
from tandem.ddp.late_flag import LateFlag
from tandem.ddp.plan import BucketPlan, ParamInfo, plan_ddp_buckets
from tandem.ddp.write_back import foreign_grads
from tandem.dtensor import local_grad, local_tensor, set_local_grad

__all__ = ["ReducerOptions", "ReducerState", "StepState"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ReducerOptions:
    caps: tuple[int, ...]
    """Byte cap per bucket index (the last one repeats)."""
    find_unused_parameters: bool = False
    """Walk the graph after forward; unreached parameters do not hold up their buckets."""
    static_graph: bool = False
    """The graph is the same every step: learn hook counts and unused params in step one."""
    gradient_as_bucket_view: bool = False
    """param.grad is a view into the flat bucket buffer: no copies, less memory."""
    rebuild_buckets: bool = True
    """After the first step, re-plan buckets in the order gradients actually arrived."""
    zero_stage: int = 0
    """0: all-reduce each bucket; 1, 2: reduce-scatter it (Note [zero reduction] in launch.py)."""
    overlap: bool = True
    """Launch each bucket's reduction during backward once it is complete (False:
    launch them all at the end of backward)."""
    check_finite: NonFinite | None = None
    """Agree across ranks whether a step's gradients are finite, and raise or drop
    the step when they are not (Note [check_finite] in finite.py); None: no check, no cost."""


class StepState(Enum):
    IDLE = auto()        # no synchronised backward expected (no_sync, eval, or done)
    ARMED = auto()       # forward armed the reducer; gradients may arrive
    FINISHING = auto()   # end of backward: launching the rest, waiting, writing back


class ReducerState:
    """The state every stage of the reducer reads and writes, and the buckets."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], comm: GroupComm,
                 options: ReducerOptions) -> None:
        self.comm = comm
        self.options = options
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        # Note [tensor-parallel parameters] in tandem/dtensor.py: buckets hold local shards.
        self._infos = [ParamInfo(n, local_tensor(p).numel(), p.dtype, p.device) for n, p in named_params]
        self._div = 1.0 / comm.size
        self._static = options.static_graph
        self._as_view = options.gradient_as_bucket_view
        self._zero = options.zero_stage > 0
        if self._zero and options.rebuild_buckets:
            raise ValueError("ZeRO needs a fixed bucket plan: pass rebuild_buckets=False")
        self.grad_shards: list[torch.Tensor] = []  # Note [zero reduction] in launch.py
        self.state = StepState.IDLE
        self.steps = 0                      # synchronised backwards whose gradients were delivered
        # Note [check_finite] in finite.py
        self._check = None if options.check_finite is None else FiniteCheck(options.check_finite, self)
        # Note [gradients born in their bucket] in write_back.py: where param.grad may be left as its
        # bucket's view after a step (decided per step in arm: _rebind).
        self._born = not (self._zero or self._as_view or self._check is not None) \
            and storage_use_count(torch.zeros(1)) is not None
        self._rebind = False
        self._retired: list[torch.Tensor] = []  # backward's fresh gradients, until the next forward
        self._fast = False  # Note [hook fast path] in autograd_hooks.py, decided in arm
        self._foreign: set[int] = set()  # params whose .grad is the user's tensor: copied into

        self.plan: BucketPlan
        self.buckets: list[Bucket] = []
        self._where: list[tuple[int, int]] = []
        self._build(list(reversed(range(len(self.params)))))

        # per-step bookkeeping
        self._next_launch = 0
        self._callback_queued = False
        self._output_nodes: list[object] = []  # Note [end of backward] in autograd_hooks.py
        self._locally_used = [False] * len(self.params)
        self._arrival: list[int] = []       # param indices in order of first readiness
        self._pending_unused: list[int] = []  # marked ready when backward starts
        self._missing_flag = 0.0            # Note [missing-gradient flag] in finish.py
        self._late_flag = LateFlag()        # the flag on its way to the host (CUDA: Note [late flag])
        self._name_ranks = True             # every rank takes part in error paths (not inside join)
        self._in_place = False              # Note [in-place reduction] in launch.py, decided in arm
        self._rebuild_pending = False
        # static graph: learned in the first synchronised step
        self._hook_count = [0] * len(self.params)
        self._expected_count: list[int] | None = None
        self._static_used: list[int] | None = None  # per param: used on some rank in step one

        # communication hook (Note [hook order] in grad_bucket.py)
        self._comm_hook: CommHook | None = None
        self._comm_hook_state: object = None
        self._serialize_hooks = False
        self.last_stats: CommStats | None = None
        self._stepper: BucketStepper | None = None  # Note [fused step] in fused.py
        self._bytes = 0
        comm.observers.append(self._count_bytes)
        # Note [recovered reduction failures] in finish.py: set by the DDP wrapper.
        self.failure_handler: Callable[[BaseException], bool] | None = None

        # Note [distributed autograd] in dist_autograd.py: hooks on the AccumulateGrad
        # nodes, added by the first forward that runs inside a context.
        self._context_hooks: list[object] = []
        self._context_id: int | None = None        # the context the armed forward ran in
        self._context_grads: ContextGrads | None = None
        self._used_counts: list[int] | None = None

    # ------------------------------------------------------------------ planning
    def _build(self, order: list[int]) -> None:
        plan = plan_ddp_buckets(self._infos, order, self.options.caps, self.comm.size, zero=self._zero,
                                gradient_as_bucket_view=self._as_view, check_finite=self._check is not None)
        buffer = GradBuffer(plan.buffer_numel, solo=tuple(s for s in plan.buckets if s.solo))
        self.buckets = [Bucket(spec, [self.params[i] for i in spec.params],
                               [self.names[i] for i in spec.params], buffer.slice(spec))
                        for spec in plan.buckets]
        buffer.release_solo()  # the views exist: Note [solo buckets] in plan.py
        for b in self.buckets:  # for hang reports (tandem.comm.ledger)
            self.comm.ledger.describe_params(f"bucket {b.index}", b.names)
        self.plan, self.buffer = plan, buffer
        if self._zero:
            size = self.comm.size
            shards = GradBuffer({key: n // size for key, n in plan.buffer_numel.items()})
            self.grad_shards = [shards.slice_shard(spec, size) for spec in plan.buckets]
        self._where = [(0, 0)] * len(self.params)
        for b in self.buckets:
            for pos, i in enumerate(b.spec.params):
                self._where[i] = (b.index, pos)
        if self.options.gradient_as_bucket_view:
            # Existing gradients move into the (new) buffer and param.grad becomes the view.
            for i, p in enumerate(self.params):
                grad = local_grad(p)
                if grad is not None:
                    view = self._view(i)
                    view.copy_(grad)
                    set_local_grad(p, view)
        buffer.settle()

    def _rebase(self) -> None:
        """Give the buckets memory of their own again: a tensor outside the reducer
        still holds the old memory (Note [gradients born in their bucket] in write_back.py)."""
        self._build([i for spec in self.plan.buckets for i in spec.params])
        self._reset_buckets()
        self._foreign = foreign_grads(self.buckets)
        logger.debug("DDP: a tensor on the gradient buckets' memory is held outside the reducer "
                     "(a kept view of param.grad): the buckets moved to new memory")

    def _reset_buckets(self) -> None:
        """Every bucket starts a new step (in arm, and after _rebase built new ones)."""
        for b in self.buckets:
            b.reset()
            if b.spec.solo and not self._in_place:  # a hook was registered: it needs the bucket
                b.ensure_data()

    def _view(self, i: int) -> torch.Tensor:
        b, pos = self._where[i]
        return self.buckets[b].views[pos]

    @property
    def _learning_static_graph(self) -> bool:
        return self.options.static_graph and self._expected_count is None

    @property
    def _tracks_used(self) -> bool:
        """Whether this step all-reduces the map of locally used parameters."""
        return self._learning_static_graph or (
            self.options.find_unused_parameters and not self._static)

    def _count_bytes(self, event: CollectiveEvent) -> None:
        self._bytes += gradient_bytes(event)

    # ------------------------------------------------------------------ errors
    def _raise_missing(self, mine: list[str], late: bool = False) -> None:
        if not self._name_ranks:
            # Inside tandem.join the joined ranks mirror only the reduction's
            # collectives: a gather here would meet theirs and hang. Name this rank's.
            raise RuntimeError(missing_gradients(self.comm.rank, None, mine, late=late))
        per_rank = self.comm.all_gather_object(mine, tag="missing gradients")
        raise RuntimeError(missing_gradients(self.comm.rank, per_rank, late=late))

    def _raise_unfinished(self) -> None:
        waiting = [n for b in self.buckets if b.state is BucketState.FILLING for n in b.missing()]
        raise RuntimeError(unfinished_backward(self.comm.rank, waiting))
