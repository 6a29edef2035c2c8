"""The command line: ``tandem plan --model MOD:FN --world-size N ...`` (:func:`main`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from tandem.planner.tensor_parallel import parse_mesh
from tandem.tools.plan.api import plan
from tandem.tools.plan.build import OPTIMIZER_STATE_BYTES

__all__ = ["build_parser", "main"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""The dtypes ``--param-dtype`` and ``--reduce-dtype`` take."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem plan",
        description="Before launching: DDP's buckets, memory per rank under DDP, ZeRO-1, ZeRO-2 and "
                    "fully_shard (activations measured with one forward on a sample batch), which fits "
                    "a device, and what to fix; on a dp x tp mesh with torch's tensor parallelism too.")
    p.add_argument("--model", required=True, metavar="MOD:FN", help="a function building the model")
    p.add_argument("--sample", metavar="MOD:FN",
                   help="a function returning one rank's batch, (inputs, targets) or inputs")
    p.add_argument("--loss", metavar="MOD:FN", help="loss_fn(outputs, targets) (default: sum of the outputs)")
    ranks = p.add_mutually_exclusive_group(required=True)
    ranks.add_argument("--world-size", type=int, help="number of ranks (data parallel only)")
    ranks.add_argument("--mesh", metavar="dp=N,tp=M",
                       help="a 2-D mesh: N data-parallel x M tensor-parallel ranks (with --tp-plan)")
    p.add_argument("--tp-plan", metavar="MOD:FN",
                   help="a function returning the dict given to parallelize_module(model, mesh['tp'], plan): "
                        "module patterns -> ColwiseParallel()/RowwiseParallel() or 'colwise'/'rowwise'")
    p.add_argument("--optimizer", default="adamw",
                   help=f"{', '.join(OPTIMIZER_STATE_BYTES)}, or state bytes per element (default adamw)")
    p.add_argument("--device-memory", metavar="SIZE", help="memory of one device, e.g. 16GiB or 80GB")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP's bucket_cap_mb")
    p.add_argument("--fsdp-units", metavar="NAMES",
                   help="comma-separated modules to fully_shard (default: the items of every ModuleList)")
    p.add_argument("--no-broadcast-buffers", action="store_true", help="DDP's broadcast_buffers=False")
    p.add_argument("--hsdp", type=int, default=1, metavar="R",
                   help="also plan HSDP: fully_shard over a 2-D mesh of R replicas x world-size/R shards")
    p.add_argument("--nodes", type=int, default=1, metavar="N",
                   help="the ranks are on N nodes: also show each strategy's bytes per step between them")
    p.add_argument("--elastic", action="store_true",
                   help="plan for `tandem run --elastic`: ZeRO-1/2 ranks also keep a copy of the previous "
                        "rank's optimizer-state shard, fully_shard ranks of its parameter and state shards")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="plan with each block (the fully_shard units) checkpointed; shows each block's "
                        "activations with and without (needs --sample)")
    p.add_argument("--param-dtype", choices=sorted(DTYPES), metavar="DTYPE",
                   help="fully_shard's MixedPrecisionPolicy param_dtype (bf16, fp16, fp32): units gathered and "
                        "the sample measured in it")
    p.add_argument("--reduce-dtype", choices=sorted(DTYPES), metavar="DTYPE",
                   help="MixedPrecisionPolicy reduce_dtype (default: the param dtype)")
    p.add_argument("--cpu-offload", action="store_true",
                   help="fully_shard with CPUOffloadPolicy: shards, gradients and optimizer state on the host")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``tandem plan``. Returns 0, 1 when ``--device-memory`` is given and no
    strategy fits, 2 on bad arguments."""
    parser = build_parser()
    args = parser.parse_args(argv)
    units = None if args.fsdp_units is None else [u for u in args.fsdp_units.split(",") if u]
    try:
        dp, tp = (args.world_size, 1) if args.mesh is None else parse_mesh(args.mesh)
        report = plan(args.model, world_size=dp, sample=args.sample, optimizer=args.optimizer,
                      device_memory=args.device_memory, grad_accum=args.grad_accum, loss_fn=args.loss,
                      bucket_cap_mb=args.bucket_cap_mb, fsdp_units=units,
                      broadcast_buffers=not args.no_broadcast_buffers, tensor_parallel=tp, tp_plan=args.tp_plan,
                      hsdp=args.hsdp, activation_checkpointing=args.activation_checkpointing,
                      elastic=args.elastic, nodes=args.nodes, param_dtype=DTYPES.get(args.param_dtype),
                      reduce_dtype=DTYPES.get(args.reduce_dtype), cpu_offload=args.cpu_offload)
    except ValueError as e:
        print(f"tandem plan: error: {e}", file=sys.stderr)
        return 2
    print(report.describe())
    return 1 if report.device_memory is not None and report.choice is None else 0
