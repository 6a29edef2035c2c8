"""``tandem.ZeroOptimizer``: any torch.optim optimizer, stepping only this rank's
shard of every DDP bucket (ZeRO stages 1 and 2).

Life of one step::

    backward       reducer reduce-scatters each bucket: grad_shards[b] holds the
                   averaged gradients of this rank's shard (Note [zero reduction])
    step()         each run's .grad is a view of its slice of grad_shards[b];
                   the wrapped optimizer steps the runs (its state exists only
                   for them); the updated shard of each bucket is all-gathered
                   into the parameters of every rank

# Note [shard runs]
A rank's shard of a bucket cuts across parameters (layout.py's pieces), and the
parameters may belong to different param groups. The wrapped optimizer gets one
flat tensor per *run*: a maximal stretch of the shard whose pieces are adjacent
and belong to the same param group (usually one or two per bucket). A run's
``.grad`` is a view of the reduced gradient shard, so no gradient is copied, and
its optimizer state is flat too. Runs hold the master values (fp32, or the
parameter's dtype when wider); pieces are what map them back to parameter
elements, for the all-gather and for checkpoints in torch's per-parameter format,
which is also what makes a checkpoint loadable at another world size.

# Note [copying a ZeroOptimizer]
torch's ZeroRedundancyOptimizer survives copy.deepcopy and torch.save only in
appearance: torch.optim.Optimizer's __getstate__ keeps defaults, state and
param_groups, so the copy's first step() raises AttributeError. A ZeroOptimizer
is bound to its DDP model's reducer (it steps the reducer's gradient shards), so
its copy carries the model instead and rebuilds itself over the model's copy
(which has rebuilt its reducer, Note [copying a DDP model] in
tandem/ddp/module.py), then restores its shard of the state: the wrapped
optimizer's state and the master values (wider than the parameters under
low-precision training). Copied together, ``copy.deepcopy((model, optimizer))``
or one ``torch.save`` of both, the two copies belong together and train as the
originals do; the optimizer copied alone brings a copy of the model with it, as
a torch optimizer brings copies of its parameters. The state is this rank's
shard: a copy loads at the same rank and world size only (for another world
size, use state_dict() or save_sharded()). The forward pre-hooks of
overlap_param_gather, which the module's copy would otherwise carry and call
on the original optimizer, copy as no-ops and are removed when the optimizer's
copy registers its own.

ZeroOptimizer is one class whose collaborators own their work:
:class:`~tandem.zero.shards.ZeroShards` (shards.py) this rank's runs and their
masters, :class:`~tandem.zero.param_gather.ParamGather` (param_gather.py) the
parameter all-gathers and their forward pre-hooks; state_dict.py the pure
conversions of its checkpoints.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tandem.checkpoint.agree import agree
from tandem.checkpoint.atomic import atomic_save
from tandem.checkpoint.commit import CheckpointError, committed_steps, load_committed, save_committed
from tandem.zero.fused import ZeroFusedStep
from tandem.zero.layout import shard_bucket
from tandem.zero.param_gather import ParamGather
from tandem.zero.shards import ZeroShards
from tandem.zero.state_dict import SHARD_FORMAT, Entry, assemble_state, check_shards, entries_of_run, \
    run_state_from

__all__ = ["ZeroOptimizer"]

logger = logging.getLogger(__name__)

_SHARDS_KIND = "zero-shards"  # the kind of save_sharded's committed checkpoints


class ZeroOptimizer(torch.optim.Optimizer):
    """A distributed optimizer that shards optimizer state (ZeRO stage 1) and works
    with sharded gradients (stage 2) of a :class:`tandem.DistributedDataParallel`
    built with ``zero_stage=1`` or ``2``.

    Each rank owns a contiguous shard of every gradient bucket, keeps the wrapped
    optimizer's state only for that shard, steps only that shard, and then
    all-gathers the updated parameters, so that after :meth:`step` every rank
    holds the same full parameters, as with plain DDP.

    ``param_groups`` hold the model's parameters and the hyper-parameters, as in
    any torch optimizer: learning-rate schedulers work on this object.

    Args:
        ddp_model: a ``tandem.DistributedDataParallel`` with ``zero_stage`` 1 or 2.
        optimizer_class: a ``torch.optim.Optimizer`` subclass, e.g. ``torch.optim.AdamW``.
        params: ``ddp_model``'s parameters to optimize, or a list of param-group
            dicts, as for any torch optimizer (default: all trainable parameters).
        **optimizer_kwargs: the defaults for ``optimizer_class``.

    Raises:
        ValueError: ``ddp_model`` is not a ZeRO DDP, or ``params`` names a tensor
            that is not one of its trainable parameters.

    Warning:
        ``param.grad`` does not hold averaged gradients under ZeRO; clip
        with :meth:`clip_grad_norm_`, not ``torch.nn.utils.clip_grad_norm_``.
    """

    def __init__(self, ddp_model: torch.nn.Module, optimizer_class: type[torch.optim.Optimizer],
                 params: Iterable[Any] | None = None, **optimizer_kwargs: Any) -> None:
        reducer = getattr(ddp_model, "reducer", None)
        stage = int(getattr(ddp_model, "zero_stage", 0))
        if reducer is None or not stage:
            raise ValueError("ZeroOptimizer needs tandem.DistributedDataParallel(..., zero_stage=1 or 2), "
                             f"got {type(ddp_model).__name__} with zero_stage={stage}")
        self._ddp = ddp_model
        self._optimizer_class = optimizer_class
        self._optimizer_kwargs = dict(optimizer_kwargs)
        self._reducer = reducer
        self._comm = reducer.comm
        self.zero_stage = stage
        groups = _normalise_groups(reducer.params if params is None else params)
        self._shards = ZeroShards(reducer, self._comm.rank, self._comm.size, _group_of_params(groups, reducer))
        self._optim = optimizer_class(self._shards.inner_groups(groups), **optimizer_kwargs)
        super().__init__(groups, self._optim.defaults)
        self._groups_fixed = True  # the shards are laid out for these groups
        self._sync_hyperparams()
        self._seen_steps = reducer.steps
        ddp: Any = ddp_model  # a tandem DDP (checked above), whose attributes nn.Module's typing hides
        self._gather = ParamGather(reducer, self._comm, self._shards, ddp.module,
                                   overlap=bool(ddp.zero_config.overlap_param_gather))
        ddp._zero_optimizer = weakref.ref(self)  # a copy of the model first waits for our gathers
        owned = self.owned_numel
        total = sum(b.numel for b in reducer.plan.buckets)
        logger.info("ZeRO-%d: rank %d owns %d of %d elements in %d runs over %d buckets",
                    stage, self._comm.rank, owned, total, len(self._shards.runs), len(reducer.plan.buckets))

    # ------------------------------------------------------------------ what it holds
    @property
    def optim(self) -> torch.optim.Optimizer:
        """The wrapped optimizer, over this rank's shard runs only (as torch's
        ``ZeroRedundancyOptimizer.optim``)."""
        return self._optim

    @property
    def shards(self) -> ZeroShards:
        """This rank's shards as the wrapped optimizer steps them: one flat tensor
        per run (a stretch of a bucket's shard whose parameters are adjacent and
        in one param group), holding the master values."""
        return self._shards  # Note [shard runs]

    @property
    def owned_numel(self) -> int:
        """How many parameter elements this rank steps."""
        return self._shards.owned_numel

    @property
    def overlap_gather(self) -> bool:
        return self._gather.overlap

    @property
    def gathers_in_flight(self) -> int:
        """Buckets whose updated parameters are not written yet (overlap_param_gather)."""
        return self._gather.in_flight

    def finish_param_gather(self) -> None:
        """Wait for every parameter all-gather still in flight and write the
        parameters (a no-op unless ``overlap_param_gather`` left some)."""
        self._gather.finish_all()

    # ------------------------------------------------------------------ copies
    def __getstate__(self) -> dict[str, Any]:  # Note [copying a ZeroOptimizer]
        self.finish_param_gather()  # waits only: no collective
        return {"ddp": self._ddp, "optimizer_class": self._optimizer_class,
                "optimizer_kwargs": self._optimizer_kwargs, "param_groups": self.param_groups,
                "rank": self._comm.rank, "world_size": self._comm.size, "runs": self._shards.runs,
                "masters": [m.detach() for m in self._shards.masters], "inner": self._optim.state_dict(),
                "gather_hooks": self._gather.hooks}

    def __setstate__(self, state: dict[str, Any]) -> None:
        ddp = state["ddp"]
        for handle in state["gather_hooks"]:
            handle.remove()  # the copied module's no-op copies of our hooks
        self.__init__(ddp, state["optimizer_class"], state["param_groups"],  # type: ignore[misc]
                      **state["optimizer_kwargs"])
        fix = ("carry the state with optimizer.state_dict() (or save_sharded()) into a ZeroOptimizer "
               "built on the loaded model")
        if (self._comm.rank, self._comm.size) != (state["rank"], state["world_size"]):
            raise RuntimeError(
                f"rank {self._comm.rank} of {self._comm.size}: this ZeroOptimizer was copied or pickled at "
                f"rank {state['rank']} of {state['world_size']} and holds that rank's shard of the optimizer "
                f"state; load it at the same rank and world size, or {fix}")
        if self._shards.runs != state["runs"]:
            raise RuntimeError(
                f"rank {self._comm.rank}: the loaded model's buckets are not those this ZeroOptimizer's "
                f"shards were laid out over (another tandem version?); {fix}")
        with torch.no_grad():
            for master, saved in zip(self._shards.masters, state["masters"]):
                master.copy_(saved)
        self._optim.load_state_dict(state["inner"])

    def reset_process_group(self) -> None:
        """Lay the shards out again after the model moved to another process group
        (``DistributedDataParallel.reset_process_group``, an elastic job's new
        world): this rank's runs are planned for the new world size, and the
        parameter groups (with their current hyper-parameters) are kept. The
        optimizer state is dropped: load it afterwards, from every old rank's
        :meth:`sharded_state_dict` (:meth:`load_sharded_state_dicts`) or from a
        checkpoint. No communication."""
        self._gather.close()  # gathers of the old group are abandoned, not waited for
        self._groups_fixed = False  # the same groups, laid out again
        self.__init__(self._ddp, self._optimizer_class, self.param_groups,  # type: ignore[misc]
                      **self._optimizer_kwargs)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step this rank's shards, then all-gather the updated parameters.

        With ``overlap_param_gather``, the all-gathers are still in flight when
        this returns; the next forward waits for each bucket before a module
        that uses it runs (call :meth:`finish_param_gather` to read parameters
        before that).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.finish_param_gather()
        shards = self._shards
        pairs = shards.pairs()
        if self._reducer.steps != self._seen_steps:
            # A synchronised backward ran since the last step (otherwise .grad
            # stays as zero_grad left it).
            self._seen_steps = self._reducer.steps
            shards.bind_grads(pairs)
        shards.bind_params()
        self._sync_hyperparams()
        self._optim.step()
        for spec in self._reducer.plan.buckets:
            self._gather.launch(spec.index)
        if not self._gather.overlap:
            self._gather.finish_all()
        return loss

    def fused_stepper(self, reducer: Any) -> ZeroFusedStep:
        """The bucket stepper of ``ddp.fuse_optimizer(self)``: it steps each
        bucket's shard as its reduce-scatter lands. ``reducer`` is the model's,
        which this optimizer was built on."""
        # Note [fused step] in tandem/ddp/fused.py.
        assert reducer is self._reducer, "fuse_optimizer checks that this optimizer is the model's"
        return ZeroFusedStep(self, self._shards, self._gather, reducer)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_groups_fixed", False):
            raise NotImplementedError(
                "ZeroOptimizer cannot add param groups after construction (each rank's shards "
                "are laid out over the groups given then); pass every group to the constructor")
        super().add_param_group(param_group)

    def _sync_hyperparams(self) -> None:
        """Copy hyper-parameters (a scheduler may have changed them) to the wrapped optimizer."""
        for outer, inner in zip(self.param_groups, self._optim.param_groups):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v

    # ------------------------------------------------------------------ gradients
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the model's parameters and of this rank's shards."""
        for p in self._reducer.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_().zero_()
        for master in self._shards.masters:
            if set_to_none:
                master.grad = None
            elif master.grad is not None:
                master.grad.zero_()
        if not set_to_none:
            for shard in self._reducer.grad_shards:
                shard.zero_()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the averaged gradients by their global norm, computed across every
        rank's shard (one all-reduce of a scalar), like
        ``torch.nn.utils.clip_grad_norm_`` over all parameters under plain DDP.
        Call after backward, before :meth:`step`.

        Returns:
            The total norm of the gradients before clipping.
        """
        shards = self._reducer.grad_shards
        device = shards[0].device if shards else torch.device("cpu")
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            local = torch.stack([s.abs().max().float() for s in shards if s.numel()]).max()
            self._comm.all_reduce(local, op=dist.ReduceOp.MAX, tag="grad norm")
            total = local
        else:
            local = torch.stack([torch.linalg.vector_norm(s.float(), norm_type) for s in shards])
            local = local.pow(norm_type).sum().to(device)
            self._comm.all_reduce(local, tag="grad norm")
            total = local.pow(1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"rank {self._comm.rank}: the total norm of order {norm_type} of "
                               "the gradients is non-finite, so it cannot be clipped")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for s in shards:
            s.mul_(coef.to(s.dtype))
        return total

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, *, to: int | None = 0) -> dict[str, Any] | None:  # type: ignore[override]
        """The whole optimizer state in the wrapped torch optimizer's format
        (per-parameter full state tensors keyed by parameter index), consolidated
        from every rank's shard. A collective: call it on every rank.

        Args:
            to: the group rank that receives it; None: every rank.

        Returns:
            The state dict on rank ``to`` (every rank when None), None elsewhere.
        """
        shards = self._comm.all_gather_object(self._local_entries(), tag="optimizer state")
        if to is not None and self._comm.rank != to:
            return None
        return assemble_state(shards, self._groups_for_save(), self._shapes())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state dict in torch's format (from :meth:`state_dict`, from the
        wrapped torch optimizer, or from a run at another world size): each rank
        keeps its own shard of it. Every rank must pass the whole state dict."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError(
                "the state dict's param groups do not match this optimizer's: "
                f"{[len(s['params']) for s in saved_groups]} vs "
                f"{[len(g['params']) for g in self.param_groups]} parameters per group")
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self._sync_hyperparams()
        index = self._param_index()
        state = {int(k): v for k, v in state_dict["state"].items()}
        numels = [p.numel() for p in self._reducer.params]
        self._optim.state.clear()
        for run, master in self._shards.pairs():
            self._shards.copy_params_into(run, master)
            run_state = run_state_from(run, state, index, numels, master.device)
            if run_state is not None:
                self._optim.state[master] = run_state

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state, without communication: save
        one per rank, in parallel (see :meth:`save_sharded`)."""
        return {"format": SHARD_FORMAT, "rank": self._comm.rank, "world_size": self._comm.size,
                "param_groups": self._groups_for_save(), "shapes": self._shapes(),
                "entries": self._local_entries()}

    def param_rows(self) -> list[Entry]:
        """This rank's rows of every parameter (its shard's pieces), copied to the
        host, in the entries' format of :meth:`sharded_state_dict`: with it, what
        puts a replicated model back at the step both were taken (an elastic
        job that goes back a step after losing a rank)."""
        # Note [one step back] in tandem/elastic/buddy.py.
        index, params = self._param_index(), self._reducer.params
        return [(index[piece.param], piece.param_start, piece.length,
                 {"param": params[piece.param].detach().reshape(-1)
                  .narrow(0, piece.param_start, piece.length).cpu().clone()})
                for piece in self._shards.pieces()]

    def load_param_rows(self, per_rank: list[list[Entry]]) -> None:
        """Set every parameter, on this rank, from every old rank's
        :meth:`param_rows` (at any world size); the masters follow at the next
        load or step."""
        state = assemble_state(per_rank, self._groups_for_save(), self._shapes())["state"]
        flat = [p for g in self.param_groups for p in g["params"]]
        missing = [k for k, p in enumerate(flat) if k not in state and p.numel()]
        if missing:
            raise ValueError(f"the parameter rows cover no element of parameter(s) {missing}")
        with torch.no_grad():
            for k, slot in state.items():
                flat[k].copy_(slot["param"].view_as(flat[k]))

    def rows_of_ranks(self) -> list[list[tuple[int, int, int]]]:
        """Each group rank's rows of every parameter this optimizer steps, at the
        group's world size, as ``(state index, start, length)``: what of any
        world's :meth:`sharded_state_dict` entries that rank holds (an elastic
        job cuts the old world's entries to them). No communication."""
        index, world = self._param_index(), self._comm.size
        shards = [shard_bucket(spec, world) for spec in self._reducer.plan.buckets]
        return [[(index[p.param], p.param_start, p.length) for bucket in shards
                 for p in bucket[rank].pieces if p.param in index] for rank in range(world)]

    def load_rank_state(self, entries: list[Entry], param_groups: list[dict[str, Any]],
                        shapes: dict[int, tuple[int, ...]], source: str) -> None:
        """Load this rank's shard of the optimizer state from ``entries`` that hold
        its rows of every parameter with state (cut from another world's
        shards: :meth:`rows_of_ranks`), with
        ``param_groups``' hyper-parameters.

        Raises:
            ValueError: naming ``source``, when the entries were taken with
                parameters of other shapes, or leave a row of this rank without state.
        """
        mine = self._shapes()
        theirs = {int(k): tuple(v) for k, v in shapes.items()}
        if theirs != mine:
            wrong = next(k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k))
            raise ValueError(f"rank {self._comm.rank}: {source}: parameter '{self._param_names().get(wrong)}' "
                             f"(index {wrong}) has shape {theirs.get(wrong)} there, {mine.get(wrong)} here: "
                             "every rank must build the same model")
        have: dict[int, int] = {}
        for idx, _, length, _ in entries:
            have[idx] = have.get(idx, 0) + length
        need: dict[int, int] = {}
        for idx, _, length in self.rows_of_ranks()[self._comm.rank]:
            need[idx] = need.get(idx, 0) + length
        short = [k for k in sorted(have) if have[k] != need.get(k, 0)]
        if short:
            raise ValueError(f"rank {self._comm.rank}: {source}: state for {have[short[0]]} elements of "
                             f"parameter '{self._param_names().get(short[0])}' (index {short[0]}), where this "
                             f"rank's rows hold {need.get(short[0], 0)}")
        self.load_state_dict(assemble_state([entries], param_groups, mine))

    def load_sharded_state_dicts(self, shards: list[dict[str, Any]], *,
                                 sources: list[str] | None = None) -> None:
        """Load the :meth:`sharded_state_dict` of every rank of a run, at any world
        size (the shards are reassembled per parameter, then resharded).

        Args:
            sources: where each shard came from (file names), for the errors.

        Raises:
            ValueError: naming the shard and the parameter or state key, when the
                shards are not one complete save that fits this optimizer.
        """
        sources = sources or [f"shard {i}" for i in range(len(shards))]
        check_shards(shards, sources, self._shapes(), self._param_names(),
                     [len(g["params"]) for g in self.param_groups])
        self.load_state_dict(assemble_state([s["entries"] for s in shards], shards[0]["param_groups"],
                                            shards[0]["shapes"]))

    def save_sharded(self, directory: str | os.PathLike[str], *, step: int | None = None,
                     keep: int | None = None) -> Path:
        """Save every rank's shard, each rank its own file, into the committed step
        directory ``directory/step-{step:08d}/``, committed by a marker written
        last: a save killed midway is never loaded. A collective: call it on
        every rank.

        Args:
            directory: the directory of step directories.
            step: the step saved (default: one more than the newest committed step,
                or 0); every rank must pass the same.
            keep: keep the newest ``keep`` committed steps (None: all).

        Returns:
            The committed step directory.

        Raises:
            tandem.checkpoint.CheckpointError: on every rank, when a rank failed to
                write or the ranks passed different steps.
        """
        # Note [committed step directories] in tandem/checkpoint/commit.py.
        if step is None:
            steps = committed_steps(directory)
            step = steps[-1] + 1 if steps else 0

        def write(step_dir: Path) -> list[str]:
            name = f"zero-shard-{self._comm.rank}-of-{self._comm.size}.pt"
            atomic_save(self.sharded_state_dict(), step_dir / name)
            return [name]

        return save_committed(directory, step, write, kind=_SHARDS_KIND, keep=keep, group=self._comm.group)

    def load_sharded(self, directory: str | os.PathLike[str], *, step: int | None = None) -> int:
        """Load the newest committed shards :meth:`save_sharded` wrote under
        ``directory`` (or ``step``'s), from a run at any world size. A collective.

        Returns:
            The step loaded.

        Raises:
            FileNotFoundError: on every rank, when ``directory`` holds no committed step.
            tandem.checkpoint.CheckpointError: on every rank, naming the file: a
                shard missing, truncated or corrupt.
            ValueError: on every rank, naming the file and the parameter or state
                key: shards that do not fit this optimizer.
        """
        ckpt = load_committed(directory, step=step, kind=_SHARDS_KIND, group=self._comm.group)
        names = sorted(ckpt.files)
        shards: list[dict[str, Any]] = []

        def read_and_check() -> None:
            for name in names:
                shards.append(torch.load(ckpt.path(name), map_location="cpu", weights_only=True))
            try:
                check_shards(shards, [str(ckpt.path(n)) for n in names], self._shapes(), self._param_names(),
                             [len(g["params"]) for g in self.param_groups])
            except ValueError as e:
                raise ValueError(f"rank {self._comm.rank}: {e}") from None

        agree(read_and_check, what=f"reading the shards of {ckpt.directory}", error_type=CheckpointError,
              group=self._comm.group)
        self.load_state_dict(assemble_state([s["entries"] for s in shards], shards[0]["param_groups"],
                                            shards[0]["shapes"]))
        return ckpt.step

    def _param_index(self) -> dict[int, int]:
        """Reducer parameter index -> the torch state-dict index (order of param_groups)."""
        position = {id(p): i for i, p in enumerate(self._reducer.params)}
        flat = [p for g in self.param_groups for p in g["params"]]
        return {position[id(p)]: k for k, p in enumerate(flat)}

    def _param_names(self) -> dict[int, str]:
        """The torch state-dict index -> the parameter's name."""
        return {k: self._reducer.names[i] for i, k in self._param_index().items()}

    def _shapes(self) -> dict[int, tuple[int, ...]]:
        flat = [p for g in self.param_groups for p in g["params"]]
        return {k: tuple(p.shape) for k, p in enumerate(flat)}

    def _groups_for_save(self) -> list[dict[str, Any]]:
        groups, k = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{key: v for key, v in g.items() if key != "params"},
                           "params": list(range(k, k + n))})
            k += n
        return groups

    def _local_entries(self) -> list[Entry]:
        index = self._param_index()
        return [entry for run, master in self._shards.pairs()
                if self._optim.state.get(master)
                for entry in entries_of_run(run, self._optim.state[master], index)]


def _normalise_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    params = list(params)
    if not params:
        raise ValueError("ZeroOptimizer got an empty parameter list")
    if not isinstance(params[0], dict):
        params = [{"params": params}]
    groups = []
    for g in params:
        members = g["params"]
        members = [members] if isinstance(members, torch.Tensor) else list(members)
        groups.append({**g, "params": members})
    return groups


def _group_of_params(groups: list[dict[str, Any]], reducer: Any) -> dict[int, int]:
    position = {id(p): i for i, p in enumerate(reducer.params)}
    group_of: dict[int, int] = {}
    for g, group in enumerate(groups):
        for p in group["params"]:
            i = position.get(id(p))
            if i is None:
                raise ValueError(
                    f"param group {g} holds a tensor of shape {tuple(p.shape)} that is not a "
                    "trainable parameter of the DistributedDataParallel model; pass the "
                    "parameters of ddp_model (with requires_grad=True)")
            if i in group_of:
                raise ValueError(f"parameter '{reducer.names[i]}' appears in more than one param group")
            group_of[i] = g
    return group_of
