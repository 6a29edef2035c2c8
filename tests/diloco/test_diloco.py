"""DiLoCo, LocalSGD and Streaming DiLoCo (Note [local steps and the outer
step] in tandem/diloco/diloco.py) on three gloo ranks, in one spawned group.

Identities that can fail:
- DiLoCo with H=1, an outer SGD at lr 1 without momentum and a plain SGD
  inner optimizer is DDP: equal to tandem's DDP, to torch's, and to one
  process on the global batch.
- LocalSGD, DiLoCo (Nesterov outer, AdamW inner), Streaming DiLoCo (two
  fragments; two fragments with one step of overlap and a mix of 0.5) each
  equal one process simulating the three workers, written here from the
  papers' algorithms and not from tandem's code.
- int8 pseudo-gradients stay within the quantization's bound of fp32's.
- A checkpoint taken with a sync in flight resumes to the uninterrupted run.
- The bytes: 1/H of DDP's per step.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from tandem.diloco.fragments import fragments_due, plan_fragments
from tandem.testing import run_distributed

WORLD = 3
PER_RANK = 4
STEPS = 13  # ends one step after a sync: the ranks differ


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(step: int, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (WORLD x PER_RANK samples), or rank ``rank``'s part of it."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(WORLD * PER_RANK, 8, generator=g), torch.randn(WORLD * PER_RANK, 1, generator=g)
    if rank is None:
        return x, y
    return x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]


def _sgd(params):  # noqa: ANN001, ANN202
    return torch.optim.SGD(params, lr=0.1)


def _sgd_momentum(params):  # noqa: ANN001, ANN202
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _adamw(params):  # noqa: ANN001, ANN202
    return torch.optim.AdamW(params, lr=1e-2)


# name: (DiLoCoConfig keywords, the inner optimizer)
CASES = {
    "H=1 is DDP": (dict(sync_every=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False), _sgd),
    "LocalSGD H=4": ("local_sgd", _sgd_momentum),
    "DiLoCo H=4": (dict(sync_every=4), _adamw),
    "Streaming, 2 fragments": (dict(sync_every=4, fragments=2), _adamw),
    "Streaming, overlap 1, mix 0.5": (dict(sync_every=4, fragments=2, overlap=1, mix=0.5), _adamw),
}


def _config(keywords):  # noqa: ANN001, ANN202
    from tandem.diloco import DiLoCoConfig

    return DiLoCoConfig.local_sgd(4) if keywords == "local_sgd" else DiLoCoConfig(**keywords)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _train(rank: int, keywords, inner, steps: int = STEPS, stop_at: int | None = None,  # noqa: ANN001
           resume: dict | None = None) -> dict:
    from tandem.diloco import DiLoCo

    model = _model()
    if rank:
        with torch.no_grad():  # the ranks start apart: DiLoCo starts them from rank 0's
            for p in model.parameters():
                p.add_(0.1 * rank)
    opt = inner(model.parameters())
    diloco = DiLoCo(model, opt, _config(keywords))
    start = 0
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["opt"])
        diloco.load_state_dict(resume["diloco"])
        start = diloco.step
    for step in range(start + 1, steps + 1):
        x, y = _batch(step, rank)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if step == stop_at:
            return {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                    "diloco": copy.deepcopy(diloco.state_dict())}
    diloco.flush()
    return {"params": _params(model), "fragments": [[p is q for q in model.parameters()].index(True)
                                                     for f in diloco.fragments for p in f.params]}


def _simulate(keywords, inner, steps: int = STEPS) -> list[list[torch.Tensor]]:  # noqa: ANN001
    """One process, three workers: the papers' algorithm, from this file alone."""
    cfg = _config(keywords)
    workers = [_model() for _ in range(WORLD)]
    inners = [inner(w.parameters()) for w in workers]
    synced = [nn.Parameter(p.detach().clone()) for p in workers[0].parameters()]
    outer = torch.optim.SGD(synced, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.nesterov)
    sizes = [p.numel() for p in synced]
    # Fragments: consecutive parameters, about equal in size (here by hand: [w1] and [b1, w2, b2]).
    frags = [list(range(len(sizes)))] if cfg.fragments == 1 else [[0], [1, 2, 3]]
    assert frags == plan_fragments(sizes, cfg.fragments)
    in_flight: dict[int, tuple[int, list[torch.Tensor]]] = {}

    def apply(f: int, deltas: list[torch.Tensor]) -> None:
        for i, d in zip(frags[f], deltas):
            synced[i].grad = d
        outer.step()
        outer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for w in workers:
                for i in frags[f]:
                    local = list(w.parameters())[i]
                    local.copy_(cfg.mix * local + (1 - cfg.mix) * synced[i])

    for step in range(1, steps + 1):
        for k, (w, o) in enumerate(zip(workers, inners)):
            x, y = _batch(step, k)
            o.zero_grad(set_to_none=True)
            nn.functional.mse_loss(w(x), y).backward()
            o.step()
        for f, (due, deltas) in sorted(in_flight.items()):
            if due == step:
                del in_flight[f]
                apply(f, deltas)
        for f in range(cfg.fragments):
            if step % cfg.sync_every != ((f + 1) * cfg.sync_every // cfg.fragments) % cfg.sync_every:
                continue
            deltas = [torch.stack([synced[i].detach() - list(w.parameters())[i].detach() for w in workers]).mean(0)
                      for i in frags[f]]
            if cfg.overlap:
                in_flight[f] = (step + cfg.overlap, deltas)
            else:
                apply(f, deltas)
    for f, (_, deltas) in sorted(in_flight.items()):
        apply(f, deltas)
    return [_params(w) for w in workers]


def _ddp(rank: int, wrapper: str) -> list[torch.Tensor]:
    import tandem

    model = _model()
    ddp = tandem.DistributedDataParallel(model) if wrapper == "tandem" else \
        torch.nn.parallel.DistributedDataParallel(model)
    opt = _sgd(ddp.parameters())
    for step in range(1, STEPS + 1):
        x, y = _batch(step, rank)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return _params(model)


def _bytes(rank: int) -> dict[str, float]:
    import tandem
    from tandem.comm.monitor import current_monitor
    from tandem.diloco import DiLoCo, DiLoCoConfig

    ledger = current_monitor().ledger
    out = {}
    for name in ("ddp", "diloco"):
        model = _model()
        wrapped = tandem.DistributedDataParallel(model) if name == "ddp" else model
        opt = _sgd(wrapped.parameters())
        if name == "diloco":
            DiLoCo(model, opt, DiLoCoConfig(sync_every=4))
        before = ledger.bytes_issued
        for step in range(1, 9):
            x, y = _batch(step, rank)
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(wrapped(x), y).backward()
            opt.step()
        out[name] = (ledger.bytes_issued - before) / 8
    out["numel"] = sum(p.numel() for p in _model().parameters())
    return out


def _quantized(rank: int) -> dict:
    keywords = dict(sync_every=4, quantize=8)
    return {"int8": _train(rank, keywords, _adamw, steps=4)["params"],
            "fp32": _train(rank, dict(sync_every=4), _adamw, steps=4)["params"]}


def _all(rank: int, world_size: int) -> dict:
    out: dict = {name: _train(rank, *case) for name, case in CASES.items()}
    out["tandem DDP"] = _ddp(rank, "tandem")
    out["torch DDP"] = _ddp(rank, "torch")
    keywords, inner = CASES["Streaming, overlap 1, mix 0.5"]
    saved = _train(rank, keywords, inner, stop_at=5)  # nothing in flight after step 5
    out["resumed"] = _train(rank, keywords, inner, resume=saved)["params"]
    saved = _train(rank, keywords, inner, stop_at=4)  # fragment 1 started at step 4, applied at 5
    out["resumed in flight"] = _train(rank, keywords, inner, resume=saved)["params"]
    out["bytes"] = _bytes(rank)
    out["quantized"] = _quantized(rank)
    return out


@functools.cache
def _results() -> list[dict]:
    return run_distributed(_all, WORLD, timeout=240)


def _close(a: list[torch.Tensor], b: list[torch.Tensor], atol: float = 2e-6) -> None:
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


def test_h1_with_outer_sgd_at_lr_1_is_ddp_and_one_process_on_the_global_batch() -> None:
    model = _model()
    opt = _sgd(model.parameters())
    for step in range(1, STEPS + 1):
        x, y = _batch(step)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    one = _params(model)
    for r in _results():
        _close(r["H=1 is DDP"]["params"], r["tandem DDP"])
        _close(r["H=1 is DDP"]["params"], r["torch DDP"])
        _close(r["H=1 is DDP"]["params"], one)


@pytest.mark.parametrize("name", [n for n in CASES if n != "H=1 is DDP"])
def test_equals_one_process_simulating_the_workers(name: str) -> None:
    expected = _simulate(*CASES[name])
    for rank, r in enumerate(_results()):
        _close(r[name]["params"], expected[rank])
    # The ranks differ between syncs (none of these is DDP): the test compares rank by rank.
    assert not torch.equal(expected[0][0], expected[1][0])


def test_the_fragments_and_their_schedule() -> None:
    assert _results()[0]["Streaming, 2 fragments"]["fragments"] == [0, 1, 2, 3]
    assert [t for t in range(1, 13) if fragments_due(t, 4, 2)] == [2, 4, 6, 8, 10, 12]
    assert [fragments_due(t, 4, 2) for t in (2, 4)] == [[0], [1]]
    assert [t for t in range(1, 13) if fragments_due(t, 4, 1)] == [4, 8, 12]


def test_a_checkpoint_with_a_sync_in_flight_resumes_to_the_uninterrupted_run() -> None:
    for r in _results():
        uninterrupted = r["Streaming, overlap 1, mix 0.5"]["params"]
        _close(r["resumed"], uninterrupted, atol=0)
        _close(r["resumed in flight"], uninterrupted, atol=0)


def test_diloco_sends_one_h_th_of_ddps_bytes_a_step() -> None:
    for r in _results():
        b = r["bytes"]
        assert b["diloco"] == 4 * b["numel"] / 4  # one fp32 model every 4 steps
        assert b["ddp"] >= 4 * b["numel"]  # one fp32 model every step (and DDP's flag)
        assert b["ddp"] / b["diloco"] >= 3.99


def test_int8_pseudo_gradients_stay_within_the_quantization_bound() -> None:
    simulated = _simulate(dict(sync_every=4), _adamw, steps=4)
    for r in _results():
        q, f = r["quantized"]["int8"], r["quantized"]["fp32"]
        _close(f, simulated[0])
        # One outer Nesterov step of the averaged pseudo-gradient: lr (1 + momentum) times its
        # error, which is at most two half-steps of int8 (each rank's, then the average's):
        # 2 x max |delta| / 127 / 2, max |delta| bounded by how far each worker moved.
        before_sync = _simulate(dict(sync_every=5), _adamw, steps=4)  # 4 inner steps, no sync yet
        moved = max(float((a - b).abs().max()) for w in range(WORLD) for a, b in zip(_params(_model()), before_sync[w]))
        bound = 0.7 * 1.9 * 2.02 * moved / 127 / 2
        for a, b in zip(q, f):
            assert (a - b).abs().max() <= bound, ((a - b).abs().max(), bound)
        assert any(not torch.equal(a, b) for a, b in zip(q, f))  # it did quantize
