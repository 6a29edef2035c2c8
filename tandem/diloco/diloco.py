"""Training over a slow link: local steps and an outer step, :class:`DiLoCo`.

# Note [local steps and the outer step]
DDP sends every gradient every step. DiLoCo (Douillard et al., arXiv
2311.08105) lets each rank take ``H`` steps of its own optimizer (the inner
one) on its own data, sending nothing, and then syncs: each rank's
pseudo-gradient, the synced parameters of the last sync less its local ones,
is averaged across the ranks, and an outer optimizer (Nesterov SGD) steps the
synced parameters with it; every rank then continues from the result. The
link carries one model's worth every ``H`` steps instead of every step.

- LocalSGD is the special case of an outer SGD at lr 1 without momentum: the
  new parameters are the ranks' average (:meth:`DiLoCoConfig.local_sgd`).
- With ``H = 1``, that outer SGD at lr 1 and a plain SGD inner optimizer, the
  pseudo-gradient is ``lr`` times the local gradient and the step is DDP's:
  tests/diloco/test_diloco.py holds DiLoCo to DDP, and to one process
  simulating the ranks, on that identity and others.
- Streaming DiLoCo (arXiv 2501.18512) syncs the model in fragments, each at
  its own step of the ``H`` (Note [fragments and their schedule] in
  fragments.py), and may let a fragment's average travel beside ``overlap``
  inner steps before it is applied, mixing ``mix`` of the local parameters
  into the result. With one fragment, no overlap and no mix it is DiLoCo.
- The pseudo-gradients may travel in int8 or int4 blocks with error feedback
  (``quantize``; Note [a quantized average] in tandem/quantized/average.py).

# Note [DiLoCo across nodes, fully_shard inside]
Over a slow link between nodes and a fast one inside each, a node can be one
worker: its ranks shard the model with ``fully_shard`` over the node alone
(``mesh["local"]`` of :func:`tandem.comm.node_groups.node_mesh`), so every
inner step's all-gathers and reduce-scatters stay inside it, and the nodes
sync every ``H`` steps. The rank at a given place on each node holds the same
shard of every parameter (the same local shapes, the same rows), so the outer
step runs on each rank's local shards, averaged with the ranks at its place on
the other nodes (``mesh["node"]``): each rank sends its shard, a node sends one
model, and the synced copy and the outer momentum are sharded too. With H=1
and an outer SGD at lr 1 it is HSDP (tests/diloco/test_across_nodes.py
holds it to torch's). ``tandem.prepare(..., strategy="fsdp", diloco=...)``
builds it, and so does the Trainer with ``TrainerConfig(diloco=...)`` and a
model sharded over ``tandem.node_mesh()["local"]``; by hand, it is
``fully_shard(model, mesh=mesh["local"])`` and ``DiLoCo(model, optimizer,
config, comm=GroupComm(mesh["node"].get_group()))``. Per-rank checkpoints
copy each shard out of its unit's buffer to write it.

What it costs: the synced copy of the parameters (fp32) and the outer
optimizer's momentum, two copies of the model per rank, as the paper's. Every
rank must step its inner optimizer the same number of times. The model's
buffers (BatchNorm's statistics) stay each rank's own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.comm.group import GroupComm
from tandem.comm.node_groups import NodeGroups
from tandem.diloco.config import DiLoCoConfig
from tandem.diloco.fragment_sync import FragmentSync
from tandem.diloco.fragments import fragments_due, plan_fragments
from tandem.dtensor import local_tensor

__all__ = ["DiLoCo"]


# Note [local steps and the outer step] at the top of this file.
class DiLoCo:
    """Local steps of ``optimizer`` on ``model``, synced by an outer step every
    ``config.sync_every`` of them: the ranks average their pseudo-gradients
    (the parameters of the last sync less their own), and an outer optimizer
    steps the synced parameters with that average.

    Build it after the model and its optimizer, on every rank; the model is not
    wrapped (no DDP: each rank trains its own copy between syncs), and the
    ranks start from rank 0's parameters. The syncs happen in the optimizer's
    ``step()``, through a hook: the training loop stays as it is.

    Args:
        model: the model, the same architecture on every rank.
        optimizer: the inner optimizer, stepping ``model``'s parameters.
        config: when and how to sync (default: DiLoCo's settings, H=100).
        comm: the ranks that sync (default: the world).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 config: DiLoCoConfig | None = None, *, comm: GroupComm | None = None) -> None:
        self.config = config if config is not None else DiLoCoConfig()
        self.comm = comm if comm is not None else GroupComm(None)
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"rank {self.comm.rank}: DiLoCo: the model has no parameter that requires grad")
        with torch.no_grad():
            self.comm.broadcast_coalesced([local_tensor(p).detach() for p in params], 0, tag="diloco start")
        groups = plan_fragments([local_tensor(p).numel() for p in params], self.config.fragments)
        # Note [ranks by node] in tandem/comm/node_groups.py: quantized, inside each node first.
        node_groups = NodeGroups.build(self.comm) if self.config.quantize else None
        self.fragments = [FragmentSync(i, [params[j] for j in g], self.comm, self.config, node_groups)
                          for i, g in enumerate(groups)]
        self.step = 0
        """Inner steps taken."""
        self.synced_at = 0
        """The inner step of the last sync of the whole model (one fragment, no
        overlap): where an elastic job goes back to when a rank is lost."""
        self._due: dict[int, int] = {}  # a fragment in flight -> the step it is applied at
        self._hook = optimizer.register_step_post_hook(self._after_inner_step)

    @staticmethod
    def of(optimizer: torch.optim.Optimizer) -> DiLoCo | None:
        """The DiLoCo that syncs after ``optimizer``'s steps (the one
        ``tandem.prepare(..., diloco=...)`` built), or None: to save its
        :meth:`state_dict` with a checkpoint, or :meth:`flush` it at the end."""
        for hook in getattr(optimizer, "_optimizer_step_post_hooks", {}).values():
            owner = getattr(hook, "__self__", None)
            if isinstance(owner, DiLoCo):
                return owner
        inner = getattr(optimizer, "optimizer", None)  # an elastic job's ElasticOptimizer stands for it
        return DiLoCo.of(inner) if isinstance(inner, torch.optim.Optimizer) else None

    def _after_inner_step(self, *_: Any) -> None:
        self.step += 1
        for f, due in sorted(self._due.items()):
            if due == self.step:
                del self._due[f]
                self.fragments[f].finish()
        cfg = self.config
        for f in fragments_due(self.step, cfg.sync_every, cfg.fragments):
            self.fragments[f].start()
            if cfg.overlap:
                self._due[f] = self.step + cfg.overlap
            else:
                self.fragments[f].finish()
        if cfg.whole and self.step % cfg.sync_every == 0:
            self.synced_at = self.step

    def sync_now(self) -> None:
        """Sync the whole model now, outside the schedule (an elastic job does at
        an epoch's end); nothing if it was synced at this step. Only for
        :attr:`DiLoCoConfig.whole` syncs."""
        if not self.config.whole:
            raise ValueError(f"rank {self.comm.rank}: DiLoCo.sync_now() syncs the whole model at once: it needs "
                             "fragments=1, overlap=0 and mix=0")
        if self.synced_at != self.step:
            self.fragments[0].start()
            self.fragments[0].finish()
            self.synced_at = self.step

    def take_synced(self) -> None:
        """Set every parameter to its synced value (the state of the last sync)."""
        for f in self.fragments:
            f.take_synced()

    def reset_process_group(self, comm: GroupComm) -> None:
        """Sync over ``comm`` from now on (a new world: every rank of it calls
        this); a sync in flight is dropped."""
        self.comm = comm
        node_groups = NodeGroups.build(comm) if self.config.quantize else None
        for f in self.fragments:
            f.reset_process_group(comm, node_groups)
        self._due.clear()

    def flush(self) -> None:
        """Apply the fragments still in flight now (at the end of training)."""
        for f in sorted(self._due):
            self.fragments[f].finish()
        self._due.clear()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to go on as if never stopped: the step, each
        fragment's synced parameters, outer optimizer and residual, and the
        syncs in flight (their averages waited for, to be applied at their step;
        every rank must call it at the same step)."""
        return {"step": self.step, "synced_at": self.synced_at, "due": dict(self._due),
                "fragments": [f.state_dict() for f in self.fragments]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["fragments"]) != len(self.fragments):
            raise ValueError(f"rank {self.comm.rank}: DiLoCo state of {len(state['fragments'])} fragments, "
                             f"this one has {len(self.fragments)}: build it with the same DiLoCoConfig.fragments")
        self.step = int(state["step"])
        self.synced_at = int(state.get("synced_at", 0))
        self._due = {int(f): int(due) for f, due in state.get("due", {}).items()}
        for f, saved in zip(self.fragments, state["fragments"]):
            f.load_state_dict(saved)

    def remove(self) -> None:
        """Stop syncing: the optimizer's hook removed, syncs in flight applied."""
        self.flush()
        self._hook.remove()
