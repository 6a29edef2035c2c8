"""Over slow links: the GPT example on two namespaced nodes of two workers each,
the link at 1 Gbit/s and 100 Mbit/s, trained by DDP, PowerSGD, the int8
hook, LocalSGD, DiLoCo and Streaming DiLoCo, with torch's DDP and PowerSGD in
the same run: wall time, bytes over the link and validation loss at the same
number of tokens.

Run book (as root: it builds network namespaces, tandem.testing.Cluster)::

    python benchmarks/bench_slow_links.py                      # about 20 minutes on 2 cores
    python benchmarks/bench_slow_links.py --rates 100mbit --contenders ddp,diloco --steps 64
    python benchmarks/bench_slow_links.py --json /tmp/slow.json
    python benchmarks/bench_slow_links.py --rates none --loss-seeds 0,1,2    # the losses alone

Each contender is one job (``tandem run --nnodes 2 --nproc-per-node 2``, the
store on node 0's address, each link a ``tbf`` queue at the rate): the GPT of
tandem/examples/gpt_model.py (``--layers``, ``--embd``; not sharded: every
worker holds the model) on CPython's own documentation text
(tandem/examples/gpt.py's), AdamW, the same batches of ``--batch`` windows of
``--block`` characters per worker and step, ``--steps`` steps. Contenders:

    ddp / torch-ddp            tandem.DistributedDataParallel / torch's DDP
    powersgd / torch-powersgd  DDP with PowerSGD at rank --rank, from step 10 (tandem's hook / torch's,
                               on their own DDPs, each with one bucket: with several, torch's hook's
                               collectives go out of order across ranks on gloo, which aborts)
    int8                       tandem's DDP with the int8 hook (tandem.comm_hooks.quantized_hook)
    localsgd                   DiLoCoConfig.local_sgd(--sync-every): parameters averaged every H steps
    diloco                     DiLoCoConfig(sync_every=--sync-every, quantize=8): Nesterov outer step
    streaming                  DiLoCoConfig(sync_every=--sync-every, fragments=--fragments, quantize=8)

Node 0's rank 0 reads its node's ``eth0`` byte counters (both directions:
all that crossed the link) at the barrier before the first step and after the
last, and the wall time between the two barriers. The validation loss is each
worker's model on the same ``--val-windows`` windows of the validation text,
averaged over the workers (DiLoCo's workers differ between syncs; ``--steps``
is a multiple of H, so the last step syncs; Streaming DiLoCo's last fragment
syncs then, the others earlier). Contenders run in turn, in a rotated order at
each rate.

The validation loss after a few hundred steps moves by several percent with
the order of the batches alone (DDP's, over three orders of batches: 2.34,
2.14, 2.34), so one run cannot tell a 1% difference. ``--loss-seeds`` runs
every contender again for each seed (each worker's batches drawn from
``seed``) on one node of four workers, without the link, grouped as two nodes
of two (``GROUP_RANK``, which the quantized averages group by): the loss does
not depend on the link (the same seed gives the same loss to the last digit
over namespaced nodes and on loopback), and prints each contender's losses
and their mean against DDP's mean.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _two_nodes import launch, link_bytes, require_cluster

HERE = Path(__file__).resolve()
CONTENDERS = ("ddp", "torch-ddp", "powersgd", "torch-powersgd", "int8", "localsgd", "diloco", "streaming")


# ---------------------------------------------------------------------------- the workers

def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import tandem
    from tandem import comm_hooks
    from tandem.examples.gpt import Windows, lm_loss, load_text, split_text
    from tandem.examples.gpt_model import GPT, GPTConfig

    if args.loopback:  # one node of four as two of two: the groups the quantized averages make (by node)
        os.environ["GROUP_RANK"] = str(int(os.environ["RANK"]) // 2)
    world = tandem.init()
    torch.set_num_threads(1)
    codec, train_ids, val_ids = split_text(load_text())
    cfg = GPTConfig(vocab_size=codec.vocab_size, block_size=args.block, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.embd, activation_checkpointing=False)
    model = GPT(cfg)
    model.init_weights(0)
    name = args.contender
    wrapped: Any = model
    if name in ("ddp", "int8"):
        wrapped = tandem.DistributedDataParallel(model)
    elif name == "powersgd":  # one bucket, as torch's below: the same collectives a step
        wrapped = tandem.DistributedDataParallel(model, bucket_cap_mb=1024)
    elif name == "torch-ddp":
        wrapped = TorchDDP(model)
    elif name == "torch-powersgd":
        # torch's powerSGD_hook issues collectives from future callbacks, whose order differs
        # across ranks with several buckets in flight: gloo aborts (Note [powersgd order] in
        # tandem/comm_hooks/powersgd.py). One bucket keeps it in order.
        wrapped = TorchDDP(model, bucket_cap_mb=1024)
    if name == "powersgd":
        wrapped.register_comm_hook(comm_hooks.PowerSGDState(comm_hooks.PowerSGDConfig(
            matrix_rank=args.rank, start_iter=10)), comm_hooks.powersgd_hook)
    elif name == "torch-powersgd":
        wrapped.register_comm_hook(torch_powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.rank, start_powerSGD_iter=10),
            torch_powersgd.powerSGD_hook)
    elif name == "int8":
        wrapped.register_comm_hook(comm_hooks.QuantizedState(8), comm_hooks.quantized_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.1)
    diloco = None
    if name == "localsgd":
        diloco = tandem.DiLoCo(model, opt, tandem.DiLoCoConfig.local_sgd(args.sync_every))
    elif name == "diloco":
        diloco = tandem.DiLoCo(model, opt, tandem.DiLoCoConfig(sync_every=args.sync_every, quantize=8))
    elif name == "streaming":
        diloco = tandem.DiLoCo(model, opt, tandem.DiLoCoConfig(sync_every=args.sync_every, fragments=args.fragments,
                                                               quantize=8))
    train, val = Windows(train_ids, args.block), Windows(val_ids, args.block)
    gen = torch.Generator().manual_seed(world.rank + 100 * args.seed)  # each worker its own batches
    dist.barrier()
    before = link_bytes() if world.rank == 0 and not args.loopback else 0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        idx = torch.randint(0, len(train), (args.batch,), generator=gen).tolist()
        x = torch.stack([train[i][0] for i in idx])
        y = torch.stack([train[i][1] for i in idx])
        opt.zero_grad(set_to_none=True)
        lm_loss(wrapped(x), y).backward()
        opt.step()
    if diloco is not None:
        diloco.flush()
    dist.barrier()
    wall = time.perf_counter() - t0
    sent = link_bytes() - before if world.rank == 0 and not args.loopback else 0
    picks = torch.linspace(0, len(val) - 1, args.val_windows).long().tolist()
    with torch.no_grad():
        vx = torch.stack([val[i][0] for i in picks])
        vy = torch.stack([val[i][1] for i in picks])
        loss = torch.tensor([float(lm_loss(model(vx), vy))])
    dist.all_reduce(loss)
    if world.rank == 0:
        Path(args.out).write_text(json.dumps({"wall_s": wall, "link_bytes": sent,
                                              "val_loss": float(loss) / world.world_size,
                                              "params": sum(p.numel() for p in model.parameters())}))
    # One run of torch's DDP at 100 Mbit/s had a rank stay in its exit for minutes after
    # the job's work was done: say where, and go.
    faulthandler.dump_traceback_later(60, exit=True)
    tandem.shutdown()


# ---------------------------------------------------------------------------- the host

def _worker_args(name: str, seed: int, out: Path, args: argparse.Namespace) -> list[str]:
    """The worker's command line: the contender, the seed, where to write, the shared settings."""
    argv = ["--worker", "--contender", name, "--out", str(out), "--seed", str(seed)]
    for flag in ("steps", "batch", "block", "layers", "heads", "embd", "lr", "sync_every", "fragments", "rank",
                 "val_windows"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv


def _run(cluster: Any, name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{name}.json"
    procs = launch(cluster, HERE, f"slow-{name}", [], _worker_args(name, args.seed, out, args),
                   {"OMP_NUM_THREADS": "1"})
    logs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    if any(p.returncode for p in procs) or not out.exists():
        raise SystemExit(f"{name} failed:\n" + "\n".join(log[-3000:] for log in logs))
    return json.loads(out.read_text())


def run_loopback(name: str, seed: int, args: argparse.Namespace, tmp: Path) -> float:
    """Contender ``name``'s validation loss with batches of ``seed``, four workers on this node."""
    out = tmp / f"{name}-{seed}.json"
    argv = [sys.executable, "-m", "tandem", "run", "--nproc-per-node", "4", str(HERE), "--loopback",
            *_worker_args(name, seed, out, args)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode or not out.exists():
        raise SystemExit(f"{name} (seed {seed}) failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return float(json.loads(out.read_text())["val_loss"])


def run_rate(rate: str, args: argparse.Namespace, rotate: int) -> dict[str, Any]:
    from tandem.testing import Cluster

    names = args.contenders.split(",")
    names = names[rotate % len(names):] + names[:rotate % len(names)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp, Cluster(2, rate=rate) as cluster:
        for name in names:
            t0 = time.time()
            results[name] = _run(cluster, name, args, Path(tmp))
            print(f"{rate} {name}: {time.time() - t0:.0f} s {results[name]}", file=sys.stderr, flush=True)
    return results


def format_results(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| link | contender | wall time (s) | / DDP's | bytes over the link (MiB) | DDP's / these | "
             "validation loss | / DDP's |", "|---|---|---|---|---|---|---|---|"]
    for rate, by_name in results.items():
        ddp = by_name.get("ddp")
        for name, r in by_name.items():
            wall = r["wall_s"] / ddp["wall_s"] if ddp else float("nan")
            sent = ddp["link_bytes"] / r["link_bytes"] if ddp and r["link_bytes"] else float("nan")
            loss = r["val_loss"] / ddp["val_loss"] if ddp else float("nan")
            lines.append(f"| {rate} | {name} | {r['wall_s']:.1f} | {wall:.2f} | {r['link_bytes'] / 2**20:.2f} | "
                         f"{sent:.1f} | {r['val_loss']:.4f} | {loss:.4f} |")
    return "\n".join(lines)


def format_losses(losses: dict[str, list[float]], seeds: list[int]) -> str:
    lines = [f"| contender | validation loss, seeds {', '.join(map(str, seeds))} | mean | / DDP's mean |",
             "|---|---|---|---|"]
    ddp = statistics.mean(losses["ddp"]) if "ddp" in losses else float("nan")
    for name, values in losses.items():
        mean = statistics.mean(values)
        lines.append(f"| {name} | {', '.join(f'{v:.4f}' for v in values)} | {mean:.4f} | {mean / ddp:.4f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="1gbit,100mbit")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="windows per worker and step")
    p.add_argument("--block", type=int, default=64, help="characters per window")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sync-every", type=int, default=32, help="DiLoCo's and LocalSGD's inner steps per sync (H)")
    p.add_argument("--fragments", type=int, default=4, help="Streaming DiLoCo's fragments")
    p.add_argument("--rank", type=int, default=4, help="PowerSGD's matrix rank")
    p.add_argument("--val-windows", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="the batches' seed of the timed runs")
    p.add_argument("--loss-seeds", default="", help="also the losses over these seeds, on one node (e.g. 0,1,2)")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--contender", default=None, help=argparse.SUPPRESS)
    p.add_argument("--loopback", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.steps % args.sync_every:
        raise SystemExit(f"--steps {args.steps} must be a multiple of --sync-every {args.sync_every}: the last "
                         "step syncs")
    results: dict[str, Any] = {}
    rates = [] if args.rates == "none" else args.rates.split(",")
    if rates:
        require_cluster("bench_slow_links")
    for i, rate in enumerate(rates):
        results[rate] = run_rate(rate, args, i)
    if results:
        print(format_results(results))
    losses: dict[str, list[float]] = {}
    seeds = [int(s) for s in args.loss_seeds.split(",") if s]
    if seeds:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.contenders.split(","):
                losses[name] = [run_loopback(name, seed, args, Path(tmp)) for seed in seeds]
                print(f"{name}: {losses[name]}", file=sys.stderr, flush=True)
        print(format_losses(losses, seeds))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "losses": losses}, indent=1))


if __name__ == "__main__":
    main()
