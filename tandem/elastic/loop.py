"""``tandem.prepare(..., elastic=...)``: a training loop the user writes keeps
training when a rank dies, and grows back when a replacement joins
(:class:`ElasticOptimizer`, :class:`ElasticLoop`).

# Note [elastic prepare]
The Trainer owns its loop (Note [elastic trainer] in run.py); here the user
owns it, and it keeps its one-process shape::

    for epoch in range(train_loader.epoch, epochs):   # a replacement starts mid-run
        for x, y in train_loader:
            loss_fn(model(x), y).backward()
            optimizer.step()           # commits, or drops the step and regroups
            optimizer.zero_grad()

The pieces are the Trainer's, placed where that loop already calls in:

1. Backward: a peer that dies fails the DDP reduction. The model's failure
   handler (Note [recovered reduction failures] in tandem/ddp/reducer.py) records
   it when :func:`is_peer_failure` says so, and backward returns as if done. A
   fully-sharded model communicates in forward and backward: its handler
   records the first failure, and the step goes on without communication (Note
   [a broken step goes on] in tandem/comm/failure_gate.py).
2. ``optimizer.step()``: with a failure recorded, or when the step's decision
   (Note [elastic membership]) is ``abort``, the update is skipped
   (``optimizer.step_abandoned``), and the survivors regroup at once: a new
   generation, the DDP model's ``reset_process_group``, the loaders split over
   the new world. Otherwise the user's optimizer steps, the step is counted,
   and each loader in an iteration records the positions of its epoch that
   the job has now consumed (``DistributedLoader.commit``).
3. The loaders: an iteration in progress goes on, at its next batch, with the
   positions of its epoch that no committed step consumed, split over the new
   world without padding: the dropped step's samples come again, each once, to
   the new world, and nothing is seen twice (Note [exact split] in
   tandem/data/split.py). The ranks still get the same number of batches (an
   empty one where a rank has no sample left), and in the last one, where
   their sizes differ, each loader tells the model its batch's weight
   (``DistributedLoader.on_weight`` -> ``batch_weight``, Note [batch weight] in
   tandem/ddp/batch_weight.py), so that the step's gradient is the mean loss's
   over the global batch.
4. A replacement (``TANDEM_ELASTIC_JOIN=1``) runs the same script: its
   ``tandem.init()`` puts it in a world of one, where its ``prepare`` builds
   the model and loaders, and then asks to join (Note [a replacement builds
   first] in tandem/control/elastic_group.py). The members admit it after a step
   decided ``grow``, when the loader they train from is asked for its next
   batch (``DistributedLoader.before_batch``): after whatever the loop does
   after ``step()`` (a scheduler's step), at the top of the loop, which is
   where the replacement's loop starts (with no loader in an iteration, at
   the end of ``step()``; a loop that stops without asking for another batch
   leaves the replacement waiting until it sees the members gone). It then
   rebuilds for the new world as the members do in their regroup (agreeing on
   the loaders, DDP's model check), and rank 0 sends the whole state
   (:func:`~tandem.elastic.run.share_state`: model, optimizer, step count,
   each loader's epoch and position, and what the loop registered:
   ``optimizer.register_for_replacements(scheduler)``), so the replacement's
   first iteration starts where the members' goes on. That is why the epoch
   loop above starts at ``train_loader.epoch`` (0 in a job's first world, the
   members' epoch on a replacement).
5. Under ZeRO and fully_shard the loop holds an
   :class:`~tandem.elastic.world.ElasticWorld`, as the Trainer does: buddy
   copies sent after each commit, the shards restored for a new world, and
   one step back (Note [one step back] in buddy.py). Its loop state is the
   loaders' committed positions and the RNG, taken at the commit, and the
   registered objects' states, taken as the next step is decided (the loop
   steps its scheduler after ``step()`` returns); going back sets them, and
   ``step_abandoned`` is True for the step being decided then (or for the one
   whose copies were being sent). There is no checkpoint to fall back to.

# Note [an epoch's last step]
Going back a step must not cross an epoch's end: the loop has left that
epoch's iteration, and its samples could only come again in the next epoch's.
Yet a rank that has sent its copy of the epoch's last step may see its
loaders end the epoch before a peer's death (which takes the job back) is
known. So a loader that yielded a committed step's batch calls
``before_end`` as its iteration is about to end, and under ZeRO and
fully_shard the loop then waits on a barrier of the group: every rank is
past its copies of the last step, or a peer's death is seen here, the world
changes, and when it goes back the loader's iteration goes on with the
step's samples (``DistributedLoader.go_back``). Every rank reaches the end
of an epoch with the others (they get as many batches), so it costs one
barrier per epoch. A change of world in between clears it: the regroup sends
the new world's copies from every rank of it, so nothing is left to confirm,
and a replacement admitted as the loaders are asked for a batch past the
epoch's last (its loop starts at the next epoch's first step) would never
enter the old world's barrier.

Under ``no_sync`` micro-batches nothing is reduced, so nothing fails; the step's
decision covers them all, and a dropped step gives all of its micro-batches
again. What a step consumed is what the loaders yielded before its ``step()``:
a loop that draws the next step's batch early (nanoGPT's prefetch) counts that
batch into the step before, and a drop then loses it. Collectives the loop
issues itself (an all-reduce of the loss for the log, ``gather_for_metrics``)
are not covered: a peer lost there raises. A learning-rate scheduler is the
loop's to step (only when ``not optimizer.step_abandoned``: a dropped step must
not move it) and to register (a replacement's own would start from step 0 and
its learning rates would differ from the members').
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from tandem.checkpoint.full_state import is_fully_sharded
from tandem.checkpoint.rng import capture_rng_state, restore_rng_state
from tandem.checkpoint.state import TrainingState
from tandem.control.elastic_group import elastic_membership
from tandem.control.generation import ElasticConfig, Generation
from tandem.comm.monitor import current_monitor_if_any
from tandem.comm.watched_call import watched
from tandem.data.loader import DistributedLoader
from tandem.ddp.batch_weight import weigh_gradients
from tandem.diloco import DiLoCo
from tandem.elastic.run import ElasticRun, Resumed, WorldChange, first_sentence, is_peer_failure
from tandem.elastic.sync_points import SyncPoints
from tandem.elastic.world import ElasticWorld

__all__ = ["ElasticLoop", "ElasticOptimizer", "make_elastic"]

logger = logging.getLogger(__name__)


def make_elastic(config: ElasticConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loaders: list[DistributedLoader], agree: Callable[[], None]) -> ElasticOptimizer:
    """The optimizer ``prepare`` returns for an elastic job. ``model`` is a DDP
    model (its optimizer the user's or a ZeroOptimizer) or a fully_shard one;
    ``agree`` repeats prepare's agreement on the loaders over the current world
    (a replacement's prepare issues it). A replacement receives the members' state here."""
    loop = ElasticLoop(ElasticRun(elastic_membership(config)), model, optimizer, loaders, agree)
    generation = loop.run.membership.generation
    logger.info("prepare: elastic, member %s is rank %d of %d (generation %d)%s",
                loop.run.membership.member, dist.get_rank(), generation.world_size, generation.number,
                f"; joined, going on with step {loop.state.step + 1}" if loop.joined else "")
    return ElasticOptimizer(optimizer, loop)


class _LoopPoints:
    """A prepared loop's state after a committed step, to go back to with the
    shards (Note [one step back] in buddy.py): the step's loader positions and
    the RNG, taken at the commit, and the registered objects' states, taken when
    the next step is decided: a loop steps its scheduler after ``step()`` returns."""

    def __init__(self, loop: ElasticLoop) -> None:
        self._loop = loop
        self._last: dict[str, Any] | None = None

    def capture(self) -> Any:
        self._last = {"loaders": [loader.committed for loader in self._loop.loaders],
                      "rng": capture_rng_state(), "objects": None}
        return self._last

    def complete(self) -> None:
        """The next step is being decided: what the loop did after the last one is done."""
        if self._last is not None and self._last["objects"] is None:
            self._last["objects"] = [copy.deepcopy(obj.state_dict()) for obj in self._loop.registered]

    def restore(self, point: Any) -> None:
        rank = dist.get_rank()
        for loader, committed in zip(self._loop.loaders, point["loaders"]):
            if loader.active and not loader.go_back(committed):
                logger.warning("rank %d: %r went on to epoch %d, past the step the job went back to (epoch %d): "
                               "that step's samples are not trained again", rank, loader, loader.epoch, committed[0])
        assert point["objects"] is not None, "a step was updated before it was decided"
        for obj, state in zip(self._loop.registered, point["objects"]):
            obj.load_state_dict(state)
        restore_rng_state(point["rng"])


class ElasticLoop:
    """A prepared loop's part in an elastic job: the failure seen in forward or
    backward, the step's decision, and the change of world with what it rebuilds
    (Note [elastic prepare]); under ZeRO and fully_shard, the buddy copies of
    the shards too (held by :class:`~tandem.elastic.world.ElasticWorld`, as the Trainer's are).

    Args:
        run: the decisions and world changes (shared with the Trainer).
        model: the DDP or fully_shard model; its failure handler is set here.
        optimizer: what steps it: the user's, a ZeroOptimizer, or the one
            prepare rebuilt over a fully-sharded model's parameters.
        loaders: the prepared loaders, split again when the world changes.
        agree: prepare's agreement on the loaders, over the current world.
    """

    def __init__(self, run: ElasticRun, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loaders: list[DistributedLoader], agree: Callable[[], None]) -> None:
        self.run = run
        self.model, self.optimizer, self.loaders, self._agree = model, optimizer, list(loaders), agree
        self.state = TrainingState(model=model, optimizer=optimizer)
        self._fsdp = is_fully_sharded(model)
        self._zero = hasattr(optimizer, "sharded_state_dict")  # a tandem.ZeroOptimizer
        self._points = _LoopPoints(self)
        # Note [elastic local steps] in sync_points.py: the bare model of each rank, synced every H steps.
        self.diloco = DiLoCo.of(optimizer)
        self._syncs = (None if self.diloco is None
                       else SyncPoints(self.diloco, optimizer, self.state, self._points))
        self.world = ElasticWorld(run, model, optimizer, self.state, self._points, None,
                                  sharded=self._zero or self._fsdp)
        self.failure: BaseException | None = None  # a peer's failure seen during this step
        self.joined = run.needs_state
        self.registered: list[Any] = []  # objects whose state a replacement receives
        self._grow_at: list[DistributedLoader] = []  # the loaders whose next batch admits replacements
        self._confirm_at: list[DistributedLoader] = []  # Note [an epoch's last step]
        self._received: list[Any] | None = None  # on a replacement: their states, loaded as registered
        self._weight = 1.0
        self._weighs_outputs = not hasattr(model, "batch_weight")  # DDP weighs its outputs itself
        if hasattr(model, "set_failure_handler"):  # a bare model (DiLoCo) communicates in step() only
            cast(Any, model).set_failure_handler(self._record)
        if self._weighs_outputs:
            model.register_forward_hook(self._weigh_outputs)
        for loader in self.loaders:
            loader.before_batch = functools.partial(self._before_batch, loader)
            loader.before_end = functools.partial(self._before_end, loader)
            loader.on_weight = self._weigh  # Note [exact split] in tandem/data/split.py
        if run.needs_state:  # Note [a replacement builds first] in tandem/control/elastic_group.py
            run.join(self._rebuild, self._report)
        else:
            self.world.refresh_buddy(dist.get_rank())  # the first copies, before the first step
            if self._syncs is not None:
                self._syncs.capture()  # the start: every rank holds rank 0's parameters
        self._next_step()

    def _next_step(self) -> None:
        """A step begins: the decision's clock starts, and the ledger's entries carry
        its number, the run's (Note [step numbers] in tandem/comm/ledger.py)."""
        self.run.step_started()
        monitor = current_monitor_if_any()
        if monitor is not None:
            monitor.ledger.loop_step(self.state.step + 1)

    def register(self, obj: Any) -> None:
        """Send ``obj``'s state to every replacement; on a replacement, load the
        state of the object the members registered in the same place."""
        rank = dist.get_rank()
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"rank {rank}: register_for_replacements takes objects with state_dict() and "
                            f"load_state_dict() (a scheduler, an EMA, a GradScaler); got {type(obj).__name__}")
        index = len(self.registered)
        if self._received is not None:
            if index >= len(self._received):
                raise ValueError(
                    f"rank {rank}: this replacement registers a {type(obj).__name__} as object {index}, but "
                    f"the members had registered {len(self._received)} when it joined; register the same "
                    "objects, in the same order, on every rank, before the loop")
            obj.load_state_dict(self._received[index])
        self.registered.append(obj)

    def _record(self, error: BaseException) -> bool:
        """The model's failure handler: claim a peer's failure for :meth:`step`."""
        if not is_peer_failure(error):
            return False
        if self.failure is None:
            logger.warning("rank %d: elastic: a collective failed in step %d (%s); the step is dropped "
                           "at optimizer.step()", dist.get_rank(), self.state.step + 1, first_sentence(error))
            self.failure = error
        return True

    def step(self, update: Callable[[], Any]) -> tuple[bool, Any]:
        """Decide the step with the other members; call ``update()`` (the optimizer's
        step) when it commits. Returns ``(committed, update's result)``."""
        cause = self.failure
        if cause is None:
            try:
                if self.world.buddy is not None or self._syncs is not None:
                    self._points.complete()
                self.world.decide(self.state.step)  # keeps this rank's shard as it is before the update
            except Exception as e:
                if not is_peer_failure(e):
                    raise
                cause = e
        if cause is None:
            try:
                result = update()
            except Exception as e:  # a ZeroOptimizer's parameter all-gather, after the update
                if not is_peer_failure(e):
                    raise
                cause = e
        if cause is not None:
            self.failure = None
            self._change_world(cause, in_step=True)
            self._next_step()
            return False, None
        self.state.step += 1
        for loader in self.loaders:
            loader.commit()
        self._confirm_at = [loader for loader in self.loaders if loader.active]
        if not self._refresh_copies():
            self._next_step()
            return False, result  # the job went back before this step (Note [one step back])
        if self._syncs is not None and not self._syncs.committed():
            self.run.grow_pending = False  # decided again at the next step: admitted right after a sync
        if self.run.grow_pending:
            # Admitted at the training loader's next batch, after what the loop does
            # after step() (the scheduler's step): where a replacement's loop starts.
            self._grow_at = [loader for loader in self.loaders if loader.active]
            if not self._grow_at:  # no loader in an iteration: now
                self._change_world(None, in_step=False)
        self._next_step()
        return True, result

    def _refresh_copies(self) -> bool:
        """Send this rank's shard to its buddy after a commit (Note [buddy copies]);
        a peer lost meanwhile changes the world at once. False when that took the
        job back before the step just committed (Note [one step back])."""
        step = self.state.step
        try:
            self.world.refresh_buddy(dist.get_rank())
        except Exception as e:
            if not is_peer_failure(e):
                raise
            self._change_world(e, in_step=False)
        return self.state.step == step

    def _weigh(self, weight: float) -> None:
        """A loader yields a batch of this weight: the model's next forwards count so
        (Note [batch weight] in tandem/ddp/batch_weight.py)."""
        self._weight = weight
        if not self._weighs_outputs:
            cast(Any, self.model).batch_weight = weight

    def _weigh_outputs(self, module: nn.Module, args: Any, output: Any) -> None:
        """A fully-sharded model's forward: weigh its outputs' gradients as DDP's batch_weight does."""
        if self._weight != 1.0 and torch.is_grad_enabled():
            weigh_gradients(output, self._weight)

    def _before_batch(self, loader: DistributedLoader) -> None:
        """A loader is about to fetch a batch: the step boundary where replacements join."""
        if self.run.grow_pending and loader in self._grow_at:
            self._grow_at = []
            self._change_world(None, in_step=False)
            self._next_step()

    def _before_end(self, loader: DistributedLoader) -> None:
        """A loader's iteration is about to end (Note [an epoch's last step]; with
        local steps, a sync: Note [elastic local steps])."""
        if loader not in self._confirm_at or (self.world.buddy is None and self._syncs is None):
            return
        self._confirm_at = []
        try:
            if self._syncs is not None:
                self._syncs.epoch_end()
            else:
                watched("barrier before an epoch ends", dist.barrier)
        except Exception as e:
            if not is_peer_failure(e):
                raise
            self._change_world(e, in_step=False)
            self._next_step()

    def _change_world(self, cause: BaseException | None, *, in_step: bool) -> None:
        self.run.regroup(cause, self.state.step, in_step=in_step, rebuild=self._rebuild,
                         report=self._report)

    def _rebuild(self, before: Generation, after: Generation) -> Resumed | None:
        """What depends on the world, in the order of a replacement's ``prepare``;
        returns where the shards went back to, if they did."""
        own = self.world.own_shard()  # None without buddy copies, and on a replacement
        rank = dist.get_rank()
        self.failure = None
        self._confirm_at = []  # Note [an epoch's last step]: the new world's copies are sent below
        self.optimizer.zero_grad(set_to_none=True)
        self._agree()  # a replacement's prepare agrees, one whose join was cut short too
        self.world.reset_model()
        resumed = None
        if self.world.buddy is not None:
            if self._zero:
                cast(Any, self.optimizer).reset_process_group()
            resumed = self.world.restore_shards(own, rank)  # no checkpoint to fall back to
        if self._syncs is not None:  # Note [elastic local steps]
            resumed = self._syncs.regroup(has_state=not self.run.needs_state)
        wanting = self.run.ranks_wanting_state()  # Note [a join cut short] in tandem/elastic/run.py
        if wanting:
            self._share_state(wanting)
        for loader in self.loaders:
            loader.regroup(dist.get_world_size(), rank)
        self.world.changed(rank)  # the new world's copies (a loop of its own locates a grow's shards)
        if self._syncs is not None:
            self._syncs.capture()  # every rank at the sync: the new world's first point
        self.run.needs_state = False  # only now: Note [a join cut short] in tandem/elastic/run.py
        return resumed

    def _share_state(self, wanting: list[int]) -> None:
        """Rank 0's state on the ranks ``wanting`` it, the loaders' positions with
        it; a replacement takes them up. Under ZeRO and fully_shard the shards are in
        place already, and rank 0 sends the rest (``ElasticWorld.share_state``)."""
        self.state.extra = {"loaders": [loader.position() for loader in self.loaders],
                            "objects": [obj.state_dict() for obj in self.registered],
                            "diloco": None if self.diloco is None else self.diloco.state_dict()}
        self.world.share_state(wanting)
        if self.run.needs_state:
            if self.diloco is not None:
                self.diloco.load_state_dict(self.state.extra["diloco"])
            for loader, (epoch, start) in zip(self.loaders, self.state.extra["loaders"]):
                # Mid-epoch the members split the rest exactly (DistributedLoader.regroup): so does this rank.
                loader.set_epoch(epoch, start, exact=start > 0)
            self._received = self.state.extra["objects"]

    def _report(self, change: WorldChange) -> None:
        """Log the change, and print it on the new world's rank 0 (the Trainer's
        progress prints it there too): a loop the user writes may configure no
        logging, and a world change must not pass unseen."""
        logger.warning("rank %d: %s", dist.get_rank(), change.describe())
        if dist.get_rank() == 0:
            print(f"tandem: {change.describe()}", file=sys.stderr, flush=True)


class ElasticOptimizer(torch.optim.Optimizer):
    """The optimizer ``prepare(elastic=...)`` returns: the user's, whose
    :meth:`step` first agrees with the other ranks (Note [elastic prepare]).

    It stands for the user's optimizer, as Accelerate's ``AcceleratedOptimizer``
    does: ``param_groups``, ``state``, ``defaults``, ``state_dict()`` and
    ``load_state_dict()`` are the user's, so a learning-rate scheduler built on
    it moves the user's learning rates.

    Warning:
        A dropped step does not move the user's optimizer, but a
        scheduler stepped every iteration still moves: step it only when
        ``not optimizer.step_abandoned``, and register it with
        :meth:`register_for_replacements` so that a replacement's agrees::

            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
            optimizer.register_for_replacements(scheduler)
            ...
            optimizer.step()
            if not optimizer.step_abandoned:
                scheduler.step()

    Attributes:
        optimizer: the user's optimizer.
        step_abandoned: whether the last :meth:`step` dropped its step, because
            a rank died; the loaders give its samples again, to the new world.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, loop: ElasticLoop) -> None:
        # No Optimizer.__init__: this is a view of the user's optimizer, which holds the state.
        self.optimizer = optimizer
        self._loop = loop
        self.step_abandoned = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @property
    def steps_taken(self) -> int:
        """Steps committed by the job (a replacement's count starts at the members')."""
        return self._loop.state.step

    @property
    def world_changes(self) -> list[WorldChange]:
        """Every change of the job's world this rank went through, oldest first."""
        return list(self._loop.run.changes)

    def register_for_replacements(self, *objects: Any) -> None:
        """Send these objects' state (``state_dict()``) to every replacement that
        joins, as the model's and this optimizer's are: a learning-rate
        scheduler, an EMA, a GradScaler. Call it on every rank, with the same
        objects in the same order, before the loop; on a replacement it loads
        what the members' objects held when it joined.

        Raises:
            TypeError: an object has no ``state_dict``/``load_state_dict``.
            ValueError: on a replacement, more objects than the members registered.
        """
        for obj in objects:
            self._loop.register(obj)

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        """The user's optimizer's step, when every rank finished this step's
        reduction; else nothing moves, :attr:`step_abandoned` is True, and the
        job goes on in a new world before this returns (Note [elastic prepare]).

        Raises:
            ValueError: a ``closure`` was given (it would run forward and
                backward again inside the step's decision).
            tandem.control.generation.MembershipError: too few ranks are left
                (``ElasticConfig.min_world_size``), or the regroup timed out.
        """
        if closure is not None:
            raise ValueError(f"rank {dist.get_rank()}: an elastic prepared optimizer's step() takes no "
                             "closure; run forward and backward in the loop and call step()")
        committed, result = self._loop.step(self.optimizer.step)
        self.step_abandoned = not committed
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """The user's optimizer's hook: it runs when a step commits, not when one is dropped."""
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        """The user's optimizer's hook: it runs when a step commits, not when one is dropped."""
        return self.optimizer.register_step_post_hook(hook)

    def __repr__(self) -> str:
        return f"ElasticOptimizer({self.optimizer!r})"
