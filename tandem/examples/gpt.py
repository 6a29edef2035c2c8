"""Train a small character-level GPT on English text, fully sharded, with tandem's Trainer.

The run book::

    tandem run --nproc-per-node 2 -m tandem.examples.gpt      # two workers
    torchrun --standalone --nproc-per-node 2 -m tandem.examples.gpt
    python -m tandem.examples.gpt                              # one process

The text is the documentation that ships inside CPython itself,
``pydoc_data.topics`` (what ``help("assert")`` prints): its topics concatenated
in sorted order, about 465 thousand characters of English prose and Python
grammar. Nothing is downloaded. The last 10% is the validation text.

The model (gpt_model.py) is built the way a model too large for one device is:
on the meta device, then ``tandem.fully_shard`` per block and at the root, then
``to_empty`` and its own ``init_weights()`` (the same initial model at every
world size; one process skips fully_shard). Each block checkpoints its activations, and ``tandem.Trainer``
runs the loop: AdamW with warm-up and cosine decay, gradient clipping,
validation loss after every epoch, and forward and loss under bf16 autocast on a
GPU (``--precision bf16`` asks for it on a CPU too; on a CPU without AVX512-BF16
or AMX its matrix products run several times slower than fp32's, so ``auto`` picks
fp32 there).

Loss is cross-entropy per character in nats. The run prints the unigram
baseline next to it: the cross-entropy on the validation text of the training
text's character frequencies (what a model that ignores context reaches, about
3.2 here); the model goes well below it (docs/getting-started/digits.md states what
the default run reached, and in what time). At the end rank 0 prints a sample drawn from the
model at temperature 0.8 with a fixed seed.

The run writes to ``tandem-gpt/``: ``checkpoints/step-*/`` (after every epoch;
sharded: each rank writes its own shards with torch.distributed.checkpoint),
``metrics.jsonl`` and ``loss.png`` (``--checkpoint-every N`` saves every N steps
too, ``--async-checkpoint`` writes the checkpoints in the background while
training goes on). Run the same command again and it resumes from the latest
checkpoint (interrupted: exactly where it stopped; finished: it only prints the
result and a sample). ``--fresh`` starts over, ``--max-steps N`` stops early.
``--batch-size`` is per rank; the flags for the model's size (``--layers``,
``--embd``, ...) must stay the same across a resume.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import tandem
from tandem.examples._start_over import start_over
from tandem.examples.gpt_model import GPT, GPTConfig, generate


# ---------------------------------------------------------------------- the text
def load_text(max_chars: int | None = None) -> str:
    """CPython's own documentation topics, concatenated in sorted key order."""
    from pydoc_data.topics import topics
    text = "".join(topics[key] for key in sorted(topics))
    return text if max_chars is None else text[:max_chars]


class CharCodec:
    """Characters to token ids and back; the vocabulary is every character of the text."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self._ids = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self._ids[c] for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


def split_text(text: str) -> tuple[CharCodec, torch.Tensor, torch.Tensor]:
    """The codec of ``text``, and its ids split into the first 90% for training
    and the last 10% for validation."""
    codec = CharCodec(text)
    ids = codec.encode(text)
    split = len(ids) * 9 // 10
    return codec, ids[:split], ids[split:]


class Windows(Dataset):
    """Windows of ``block_size`` tokens every ``block_size`` positions, as
    ``(inputs, targets)``: the targets are the inputs shifted by one."""

    def __init__(self, ids: torch.Tensor, block_size: int) -> None:
        if len(ids) <= block_size:
            raise ValueError(f"a text of {len(ids)} characters holds no window of block_size={block_size} "
                             "and its next character; use more text or a smaller --block-size")
        self.ids, self.block_size = ids, block_size

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = self.ids[start:start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def unigram_loss(train: torch.Tensor, val: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy in nats of the training ids' frequencies on the validation
    ids: the loss of the best model that ignores context. Add-one smoothing gives
    a character absent from the training text a finite loss."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1.0
    log_p = (counts / counts.sum()).log()
    return float(-log_p[val].mean())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy per character: logits ``(B, T, V)``, targets ``(B, T)``."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# ---------------------------------------------------------------------- the model
def build_model(cfg: GPTConfig, world: tandem.WorldInfo, seed: int) -> GPT:
    """The GPT for this rank: built on the meta device, fully sharded per block
    and at the root (with more than one rank), given memory, initialised."""
    with torch.device("meta"):
        model = GPT(cfg)
    if world.world_size > 1:
        for block in model.blocks:
            tandem.fully_shard(block)
        tandem.fully_shard(model)
    model.to_empty(device=world.device)
    model.init_weights(seed)  # Note [initial values at any world size] in gpt_model.py
    return model


def warmup_cosine(warmup: int, total: int, floor: float = 0.1) -> Callable[[int], float]:
    """The learning-rate factor at each step: linear warm-up, then cosine down to ``floor``."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


