"""The digits example (tandem.examples.digits) with Ray Train starting the workers.

Ray Train's ``TorchTrainer`` starts one worker process per ``--num-workers`` on
the Ray cluster and joins them in a torch.distributed process group (gloo on
CPU); ``tandem.init()`` in each worker adopts that group, and tandem's Trainer
and DistributedDataParallel run in it exactly as under ``tandem run``. With the
same seed and number of workers the run trains to the same parameters as
``tandem run --nproc-per-node 2 -m tandem.examples.digits`` (tests/launch/test_ray.py
checks this).

The run book, on one machine (a local Ray cluster of this machine's CPUs is
started for the run and stopped after it)::

    pip install 'tandem[ray,examples]'
    python -m tandem.examples.ray_digits --num-workers 2
    python -m tandem.examples.ray_digits --num-workers 2 --epochs 5 --fresh

On several machines, start a Ray cluster first and run the same script on the
head node; ``ray.init()`` finds the running cluster by itself::

    ray start --head --port 6379                  # on the head node
    ray start --address HEAD_IP:6379              # on every other node
    python -m tandem.examples.ray_digits --num-workers 8 \\
        --output-dir /shared/tandem-digits --storage-path /shared/ray-results

or submit it from anywhere with ``ray job submit --address http://HEAD_IP:8265
-- python -m tandem.examples.ray_digits --num-workers 8 ...``. Every node needs
the same Python environment with tandem installed. ``--output-dir`` (the
Trainer's checkpoints, which rank 0 writes and every rank reads to resume) and
``--storage-path`` (Ray's copy of the final model) must be directories every
node sees: a shared file system, or for Ray's storage a URI such as
``s3://bucket/path``. Each worker takes one CPU; ``--use-gpu`` gives each one a
GPU instead (tandem then uses NCCL).

All flags of tandem.examples.digits work here (``--epochs``, ``--batch-size``
per worker, ``--lr``, ``--max-steps``, ``--fresh``, ``--seed`` ...); the
progress bar is off because Ray forwards the workers' output line by line.
Recent Ray versions print each line of a worker twice (Ray Train's print patch
both logs and prints it); ``RAY_TRAIN_ENABLE_PRINT_PATCH=0`` in the driver's
environment, which Ray passes on to the workers, prints it once.

What to expect on two CPU cores: Ray and its two workers start in 15 to 30 s,
then the run is the digits example's: the loss falls from about 2.3 to below
0.05 in 20 epochs (460 steps) and the test accuracy ends at 98.6%, as under
``tandem run``. The Trainer writes to ``--output-dir`` (checkpoints,
``metrics.jsonl``, ``loss.png``) and resumes from it when run again; Ray keeps
the final weights as a Ray checkpoint (``model.pt``, the model's
``state_dict``) under ``--storage-path``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import tandem
from tandem.examples.digits import build_trainer
from tandem.examples.digits import parse_args as digits_args
from tandem.checkpoint.state import unwrap_model
from tandem.train.trainer import FitResult

if TYPE_CHECKING:
    from ray.train import Result

RUN_NAME = "tandem-digits"
MODEL_FILE = "model.pt"


def fit_digits(world: tandem.WorldInfo, config: dict[str, Any]) -> tuple[tandem.Trainer, FitResult]:
    """Train DigitNet with tandem's Trainer on this rank; what each worker runs,
    under Ray or any other launcher. ``config`` holds the digits example's flags.

    Returns the Trainer (its ``model`` is the DDP-wrapped model) and the FitResult.
    """
    args = argparse.Namespace(**config)
    trainer, _ = build_trainer(args, world, progress=False, plot=args.plot)
    return trainer, trainer.fit()


def train_worker(config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: runs in every Ray worker, after Ray
    has created the default process group."""
    import ray.train

    world = tandem.init()  # adopts the process group Ray Train created
    trainer, result = fit_digits(world, config)
    metrics: dict[str, Any] = {"steps": result.steps, "epochs": result.epochs_done,
                               "world_size": world.world_size}
    if result.evaluation is not None:
        metrics.update({f"test_{name}": value for name, value in result.evaluation.items()})
    # Every worker reports (a barrier in Ray Train); rank 0 alone hands Ray the weights.
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if world.rank == 0:
            torch.save(unwrap_model(trainer.model).state_dict(), Path(tmp) / MODEL_FILE)
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report(metrics, checkpoint=checkpoint)
    tandem.shutdown()  # leaves Ray's process group for Ray to destroy


def run(args: argparse.Namespace) -> Result:
    """Train on ``args.num_workers`` Ray workers and return Ray's Result (its
    ``metrics`` are rank 0's report, its ``checkpoint`` holds ``model.pt``).
    Connects to the running Ray cluster, or starts a local one."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    output_dir = Path(args.output_dir).resolve()  # workers need not share the driver's working directory
    if args.fresh:
        shutil.rmtree(output_dir, ignore_errors=True)
    storage = args.storage_path or str(output_dir / "ray-results")
    config = {name: getattr(args, name) for name in
              ("epochs", "batch_size", "lr", "precision", "max_steps", "seed", "plot")}
    config["output_dir"] = str(output_dir)
    trainer = TorchTrainer(
        train_worker, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu),
        run_config=RunConfig(name=RUN_NAME, storage_path=storage))
    return trainer.fit()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Every flag of tandem.examples.digits is accepted too (--epochs, --batch-size, "
               "--lr, --precision, --output-dir, --max-steps, --fresh, --seed).")
    p.add_argument("--num-workers", type=int, default=2, help="Ray workers (ranks)")
    p.add_argument("--use-gpu", action="store_true", help="one GPU per worker (NCCL)")
    p.add_argument("--storage-path", default=None,
                   help="where Ray keeps its checkpoint (default: OUTPUT_DIR/ray-results)")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip loss.png")
    ours, rest = p.parse_known_args(argv)
    return argparse.Namespace(**vars(digits_args(rest)), **vars(ours))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        import ray.train  # noqa: F401
    except ImportError:
        raise SystemExit("this example needs Ray Train: pip install 'tandem[ray]'") from None
    result = run(args)
    metrics = result.metrics or {}
    print(f"trained {metrics.get('epochs')} epoch(s), {metrics.get('steps')} steps, over "
          f"{metrics.get('world_size')} Ray worker(s)")
    if "test_accuracy" in metrics:
        print(f"test accuracy {100 * metrics['test_accuracy']:.1f}%, "
              f"test loss {metrics['test_loss']:.4f}")
    if result.checkpoint is not None:
        print(f"model: {result.checkpoint.path}/{MODEL_FILE}")
    print(f"metrics: {Path(args.output_dir) / 'metrics.jsonl'}")


if __name__ == "__main__":
    main()
