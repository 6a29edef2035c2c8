"""``tandem.DistributedDataParallel``: torch's DDP interface over tandem's reducer.

One class, whose collaborators own their work: the reducer (reducer.py) the
gradients, :class:`~tandem.ddp.model_sync.ModelSync` the parameters' and
buffers' broadcasts and the agreements of uneven inputs, the fused optimizer
(fused.py) the step inside backward; its arguments are checked in module_args.py.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from tandem._compat import enter_ddp_forward, exit_ddp_forward, not_traced, not_traced_forward
from tandem._tree import to_device
from tandem.comm.group import GroupComm
from tandem.ddp.batch_weight import check_batch_weight, weigh_gradients
from tandem.ddp.checks import NonFinite, NonFiniteReport, check_tensor_parallel, signature_digest
from tandem.ddp.compile import split_hint
from tandem.ddp.fused import FusedOptimizer, ShardedStepSource, check_fusable, patch_step, unpatch_step
from tandem.ddp.join import DDPJoinHook, join
from tandem.ddp.model_sync import ModelSync
from tandem.ddp.module_args import check_zero_config, reject_unsupported, resolve_device_ids, \
    resolve_group, single_device
from tandem.ddp.plan import cap_bytes_from_mb
from tandem.ddp.bucket import ReducerOptions
from tandem.ddp.reducer import CommStats, GradReducer
from tandem.ddp.zero_config import ZeroConfig, ZeroStage

__all__ = ["DistributedDataParallel"]

logger = logging.getLogger(__name__)


# Copies: Note [copying a DDP model] below. device_mesh: Note [tensor-parallel parameters] in
# tandem/dtensor.py. zero_stage: Note [zero reduction] in reduction.py. check_finite: Note
# [check_finite] in finite.py.
class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism across processes: a drop-in for
    :class:`torch.nn.parallel.DistributedDataParallel`.

    Same arguments, defaults and behaviour as torch's: at construction every rank
    is checked to hold the same parameters, and parameters and buffers are
    broadcast from rank 0; during backward, gradients are averaged across ranks
    in buckets whose reductions overlap with the rest of backward; when
    ``loss.backward()`` returns, every rank holds the same averaged gradients.

    What differs from torch, by design:

    * A model that differs across ranks fails on every rank, naming the first
      differing parameter and the ranks (torch tells only one rank, and the
      others see a closed connection).
    * A parameter that gets no gradient without ``find_unused_parameters=True``
      fails at the end of that backward on every rank, naming the parameter and
      the rank (torch reports it one step late, by index).
    * ``static_graph`` composes with ``no_sync`` and with reentrant activation
      checkpointing.
    * A copy (``copy.deepcopy``, ``torch.save``/``torch.load``) keeps the
      communication hook, and a static-graph copy reduces its first step (torch's
      copy drops the hook, and skips that reduction). As in torch, only a model
      over the default process group can be copied, and copying issues no
      collective, so one rank alone may copy (an EMA or evaluation copy on rank
      0). A copy does not carry the gradients or a fused optimizer.

    Args:
        module: the model to replicate; its parameters must all be on one device.
        device_ids: ``None`` for CPU modules; ``[i]`` for a module on ``cuda:i``
            (inputs are moved there).
        output_device: accepted for compatibility; outputs stay where the module
            puts them, as in torch for single-device modules.
        dim: accepted for compatibility (torch's DDP no longer scatters inputs).
        broadcast_buffers: broadcast buffers from rank 0 at construction and
            before each forward that follows a synchronised forward.
        init_sync: check the model across ranks and broadcast its state at
            construction.
        process_group: the group to reduce over (default: the world).
        bucket_cap_mb: bucket size cap in MiB (default 25, first bucket 1 MiB).
        find_unused_parameters: walk the autograd graph after each forward so
            that parameters the loss does not reach do not hold up reduction.
        check_reduction: deprecated in torch; accepted and ignored.
        gradient_as_bucket_view: ``param.grad`` is a view into the flat bucket
            buffer (saves one copy of the gradients in memory and time).
        static_graph: the set of used parameters and the number of times each
            is used are the same every step.
        device_mesh: a 1-D device mesh, instead of ``process_group``: for a
            model parallelised with torch's tensor parallelism over
            ``mesh["tp"]``, pass ``mesh["dp"]``: each rank's local shards are
            averaged with the ranks that hold the same shards, and
            ``param.grad`` stays a DTensor laid out like its parameter.
        bucket_cap_mb_list: a cap per bucket, in MiB.
        batched_grad_copy: accepted (gradients are always copied per bucket).
        forward_sync_buffers: torch's newer name for ``broadcast_buffers`` (before
            forward only; buffers are always synchronised at construction).
        zero_stage: tandem only. 0 (default): all-reduce gradients. 1 or 2:
            reduce-scatter each bucket so that each rank holds the averaged
            gradients of its shard only, for :class:`tandem.ZeroOptimizer`
            (which is then required to step); at stage 2 ``param.grad`` is
            released after each synchronised backward.
        zero_config: tandem only. Overlap options for stages 1 and 2
            (:class:`tandem.zero.ZeroConfig`).
        check_finite: tandem only. ``False`` (default): no check, no cost.
            ``True`` or ``"raise"``: when a synchronised backward's gradients
            hold NaN or Inf on any rank, raise on every rank, naming the ranks
            and parameters. ``"skip"``: drop that step's gradients on every rank
            (``param.grad`` becomes None, so torch's optimizers step nothing)
            and set :attr:`found_nonfinite`, so that the caller skips
            ``optimizer.step()``; replicas stay identical. The ranks agree
            without an extra collective on the success path. Under
            ``no_sync()`` the check happens at the synchronised backward, on
            the accumulated gradients.
        reduce_dtype: tandem only. The dtype gradients are averaged in, as
            FSDP2's ``MixedPrecisionPolicy(reduce_dtype=...)``: each gradient is
            cast into a bucket of this dtype, the buckets are reduced in it, and
            ``param.grad`` gets the average cast back to the parameter's dtype.
            ``torch.bfloat16`` halves the bytes sent, at bf16's rounding; equal
            to torch's DDP with its ``bf16_compress_hook`` (and ``float16`` to
            its ``fp16_compress_hook``). None (default): each parameter's own
            dtype. Not with ``zero_stage``, ``gradient_as_bucket_view`` or
            :meth:`fuse_optimizer`, which hand the buckets' own tensors to the
            optimizer.

    Warning:
        With ``check_finite="skip"`` and a stateful communication hook
        (PowerSGD's error feedback), the hook has already folded the step's
        NaN/Inf into its state on the offending rank; dropping the step does not
        undo that.

    Warning:
        At ``zero_stage`` 1 and 2, ``param.grad`` does not hold averaged
        gradients (stage 1: this rank's local ones; stage 2: None): clip with
        ``ZeroOptimizer.clip_grad_norm_``, not ``torch.nn.utils.clip_grad_norm_``.
        Each synchronised backward replaces the reduced gradients: to accumulate
        over micro-batches, run all but the last under ``no_sync()``.

    Raises:
        ValueError: bad arguments (``check_finite`` other than False, True,
            "raise" or "skip", a ``reduce_dtype`` that is not a floating-point
            dtype or comes with ZeRO or ``gradient_as_bucket_view``), or a model
            (or ``check_finite``) that differs across ranks.
        NotImplementedError: an argument of torch's that tandem does not support
            yet (``mixed_precision``, ``delay_all_reduce_named_params``,
            ``param_to_hook_all_reduce``, ``skip_all_reduce_unused_params``).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        zero_stage: int | ZeroStage = 0,
        zero_config: ZeroConfig | None = None,
        check_finite: bool | str | NonFinite = False,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        nn.Module.__init__(self)
        not_traced_forward.apply_if_loaded(DistributedDataParallel)  # Note [torch.compile] in compile.py
        Joinable.__init__(self)
        reject_unsupported(delay_all_reduce_named_params=delay_all_reduce_named_params,
                            param_to_hook_all_reduce=param_to_hook_all_reduce,
                            mixed_precision=mixed_precision,
                            skip_all_reduce_unused_params=skip_all_reduce_unused_params or None)
        self.module = module
        self.zero_stage = ZeroStage.parse(zero_stage)
        self.zero_config = check_zero_config(zero_config, self.zero_stage, gradient_as_bucket_view,
                                              find_unused_parameters)
        self.check_finite = NonFinite.parse(check_finite)
        self.reduce_dtype = _checked_reduce_dtype(reduce_dtype, self.zero_stage, gradient_as_bucket_view)
        self.process_group = resolve_group(process_group, device_mesh)
        self._comm = GroupComm(self.process_group)
        self._ignored = frozenset(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self._sync = ModelSync(module, self._ignored, self._comm)
        named_params = [(n, p) for n, p in module.named_parameters() if n not in self._ignored]
        self._named_buffers = [(n, b) for n, b in module.named_buffers() if n not in self._ignored]
        trainable = [(n, p) for n, p in named_params if p.requires_grad]
        if not trainable:
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any "
                "parameter that requires a gradient.")
        for n, p in named_params:
            if isinstance(p, nn.parameter.UninitializedParameter):
                raise RuntimeError(
                    f"parameter '{n}' is uninitialized (a lazy module): run a dummy forward "
                    "pass to initialise it before wrapping the module in DistributedDataParallel")
        if dist.is_initialized():  # Note [tensor-parallel parameters] in tandem/dtensor.py
            group = self.process_group if self.process_group is not None else dist.group.WORLD
            check_tensor_parallel(named_params, dist.get_process_group_ranks(group), dist.get_rank(),
                                  int(self.zero_stage))
        self.device, self.device_type = single_device(named_params)
        self.device_ids, self.output_device = resolve_device_ids(
            device_ids, output_device, self.device, self.device_type)
        self.dim = dim

        if forward_sync_buffers is not None:
            self.forward_sync_buffers = forward_sync_buffers
            init_sync_buffers = True
        else:
            self.forward_sync_buffers = True if broadcast_buffers is None else bool(broadcast_buffers)
            init_sync_buffers = self.forward_sync_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        caps = tuple(cap_bytes_from_mb(bucket_cap_mb, bucket_cap_mb_list))
        self.bucket_bytes_cap = caps[-1]
        # Per-step toggles, as in torch (nanoGPT sets require_backward_grad_sync directly).
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True  # set by the join hook
        self._batch_weight = 1.0  # Note [batch weight] in batch_weight.py

        self._init_sync_buffers = init_sync_buffers
        if init_sync:
            self._sync_initial_state()

        self._trainable: list[tuple[str, nn.Parameter]] = trainable
        self._reducer_options = ReducerOptions(
            caps=caps,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            rebuild_buckets=not self.zero_stage,
            zero_stage=int(self.zero_stage),
            overlap=self.zero_config.overlap_grad_reduce,
            check_finite=self.check_finite,
            reduce_dtype=self.reduce_dtype)
        self._reducer: GradReducer | None = None
        self._fused: torch.optim.Optimizer | None = None
        self._comm_hook: tuple[object, Any] | None = None  # (state, hook), for copies
        # The ZeroOptimizer built on this model, whose parameter all-gathers a copy must
        # wait for (Note [copying a DDP model]); set by ZeroOptimizer.
        self._zero_optimizer: weakref.ref[ShardedStepSource] | None = None
        # Note [recovered reduction failures] in reducer.py; given to every reducer it builds.
        self._failure_handler: Callable[[BaseException], bool] | None = None
        if self._needs_reducer():
            self._make_reducer()
        self._split_hint = split_hint(caps, self._reducer_options.overlap, self._comm.size)

    def _checked_options(self) -> dict[str, object]:
        # check_finite changes a step's collectives (Note [check_finite] in finite.py): it must agree too.
        return {"check_finite": None if self.check_finite is None else self.check_finite.value}

    def _sync_initial_state(self, *, broadcast: bool = True, check: bool = True) -> None:
        """Check that every rank wraps the same model (unless not ``check``), then
        (``broadcast``) give all of them rank 0's parameters (and buffers, when they are synced)."""
        self._sync.start(buffers=self._init_sync_buffers, options=self._checked_options(), broadcast=broadcast,
                         check=check)

    def model_digest(self) -> list[int]:
        """What the model check compares across ranks (the parameters' and buffers'
        names, shapes, dtypes and options), as four int64s: for a caller that
        gathers them with numbers of its own and then calls :meth:`check_model`
        (an elastic world change's)."""
        return signature_digest(self._sync.signature(buffers=self._init_sync_buffers,
                                                     options=self._checked_options()))

    def check_model(self, digests: Sequence[Sequence[int]]) -> None:
        """Raise the same ValueError on every rank, naming the first difference,
        unless ``digests`` (every rank's :meth:`model_digest`, in rank order) agree;
        a collective only when they do not."""
        self._sync.check(buffers=self._init_sync_buffers, options=self._checked_options(), digests=digests)

    def _needs_reducer(self) -> bool:
        # A world of one needs no reducer, unless ZeRO's optimizer reads its
        # shards, the gradients are checked, or an optimizer is fused.
        return self._comm.size > 1 or bool(self.zero_stage) or self.check_finite is not None

    def _make_reducer(self) -> GradReducer:
        if self._reducer is None:
            self._reducer = GradReducer(self._trainable, self._comm, self._reducer_options)
            self._reducer.failure_handler = self._failure_handler
        return self._reducer

    def reset_process_group(self, process_group: dist.ProcessGroup | None = None, *,
                            broadcast: bool = True, check: bool = True) -> None:
        """Go on over another process group: after an elastic job's world changed
        (the default group was rebuilt), or to move the model to a new group.

        The step in progress is dropped (its gradients and pending reductions),
        the buckets are planned again for the new world, and the parameters and
        buffers are broadcast from the new group's rank 0 after checking that
        every rank holds the same model. A collective of the new group. With
        ``broadcast=False`` the check only: an elastic job's rebuild, whose
        members hold equal models, and whose replacement receives the whole
        training state next (Note [elastic trainer] in tandem/elastic/run.py).
        With ``check=False`` not even the check: its caller checks, with
        :meth:`model_digest` and :meth:`check_model`. A
        communication hook is kept when its state is this model's own
        communicator, or says it follows the default group into a new world
        (``follows_world``, as :class:`tandem.comm_hooks.QuantizedState` and
        :class:`tandem.comm_hooks.PowerSGDState` over the default group, which
        then ``regroup``); any other hook is dropped, with a warning, and must
        be registered again.
        """
        if self._reducer is not None:
            self._reducer.close()
        self._reducer = None
        hook = self._comm_hook
        self._comm_hook = None
        own_hook = hook is not None and hook[0] is self._comm
        follows = hook is not None and getattr(hook[0], "follows_world", False) is True
        self.process_group = process_group
        self._comm = GroupComm(process_group)
        self._sync = ModelSync(self.module, self._ignored, self._comm)
        self._sync_initial_state(broadcast=broadcast, check=check)
        if self._needs_reducer():
            self._make_reducer()
        if self._fused is not None:
            fused, self._fused = self._fused, None
            self.fuse_optimizer(fused)
        if own_hook and hook is not None:
            self.register_comm_hook(self._comm, hook[1])
        elif follows and hook is not None:
            self.register_comm_hook(*hook)
            regroup = getattr(hook[0], "regroup", None)
            if callable(regroup):  # PowerSGD: Note [powersgd in a new world] in tandem/comm_hooks/powersgd.py
                regroup(self._comm, list(self.module.parameters()))
        elif hook is not None and self._comm.rank == 0:
            logger.warning("the communication hook %s was dropped in the new world of %d rank(s): its state holds "
                           "the old world's group; the model reduces with its default all-reduce until a hook "
                           "is registered again", getattr(hook[1], "__name__", repr(hook[1])), self._comm.size)
        self._split_hint = split_hint(self._reducer_options.caps, self._reducer_options.overlap,
                                      self._comm.size)

    # ------------------------------------------------------------------ forward
    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``nn.Module.compile``, with :meth:`forward` decorated for dynamo first
        (``_compat.not_traced_forward``: it loads dynamo, and traces the forward next)."""
        super().compile(*args, **kwargs)
        not_traced_forward.apply_if_loaded(DistributedDataParallel)

    # Note [torch.compile] in compile.py. Not with _compat.not_traced: torch's lazy wrapper would add
    # a graph break to torch.compile(DDP(model)), which is one graph without it.
    @not_traced_forward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        inputs, kwargs, join_work, outer_ddp = self._pre_forward(inputs, kwargs)
        try:
            output = self.module(*inputs, **kwargs)
        except BaseException:
            self._exit_compile_hint(outer_ddp)
            raise
        return self._post_forward(output, join_work, outer_ddp)

    @not_traced
    def _pre_forward(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict, Any, Any]:
        # Note [join mirror] in join.py: the order of the collectives below is
        # what a joined rank's hook mirrors.
        join_work = Join.notify_join_context(self)
        try:
            if self._reducer is not None and torch.is_grad_enabled():
                self._reducer.before_forward()
            if self._will_sync_buffers():
                self._sync.buffers(self._sync.common_rank(candidate=True) if self._join_config.enable else 0)
        except Exception as e:
            if not self._recovers(e):  # Note [recovered reduction failures] in reducer.py
                raise
        if self._join_config.enable:
            self._sync.agree_on_grad_sync(joined=False, wanted=self.require_backward_grad_sync)
        if self.device_ids:
            inputs, kwargs = to_device((inputs, kwargs), self.device)
        # Last: the inner module's frame is compiled split at buckets (Note [torch.compile]).
        outer_ddp = enter_ddp_forward(self._split_hint) if self._split_hint is not None else None
        return inputs, kwargs, join_work, outer_ddp

    @not_traced
    def _exit_compile_hint(self, outer_ddp: Any) -> None:
        if self._split_hint is not None:
            exit_ddp_forward(outer_ddp)

    @not_traced
    def _post_forward(self, output: Any, join_work: Any, outer_ddp: Any) -> Any:
        if self._split_hint is not None:
            exit_ddp_forward(outer_ddp)
        if self._batch_weight != 1.0 and torch.is_grad_enabled():
            weigh_gradients(output, self._batch_weight)  # Note [batch weight] in batch_weight.py
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            if self._reducer is not None:
                self._reducer.arm(output, divisor=self._grad_divisor(join_work),
                                  name_ranks=not self._join_config.enable)
        else:
            self.require_forward_param_sync = False
        return output

    def _grad_divisor(self, join_work: Any) -> int:
        """How many ranks' gradients the average is over: the world, or under
        join with divide_by_initial_world_size=False, the ranks still training."""
        if join_work is None or self._divide_by_initial_world_size:
            return self._comm.size
        join_work.wait()
        return int(join_work.result()[0].item())

    # ------------------------------------------------------------------ toggles
    @property
    def batch_weight(self) -> float:
        """How many times this rank's gradients of the forwards that follow count
        in the mean over the ranks: 1.0, torch's plain mean, unless batches of
        unequal sizes are weighed by ``n_rank * world_size / global_batch_size``.
        A prepared elastic loader sets it for each batch; the weights assume a
        loss that is a mean over the batch."""
        return self._batch_weight  # Note [batch weight] in batch_weight.py

    @batch_weight.setter
    def batch_weight(self, weight: float) -> None:
        self._batch_weight = check_batch_weight(weight, self._comm.rank)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first synchronised backward after the
        context reduces the accumulated sum.

        Warning:
            The forward must run inside the context too: whether a
            backward synchronises is decided by the forward that produced it.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def prepare_for_backward(self, output: Any) -> None:
        """Make the next backward through ``output`` the synchronised one, although
        the forward that produced it ran under ``no_sync()``: torch's
        ``reducer.prepare_for_backward``, which torch's ``PipelineStage`` calls.

        For pipeline schedules (``torch.distributed.pipelining``), which run several
        micro-batches' forwards before their backwards and know only at backward
        time which backward is the last of the step: run every forward under
        ``no_sync()`` and call this with the last micro-batch's stage output (or
        loss) just before its backward. That backward reduces, together with its
        own gradients, those that the earlier backwards accumulated, as after
        ``no_sync()``. A no-op in a group of one.
        """
        if self._reducer is not None:
            self._reducer.arm(output, divisor=self._comm.size, name_ranks=not self._join_config.enable)

    # ------------------------------------------------------------------ the reducer
    def set_failure_handler(self, handler: Callable[[BaseException], bool] | None) -> None:
        """Let ``handler(error)`` recover from a collective of this model's that fails
        (a peer died): when it returns True, the forward or backward in progress
        returns without that collective's result (the gradients are left as
        they are), and the caller is to drop the step; False, or no handler,
        raises the error as before. For an elastic loop:
        ``tandem.prepare(elastic=...)`` sets it. Kept across
        ``reset_process_group``."""
        # Note [recovered reduction failures] in reducer.py.
        self._failure_handler = handler
        if self._reducer is not None:
            self._reducer.failure_handler = handler

    def _recovers(self, error: BaseException) -> bool:
        return self._failure_handler is not None and self._failure_handler(error)

    # ------------------------------------------------------------------ properties
    @property
    def broadcast_buffers(self) -> bool:
        return self.forward_sync_buffers

    @property
    def comm(self) -> GroupComm:
        """The collectives layer this DDP issues through (observers see every collective)."""
        return self._comm

    @property
    def reducer(self) -> GradReducer | None:
        """The gradient reducer (None in a world of one)."""
        return self._reducer

    @property
    def comm_stats(self) -> CommStats | None:
        """This rank's gradient communication in the last synchronised backward:
        ``bytes`` sent (payload of the bucket all-reduces, or of the collectives a
        communication hook issued through ``bucket.comm``) and ``wait_s``, the
        seconds the end of backward waited for them. None before the first
        synchronised backward, and in a world of one."""
        return None if self._reducer is None else self._reducer.last_stats

    @property
    def found_nonfinite(self) -> bool:
        """Whether the last synchronised backward found NaN or Inf in the gradients
        (with ``check_finite="skip"``: its gradients were dropped, skip
        ``optimizer.step()``). The same on every rank; False without the check."""
        return self._reducer is not None and self._reducer.nonfinite is not None

    @property
    def nonfinite_report(self) -> NonFiniteReport | None:
        """Where the last synchronised backward's non-finite gradients were (the
        ranks and parameters), or None when they were finite or not checked."""
        return None if self._reducer is None else self._reducer.nonfinite

    # ------------------------------------------------------------------ hooks
    def register_comm_hook(self, state: object, hook: Any) -> None:
        """Reduce gradient buckets with ``hook(state, bucket) -> Future[Tensor]``.

        Torch's contract: the hook is called once per bucket when it is ready, with
        a :class:`~tandem.ddp.grad_bucket.GradBucket` whose buffer holds the sum of
        this rank's gradients (not divided by the world size: the hook averages);
        the future's value becomes the bucket's reduced gradients. Hooks written
        for torch's DDP (``torch.distributed.algorithms.ddp_comm_hooks``) work
        unchanged. Register once, before the first backward.

        Raises:
            RuntimeError: a hook is already registered, or backward already ran.
        """
        if self.zero_stage:
            raise NotImplementedError(
                f"register_comm_hook is not supported with zero_stage={int(self.zero_stage)}: "
                "ZeRO reduce-scatters each bucket itself")
        self._comm_hook = (state, hook)  # kept in a world of one too: an elastic replacement's grows
        if self._reducer is None:
            return  # a world of one: nothing to reduce
        self._reducer.register_comm_hook(state, hook)

    # ------------------------------------------------------------------ uneven inputs
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """A context manager for uneven inputs over this model alone; see :func:`tandem.join`."""
        return join([self], enable=enable, throw_on_early_termination=throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        if self.zero_stage:
            # A joined rank would also have to mirror ZeroOptimizer's all-gathers.
            raise NotImplementedError(
                f"tandem.join is not supported with zero_stage={int(self.zero_stage)} yet")
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._comm.device

    @property
    def join_process_group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    @property
    def model_sync(self) -> ModelSync:
        """The broadcasts and agreements of one iteration that a rank mirrors after
        it joined (:func:`tandem.join`)."""
        return self._sync  # Note [join mirror] in join.py

    def _will_sync_buffers(self) -> bool:
        return (self._comm.size > 1 and self.require_forward_param_sync
                and self.forward_sync_buffers and bool(self._named_buffers))

    # ------------------------------------------------------------------ the fused step
    def fuse_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` inside backward, bucket by bucket, as soon as each
        bucket's averaged gradients have landed.

        The training loop stays as it is: ``optimizer.step()`` becomes a no-op
        (the step already ran in the synchronised ``loss.backward()``), and
        ``zero_grad()``, ``state_dict()``, param groups and LR schedulers work on
        ``optimizer`` as before. After a fused step ``param.grad`` is None: the
        averaged gradients are not kept. Backwards under ``no_sync()`` accumulate
        as usual; the synchronised one that follows steps. Results equal the
        unfused ``optimizer.step()`` after backward.

        Args:
            optimizer: a ``torch.optim.Optimizer`` over this model's trainable
                parameters (any param groups), or, with ``zero_stage`` 1 or 2,
                the :class:`tandem.ZeroOptimizer` built on this model, whose
                shards then step as their reduce-scatters land.

        Raises:
            ValueError: the optimizer holds a tensor that is not a trainable
                parameter of this model, is LBFGS (it needs a closure), or, under
                ZeRO, is not the ZeroOptimizer of this model.
            TypeError: not a torch optimizer.

        Warning:
            What needs every gradient before the first update cannot
            run in a fused step: clipping by global norm, and fp16 loss scaling
            (``GradScaler`` unscales and checks all gradients before it steps).
            Use the unfused optimizer for those; with ``check_finite`` the fused
            step waits for every bucket and is dropped on every rank together.
        """
        # Note [fused step] in fused.py.
        optimizer = check_fusable(optimizer)
        if self.reduce_dtype is not None:
            raise ValueError(
                f"rank {self._comm.rank}: fuse_optimizer with reduce_dtype={self.reduce_dtype}: the fused "
                "step would hand the optimizer the buckets' own tensors, in the reduce dtype, as the "
                "gradients of parameters of another; leave reduce_dtype unset, or step the optimizer "
                "after backward")
        if self._fused is not None:
            raise RuntimeError(f"an optimizer ({type(self._fused).__name__}) is already fused into this "
                               "DistributedDataParallel; call unfuse_optimizer() first")
        reducer = self._make_reducer()
        stepper: Any
        if self.zero_stage:
            # The ZeroOptimizer built on this model registered itself (tandem.zero
            # builds on this module, not the other way round) and makes its stepper.
            zero = self._zero_optimizer() if self._zero_optimizer is not None else None
            if zero is None or zero is not optimizer:
                raise ValueError(
                    f"fuse_optimizer under zero_stage={int(self.zero_stage)} needs the tandem.ZeroOptimizer "
                    f"built on this DistributedDataParallel, got {type(optimizer).__name__}: "
                    "ddp.fuse_optimizer(tandem.ZeroOptimizer(ddp, torch.optim.AdamW, lr=...))")
            stepper = zero.fused_stepper(reducer)
        else:
            stepper = FusedOptimizer(optimizer, reducer.params)
        reducer.set_stepper(stepper)
        patch_step(optimizer, "DistributedDataParallel.fuse_optimizer")
        self._fused = optimizer

    def unfuse_optimizer(self) -> None:
        """Undo :meth:`fuse_optimizer`: ``optimizer.step()`` steps again, after backward."""
        if self._fused is None:
            return
        assert self._reducer is not None
        self._reducer.set_stepper(None)
        unpatch_step(self._fused)
        self._fused = None

    @property
    def fused_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer that steps inside backward, or None."""
        return self._fused

    # ------------------------------------------------------------------ copies
    # Note [copying a DDP model]
    # copy.deepcopy and torch.save/torch.load go through __getstate__ and
    # __setstate__, as in torch's DDP: the copy holds copies of the module (its
    # own parameters and buffers) and of the options, and rebuilds what is bound
    # to this process and its group (the reducer with its hooks on the
    # parameters, the GroupComm with the ledger and monitors) over the default
    # process group. So, as torch does, a model over any other group is refused,
    # and neither copying nor loading issues a collective: one rank alone may
    # copy (an EMA or evaluation copy on rank 0) or load.
    # What a copy does not carry: the reducer's learned state (it re-plans
    # buckets and re-learns a static graph in its first step, like a new DDP:
    # the arithmetic is the same; torch's copy carries its "first static
    # iteration done" flag to its new reducer, skips that step's all-reduce
    # and its replicas part), the gradients (torch does not copy
    # param.grad either: copy between steps, after optimizer.step()), and a
    # fused optimizer (the copied optimizer steps as usual; fuse it again if
    # wanted). A communication hook is carried, with a copy of its state (torch's
    # copy silently drops it and all-reduces). Under ZeRO with
    # overlap_param_gather, the all-gathers still in flight are waited for first,
    # so that the copy holds the stepped parameters; a ZeroOptimizer copied
    # together with the model binds to the copy (Note [copying a ZeroOptimizer]).
    def __getstate__(self) -> dict[str, Any]:
        if self.process_group is not None and self.process_group is not dist.group.WORLD:
            raise RuntimeError(
                f"rank {self._comm.rank}: a DistributedDataParallel over a process group other than the "
                "default one cannot be deep-copied or pickled (the copy rebuilds its reducer over the "
                "default group, and torch's DDP refuses it likewise); copy the wrapped module instead, "
                "copy.deepcopy(ddp.module) or torch.save(ddp.module.state_dict()), and wrap the copy "
                "in DistributedDataParallel with the same process_group")
        zero = self._zero_optimizer() if self._zero_optimizer is not None else None
        if zero is not None:
            zero.finish_param_gather()  # waits only: no collective
        state: dict[str, Any] = nn.Module.__getstate__(self)  # nn.Module's: __dict__ less compiled calls
        # The failure handler belongs to this process's elastic loop, not to a copy.
        for name in ("_comm", "_sync", "_reducer", "_fused", "_zero_optimizer", "process_group", "_failure_handler"):
            del state[name]
        if self._comm_hook is not None and self._comm_hook[0] is self._comm:
            state["_comm_hook"] = (_OwnComm(), self._comm_hook[1])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        hook = state.pop("_comm_hook", None)
        nn.Module.__setstate__(self, state)
        self.process_group = None
        self._reducer = None
        self._fused = None
        self._comm_hook = None
        self._zero_optimizer = None
        self._failure_handler = None
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "loading a pickled tandem.DistributedDataParallel rebuilds it over the default process "
                "group, which is not initialised: call tandem.init() (or "
                "torch.distributed.init_process_group) before torch.load, or save and load "
                "ddp.module (or its state_dict()) instead of the wrapper")
        self._comm = GroupComm(None)
        self._sync = ModelSync(self.module, self._ignored, self._comm)
        if self._needs_reducer():
            self._make_reducer()
        if hook is not None:
            hook_state, fn = hook
            self.register_comm_hook(self._comm if isinstance(hook_state, _OwnComm) else hook_state, fn)


class _OwnComm:
    """Stands for the copied DDP's own GroupComm as a communication hook's state."""


def _checked_reduce_dtype(dtype: torch.dtype | None, zero_stage: ZeroStage,
                          gradient_as_bucket_view: bool) -> torch.dtype | None:
    """``reduce_dtype`` of :class:`DistributedDataParallel`, or the error that names it."""
    if dtype is None:
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"rank {rank}: reduce_dtype must be a floating-point torch.dtype such as torch.bfloat16, "
                         f"got {dtype!r}")
    if zero_stage:
        raise ValueError(f"rank {rank}: reduce_dtype={dtype} is not supported with zero_stage={int(zero_stage)}: the "
                         "ZeroOptimizer steps from the reduced buckets themselves; leave one of them unset")
    if gradient_as_bucket_view:
        raise ValueError(f"rank {rank}: reduce_dtype={dtype} cannot be used with gradient_as_bucket_view=True: a "
                         f"bucket of {dtype} cannot be the .grad of a parameter of another dtype; "
                         "leave one of them unset")
    return dtype
