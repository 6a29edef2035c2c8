"""``tandem check`` on the command line: the parser and :func:`main`, which the
``tandem`` console script calls with the arguments after ``check``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import torch

from tandem._compat import fsdp_policies
from tandem.tools.check.api import check_strategies
from tandem.tools.check.run import STRATEGIES
from tandem.tools.entry import load_entry

__all__ = ["EXIT_DIVERGES", "EXIT_EQUAL", "EXIT_USAGE", "build_parser", "main"]

EXIT_EQUAL = 0
"""Every strategy trained the same model as one process."""
EXIT_DIVERGES = 1
"""Some strategy diverged."""
EXIT_USAGE = 2
"""Bad arguments, or the check could not run (a rank failed): nothing was compared."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem check",
        description="Train a few steps as one process on the global batch and as N ranks (DDP, ZeRO-1/2 or "
                    "fully_shard), each on its shard, and compare the parameters after every step. Exit 0: the "
                    "same model within tolerance; 1: it diverges; 2: bad arguments or a rank failed.")
    p.add_argument("--model", required=True, metavar="MOD:FN", help="a function building the model (no arguments)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", metavar="MOD:FN",
                        help="data(step) -> (inputs, targets), the global batch; or data(step, rank=, world_size=) "
                             "-> that rank's batch")
    source.add_argument("--dataset", metavar="MOD:FN", help="a function returning a Dataset (with --batch-size)")
    p.add_argument("--batch-size", type=int, default=None, help="global batch, with --dataset")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    p.add_argument("--strategy", default="ddp", metavar="S[,S...]",
                   help=f"one or more of {', '.join(STRATEGIES)}, comma-separated, in one launch (default ddp)")
    p.add_argument("--loss", default="auto",
                   help="auto (cross_entropy for integer targets, else mse), mse, cross_entropy, l1, or MOD:FN")
    p.add_argument("--optimizer", default="sgd", help="a torch.optim class, any case (default sgd)")
    p.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1)")
    p.add_argument("--momentum", type=float, default=None, help="passed to the optimizer when given")
    p.add_argument("--weight-decay", type=float, default=None, help="passed to the optimizer when given")
    p.add_argument("--seed", type=int, default=0, help="seeds every generator before the model factory (default 0)")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: from the dtype)")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance (default: from the dtype)")
    for field, what in (("param", "gathers and computes in"), ("reduce", "reduces gradients in"),
                        ("output", "casts each unit's outputs to")):
        p.add_argument(f"--{field}-dtype", type=_dtype, default=None, metavar="DTYPE",
                       help=f"fsdp only: fully_shard's MixedPrecisionPolicy {what} DTYPE ({', '.join(_DTYPES)})")
    return p


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "float64": "float64", "fp64": "float64"}


def _dtype(name: str) -> torch.dtype:
    if name.lower() not in _DTYPES:
        raise argparse.ArgumentTypeError(f"{name!r} is not one of {', '.join(_DTYPES)}")
    return getattr(torch, _DTYPES[name.lower()])


def _mp_policy(args: argparse.Namespace) -> Any:
    """fully_shard's MixedPrecisionPolicy from --param/reduce/output-dtype; None when none is given."""
    dtypes = {"param_dtype": args.param_dtype, "reduce_dtype": args.reduce_dtype, "output_dtype": args.output_dtype}
    if all(d is None for d in dtypes.values()):
        return None
    MixedPrecisionPolicy, _, _ = fsdp_policies()
    return MixedPrecisionPolicy(**dtypes)


def main(argv: Sequence[str] | None = None) -> int:
    """``tandem check``: 0 when every strategy trains the same model, 1 when one
    diverges, 2 on bad arguments or when a rank failed."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse's usage errors and --help
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    strategies = [s.strip() for s in args.strategy.split(",") if s.strip()]
    kwargs = {k: v for k, v in (("momentum", args.momentum), ("weight_decay", args.weight_decay)) if v is not None}
    try:
        if args.dataset is not None:
            data: Any = load_entry(args.dataset, what="--dataset")()
        else:
            data = args.data
        if args.rtol is not None and args.atol is None or args.atol is not None and args.rtol is None:
            raise ValueError("give both --rtol and --atol, or neither")
        reports = check_strategies(args.model, data, strategies=strategies, nproc=args.nproc, steps=args.steps,
                                   loss=args.loss, optimizer=args.optimizer, lr=args.lr, optimizer_kwargs=kwargs,
                                   batch_size=args.batch_size, seed=args.seed, rtol=args.rtol, atol=args.atol,
                                   mp_policy=_mp_policy(args))
    except ValueError as e:
        print(f"tandem check: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except RuntimeError as e:  # SpawnError: a rank raised
        print(f"tandem check: the check could not run: {e}", file=sys.stderr)
        return EXIT_USAGE
    print("\n\n".join(r.describe() for r in reports.values()))
    return EXIT_EQUAL if all(r.equal for r in reports.values()) else EXIT_DIVERGES
