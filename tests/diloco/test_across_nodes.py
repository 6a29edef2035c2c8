"""DiLoCo in ``tandem.prepare(..., diloco=...)`` and in the Trainer, across
nodes with fully_shard inside each, on four gloo ranks as two nodes of two
(``GROUP_RANK``, as the launcher sets it), in one spawned group.

Identities that can fail:
- With H=1 and an outer SGD at lr 1 without momentum, local steps are DDP
  (SGD with momentum is linear in the gradients, so the average of the ranks'
  steps is the step of the average): ``strategy="ddp"`` (each rank alone) and
  ``strategy="fsdp"`` (sharded inside each node, the nodes synced: Note
  [DiLoCo across nodes, fully_shard inside] in tandem/diloco/diloco.py) both
  equal one process on the global batch, and torch's own HSDP over the same
  two dimensions.
- LocalSGD with H=3 equals one process simulating the workers, written here:
  four under ``"ddp"``, two under ``"fsdp"`` (a node is one worker, training
  on its ranks' samples); in the Trainer with a model sharded over
  ``tandem.node_mesh()["local"]`` too, and a run stopped between two syncs
  resumes from its per-rank checkpoint (sharded tensors) to the same end.
- Bad input raises on every rank, naming the value and the fix.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tandem.testing import run_distributed

WORLD = 4
PER_NODE = 2
SEED = 5
N_TRAIN = 56  # 7 steps an epoch of 4 x 2 samples: two epochs end two steps after a sync of H=3
BATCH = 2
EPOCHS = 2
H = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))  # 8 and 3 rows: uneven shards


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups: list[dict[str, Any]] = [{"params": weights}, {"params": biases, "lr": 0.05}]
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def _train_set() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(N_TRAIN, 5, generator=g), torch.randn(N_TRAIN, 3, generator=g))


def _full_params(model: nn.Module) -> list[torch.Tensor]:
    return [(v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for v in model.state_dict().values()]


def _config(sync_every: int) -> Any:
    from tandem.diloco import DiLoCoConfig

    return DiLoCoConfig.local_sgd(sync_every)


def _prepared(strategy: str, sync_every: int) -> dict[str, Any]:
    import tandem
    from tandem.diloco import DiLoCo

    model = _model()
    optimizer = _optimizer(model)
    loader = DataLoader(_train_set(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(SEED))
    wrapped, stepped, prepared = tandem.prepare(model, optimizer, loader, strategy=strategy,
                                                diloco=_config(sync_every))
    diloco = DiLoCo.of(stepped)
    assert diloco is not None
    for _ in range(EPOCHS):
        for x, y in prepared:
            nn.functional.mse_loss(wrapped(x), y).backward()
            stepped.step()
            stepped.zero_grad()
    diloco.flush()
    return {"params": _full_params(wrapped), "wrapped": type(wrapped).__name__, "steps": diloco.step,
            "same optimizer": stepped is optimizer, "sync ranks": diloco.comm.members}


def _torch_hsdp(rank: int) -> list[torch.Tensor]:
    """torch's fully_shard over (replicate=node, shard=the node's ranks), by hand."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data.distributed import DistributedSampler

    mesh = init_device_mesh("cpu", (WORLD // PER_NODE, PER_NODE), mesh_dim_names=("replicate", "shard"))
    model = _model()
    fully_shard(model, mesh=mesh)
    optimizer = _optimizer(model)
    data = _train_set()
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(data, shuffle=True, seed=SEED)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=BATCH, sampler=sampler):
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return _full_params(model)


def _trained(out: str, sync_every: int, max_steps: int | None = None) -> list[torch.Tensor]:
    """The Trainer, the model sharded over this rank's node."""
    import tandem

    model = _model()
    tandem.fully_shard(model, mesh=tandem.node_mesh("cpu")["local"])
    config = tandem.TrainerConfig(batch_size=BATCH, epochs=EPOCHS, seed=SEED, progress=False, plot=False,
                                  output_dir=out, max_steps=max_steps, straggler_every=None,
                                  diloco=_config(sync_every))
    tandem.Trainer(model, _optimizer(model), _train_set(), nn.functional.mse_loss, config=config).fit()
    return _full_params(model)


def _sharded_over_the_world(rank: int) -> str:
    import tandem

    model = _model()
    tandem.fully_shard(model)
    try:
        tandem.Trainer(model, _optimizer(model), _train_set(), nn.functional.mse_loss,
                       config=tandem.TrainerConfig(diloco=_config(2), progress=False, plot=False))
    except ValueError as e:
        return str(e)
    return "built"


def _errors(rank: int) -> dict[str, str]:
    import tandem
    from tandem.diloco import DiLoCoConfig

    out = {}
    cases = {"zero1": dict(strategy="zero1"), "elastic": dict(elastic=True, strategy="fsdp"),
             "mesh": dict(strategy="fsdp", wrapper_kwargs={"mesh": None}),
             "ddp kwargs": dict(wrapper_kwargs={"bucket_cap_mb": 1})}
    for name, kwargs in cases.items():
        model = _model()
        try:
            tandem.prepare(model, _optimizer(model), diloco=DiLoCoConfig(sync_every=2), **kwargs)  # type: ignore[arg-type]
        except (ValueError, TypeError) as e:
            out[name] = str(e)
    os.environ["GROUP_RANK"] = "0"  # one node of four
    model = _model()
    try:
        tandem.prepare(model, _optimizer(model), strategy="fsdp", diloco=DiLoCoConfig(sync_every=2))
    except ValueError as e:
        out["one node"] = str(e)
    return out


def _all(rank: int, world_size: int) -> dict[str, Any]:
    os.environ["GROUP_RANK"] = str(rank // PER_NODE)
    out: dict[str, Any] = {f"{s} H={h}": _prepared(s, h) for s in ("ddp", "fsdp") for h in (1, H)}
    out["torch HSDP"] = _torch_hsdp(rank)
    tmp = _shared_tmp(rank)
    out["trainer H=1"] = _trained(f"{tmp}/h1", 1)
    out["trainer H=3"] = _trained(f"{tmp}/h3", H)
    _trained(f"{tmp}/parted", H, max_steps=5)  # two steps past the sync of step 3
    out["trainer H=3 resumed"] = _trained(f"{tmp}/parted", H)
    out["trainer world mesh"] = _sharded_over_the_world(rank)
    out["errors"] = _errors(rank)
    return out


def _shared_tmp(rank: int) -> str:
    """One new directory, the same on every rank (rank 0's, broadcast)."""
    import tempfile

    import torch.distributed as dist

    box = [tempfile.mkdtemp(prefix="diloco-nodes-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


@functools.cache
def _results() -> list[dict[str, Any]]:
    return run_distributed(_all, WORLD, timeout=240)


def _simulate(workers: list[list[int]], sync_every: int) -> list[list[torch.Tensor]]:
    """One process: each worker trains on its ranks' samples of each global batch
    (a rank's are the positions of its number modulo WORLD, as torch's
    DistributedSampler deals them), and every ``sync_every`` steps all workers
    take the average of their parameters (LocalSGD), from this file alone."""
    models = [_model() for _ in workers]
    optimizers = [_optimizer(m) for m in models]
    x, y = _train_set().tensors
    global_batch = WORLD * BATCH
    step = 0
    for epoch in range(EPOCHS):
        order = torch.randperm(N_TRAIN, generator=torch.Generator().manual_seed(SEED + epoch))
        for start in range(0, N_TRAIN, global_batch):
            window = order[start:start + global_batch]
            for ranks, model, opt in zip(workers, models, optimizers):
                idx = torch.stack([window[p] for p in range(global_batch) if p % WORLD in ranks])
                nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
                opt.step()
                opt.zero_grad()
            step += 1
            if step % sync_every == 0:
                with torch.no_grad():
                    for ps in zip(*(m.parameters() for m in models)):
                        mean = torch.stack([p.detach() for p in ps]).mean(0)
                        for p in ps:
                            p.copy_(mean)
    return [[t.detach().clone() for t in m.state_dict().values()] for m in models]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=0, atol=2e-6)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_h1_is_one_process_on_the_global_batch_and_torchs_hsdp(strategy: str) -> None:
    one = _simulate([list(range(WORLD))], sync_every=1)[0]
    for r in _results():
        _close(r[f"{strategy} H=1"]["params"], one)
        _close(r[f"{strategy} H=1"]["params"], r["torch HSDP"])
        assert r[f"{strategy} H=1"]["steps"] == EPOCHS * N_TRAIN // (WORLD * BATCH)


def test_local_sgd_under_ddp_is_four_workers() -> None:
    expected = _simulate([[r] for r in range(WORLD)], sync_every=H)
    for rank, r in enumerate(_results()):
        _close(r[f"ddp H={H}"]["params"], expected[rank])
        assert r[f"ddp H={H}"]["wrapped"] == "Sequential" and r[f"ddp H={H}"]["same optimizer"]
        assert r[f"ddp H={H}"]["sync ranks"] == list(range(WORLD))
    assert not torch.equal(expected[0][0], expected[1][0])  # the last steps were local: the ranks differ


def test_local_sgd_under_fsdp_is_one_worker_a_node() -> None:
    nodes = [list(range(n * PER_NODE, (n + 1) * PER_NODE)) for n in range(WORLD // PER_NODE)]
    expected = _simulate(nodes, sync_every=H)
    for rank, r in enumerate(_results()):
        _close(r[f"fsdp H={H}"]["params"], expected[rank // PER_NODE])
        assert r[f"fsdp H={H}"]["wrapped"].startswith("FSDP")
        # The sync is between the ranks at the same place on each node.
        assert r[f"fsdp H={H}"]["sync ranks"] == [rank % PER_NODE + n * PER_NODE for n in range(len(nodes))]
    assert not torch.equal(expected[0][0], expected[1][0])


def test_bad_input_is_named_on_every_rank() -> None:
    for rank, r in enumerate(_results()):
        e = r["errors"]
        assert f"rank {rank}" in e["zero1"] and "strategy='zero1'" in e["zero1"] and "'ddp'" in e["zero1"]
        assert "in an elastic job goes back to the last sync" in e["elastic"]
        assert "strategy='fully_shard'" in e["elastic"]
        assert "wrapper_kwargs['mesh']" in e["mesh"]
        assert "bucket_cap_mb" in e["ddp kwargs"] and "drop them" in e["ddp kwargs"]
        assert "at least 2 nodes" in e["one node"] and "{'0': [0, 1, 2, 3]}" in e["one node"], e["one node"]
        assert "strategy='ddp'" in e["one node"]


def test_the_trainer_with_fully_shard_inside_each_node() -> None:
    one = _simulate([list(range(WORLD))], sync_every=1)[0]
    nodes = [list(range(n * PER_NODE, (n + 1) * PER_NODE)) for n in range(WORLD // PER_NODE)]
    expected = _simulate(nodes, sync_every=H)
    for rank, r in enumerate(_results()):
        _close(r["trainer H=1"], one)
        _close(r["trainer H=3"], expected[rank // PER_NODE])
        for a, b in zip(r["trainer H=3 resumed"], r["trainer H=3"]):
            assert torch.equal(a, b)
        said = r["trainer world mesh"]
        assert f"rank {rank}" in said and "node_mesh('cpu')['local']" in said, said
        assert f"{nodes[rank // PER_NODE]}, not [0, 1, 2, 3]" in said, said
