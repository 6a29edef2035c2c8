"""``tandem.DistributedDataParallel``: torch's DDP interface over tandem's reducer.

The wrapper is built in layers, one concept a file, each class on the one
before: ``DDPState`` (module_state.py: what it holds, its reducer, its
properties and communication hook) <- ``JoinSupport`` (module_join.py: uneven
inputs) <- ``FusedStep`` (module_fuse.py: an optimizer stepped inside backward)
<- ``Copyable`` (module_copy.py: deepcopy and pickling) <-
``DistributedDataParallel`` (here: construction, forward, ``no_sync``). Its
arguments are checked in module_args.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem._compat import enter_ddp_forward, exit_ddp_forward, not_traced
from tandem.comm.group import GroupComm
from torch.distributed.algorithms.join import Join, Joinable

from tandem.ddp.compile import split_hint
from tandem.ddp.checks import NonFinite, broadcast_module_state, \
    check_same_model_on_all_ranks, check_tensor_parallel, model_signature
from tandem._tree import to_device
from tandem.ddp.module_args import check_zero_config, reject_unsupported, resolve_device_ids, \
    resolve_group, single_device
from tandem.ddp.module_copy import Copyable
from tandem.ddp.plan import cap_bytes_from_mb
from tandem.ddp.reducer import ReducerOptions
from tandem.ddp.zero_config import ZeroConfig, ZeroStage

__all__ = ["DistributedDataParallel"]

logger = logging.getLogger(__name__)


class DistributedDataParallel(Copyable):
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
      copy drops the hook, and skips that reduction). Note [copying a DDP model]
      in module_copy.py.

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
            ``mesh["tp"]``, pass ``mesh["dp"]`` (Note [tensor-parallel
            parameters] in tandem/dtensor.py).
        bucket_cap_mb_list: a cap per bucket, in MiB.
        batched_grad_copy: accepted (gradients are always copied per bucket).
        forward_sync_buffers: torch's newer name for ``broadcast_buffers`` (before
            forward only; buffers are always synchronised at construction).
        zero_stage: tandem only. 0 (default): all-reduce gradients. 1 or 2:
            reduce-scatter each bucket so that each rank holds the averaged
            gradients of its shard only, for :class:`tandem.ZeroOptimizer`
            (which is then required to step); at stage 2 ``param.grad`` is
            released after each synchronised backward. See Note [zero reduction].
        zero_config: tandem only. Overlap options for stages 1 and 2
            (:class:`tandem.zero.ZeroConfig`).
        check_finite: tandem only. ``False`` (default): no check, no cost.
            ``True`` or ``"raise"``: when a synchronised backward's gradients
            hold NaN or Inf on any rank, raise on every rank, naming the ranks
            and parameters. ``"skip"``: drop that step's gradients on every rank
            (``param.grad`` becomes None, so torch's optimizers step nothing)
            and set :attr:`found_nonfinite`, so that the caller skips
            ``optimizer.step()``; replicas stay identical. The ranks agree
            without an extra collective on the success path (Note
            [check_finite]). Under ``no_sync()`` the check happens at the
            synchronised backward, on the accumulated gradients.

    .. warning:: with ``check_finite="skip"`` and a stateful communication hook
        (PowerSGD's error feedback), the hook has already folded the step's
        NaN/Inf into its state on the offending rank; dropping the step does not
        undo that.

    .. warning:: at ``zero_stage`` 1 and 2, ``param.grad`` does not hold averaged
        gradients (stage 1: this rank's local ones; stage 2: None): clip with
        ``ZeroOptimizer.clip_grad_norm_``, not ``torch.nn.utils.clip_grad_norm_``.
        Each synchronised backward replaces the reduced gradients: to accumulate
        over micro-batches, run all but the last under ``no_sync()``.

    Raises:
        ValueError: bad arguments (``check_finite`` other than False, True,
            "raise" or "skip"), or a model (or ``check_finite``) that differs across ranks.
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
    ) -> None:
        nn.Module.__init__(self)
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
        self.process_group = resolve_group(process_group, device_mesh)
        self._comm = GroupComm(self.process_group)

        self._ignored = frozenset(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
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

        self._init_sync_buffers = init_sync_buffers
        if init_sync:
            self._sync_initial_state()

        self._trainable = trainable
        self._reducer_options = ReducerOptions(
            caps=caps,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            rebuild_buckets=not self.zero_stage,
            zero_stage=int(self.zero_stage),
            overlap=self.zero_config.overlap_grad_reduce,
            check_finite=self.check_finite)
        self._reducer = None
        self._fused = None
        self._comm_hook = None
        self._zero_optimizer = None  # set by the ZeroOptimizer built on this model
        self._failure_handler = None
        if self._needs_reducer():
            self._make_reducer()
        self._split_hint = split_hint(caps, self._reducer_options.overlap, self._comm.size)

    def _sync_initial_state(self) -> None:
        """Check that every rank wraps the same model, then give all of them rank 0's
        parameters (and buffers, when they are synced)."""
        if self._comm.size == 1:
            return
        named_params = [(n, p) for n, p in self.module.named_parameters() if n not in self._ignored]
        sync_buffers = self._named_buffers if self._init_sync_buffers else []
        # check_finite changes a step's collectives (Note [check_finite] in finite.py): it must agree too.
        options = {"check_finite": None if self.check_finite is None else self.check_finite.value}
        check_same_model_on_all_ranks(model_signature(named_params, sync_buffers, options), self._comm)
        broadcast_module_state([p for _, p in named_params] + [b for _, b in sync_buffers],
                               self._comm, src=0)

    def reset_process_group(self, process_group: dist.ProcessGroup | None = None) -> None:
        """Go on over another process group: after an elastic job's world changed
        (the default group was rebuilt), or to move the model to a new group.

        The step in progress is dropped (its gradients and pending reductions),
        the buckets are planned again for the new world, and the parameters and
        buffers are broadcast from the new group's rank 0 after checking that
        every rank holds the same model. A collective of the new group. A
        communication hook is kept when its state is this model's own
        communicator; any other hook must be registered again.
        """
        if self._reducer is not None:
            self._reducer.close()
        self._reducer = None
        hook = self._comm_hook
        self._comm_hook = None
        own_hook = hook is not None and hook[0] is self._comm
        self.process_group = process_group
        self._comm = GroupComm(process_group)
        self._sync_initial_state()
        if self._needs_reducer():
            self._make_reducer()
        if self._fused is not None:
            fused, self._fused = self._fused, None
            self.fuse_optimizer(fused)
        if own_hook and hook is not None:
            self.register_comm_hook(self._comm, hook[1])
        self._split_hint = split_hint(self._reducer_options.caps, self._reducer_options.overlap,
                                      self._comm.size)

    # ------------------------------------------------------------------ forward
    # Note [torch.compile] in compile.py. Decorated now, not lazily (_compat.not_traced): torch's lazy
    # wrapper would add a graph break to torch.compile(DDP(model)), which is one graph without it.
    @torch.compiler.disable(recursive=False)
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
                self._sync_buffers(self._common_rank(candidate=True) if self._join_config.enable else 0)
        except Exception as e:
            if not self._recovers(e):  # Note [recovered reduction failures] in reducer.py
                raise
        if self._join_config.enable:
            self._agree_on_grad_sync(joined=False)
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
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first synchronised backward after the
        context reduces the accumulated sum.

        .. warning:: the forward must run inside the context too: whether a
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