def precision_for(flag: str, device: torch.device) -> str:
    """``--precision``: ``auto`` is bf16 autocast on a GPU and fp32 on a CPU,
    where most CPUs (all without AVX512-BF16 or AMX) emulate bf16 matrix products
    several times slower than fp32 ones."""
    if flag != "auto":
        return flag
    return "bf16" if device.type == "cuda" else "fp32"


# ---------------------------------------------------------------------- the job
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8, help="windows per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--block-size", type=int, default=128, help="context length in characters")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--embd", type=int, default=128, help="width of the residual stream")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--no-activation-checkpointing", action="store_true")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto: bf16 on a GPU, fp32 on a CPU (see the docstring)")
    p.add_argument("--max-chars", type=int, default=None, help="train on the text's first N characters only")
    p.add_argument("--output-dir", default="tandem-gpt")
    p.add_argument("--max-steps", type=int, default=None, help="stop early (resume later)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="also save every N steps (0: after each epoch only)")
    p.add_argument("--async-checkpoint", action="store_true",
                   help="write checkpoints in the background (TrainerConfig.async_checkpoint)")
    p.add_argument("--fresh", action="store_true", help="delete the output directory first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-chars", type=int, default=300, help="length of the sample printed at the end")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--no-progress", action="store_true", help="a line per record, no bar")
    return p.parse_args(argv)


def build_trainer(args: argparse.Namespace, world: tandem.WorldInfo, codec: CharCodec,
                  train_ids: torch.Tensor, val_ids: torch.Tensor) -> tandem.Trainer:
    """The job's Trainer for this rank, from the flags."""
    cfg = GPTConfig(vocab_size=codec.vocab_size, block_size=args.block_size, n_layer=args.layers,
                    n_head=args.heads, n_embd=args.embd, dropout=args.dropout,
                    activation_checkpointing=not args.no_activation_checkpointing)
    model = build_model(cfg, world, args.seed)
    tandem.seed_everything(args.seed, per_rank=True)  # dropout differs between ranks
    train_set, val_set = Windows(train_ids, args.block_size), Windows(val_ids, args.block_size)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.1)
    steps = args.epochs * math.ceil(math.ceil(len(train_set) / world.world_size) / args.batch_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(min(100, steps // 10), steps))
    config = tandem.TrainerConfig(
        epochs=args.epochs, batch_size=args.batch_size, eval_batch_size=4 * args.batch_size,
        precision=precision_for(args.precision, world.device), max_grad_norm=1.0, output_dir=args.output_dir,
        max_steps=args.max_steps, seed=args.seed, log_every=args.log_every,
        progress=not args.no_progress, checkpoint_every=args.checkpoint_every,
        async_checkpoint=args.async_checkpoint)
    return tandem.Trainer(model, optimizer, train_set, lm_loss, eval_data=val_set,
                          scheduler=scheduler, config=config)


def main(argv: list[str] | None = None) -> None:
    started = time.perf_counter()
    args = parse_args(argv)
    world = tandem.init()
    if args.fresh:
        start_over(args.output_dir, world)

    codec, train_ids, val_ids = split_text(load_text(args.max_chars))
    baseline = unigram_loss(train_ids, val_ids, codec.vocab_size)
    if world.rank == 0:
        print(f"text: {len(train_ids)} training and {len(val_ids)} validation characters, "
              f"{codec.vocab_size} distinct; unigram baseline {baseline:.4f} nats/char")

    trainer = build_trainer(args, world, codec, train_ids, val_ids)
    result = trainer.fit()
    evaluation = result.evaluation or trainer.evaluate()  # stopped before the first epoch ended

    # Every rank draws the same sample (the sharded forward is a collective); rank 0 prints it.
    prompt = codec.encode("\n").view(1, 1).to(world.device)
    sample = generate(trainer.model, prompt, args.sample_chars, block_size=args.block_size,
                      temperature=args.temperature, generator=torch.Generator().manual_seed(args.seed))
    if trainer.rank == 0:  # the rank now: an elastic job's world may have changed in fit()
        print(result.describe())
        print(f"validation loss {evaluation['loss']:.4f} nats/char "
              f"(unigram baseline {baseline:.4f}, ratio {evaluation['loss'] / baseline:.2f})")
        print(f"sample at temperature {args.temperature}:\n" + "-" * 60)
        print(codec.decode(sample[0, 1:]))
        print("-" * 60)
        if result.checkpoint is not None:
            print(f"checkpoint: {result.checkpoint}")
        print(f"metrics: {Path(args.output_dir) / 'metrics.jsonl'}")
        print(f"wall time {time.perf_counter() - started:.1f} s")
    tandem.shutdown()


if __name__ == "__main__":
    main()
