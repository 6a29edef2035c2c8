"""What a divergence's numbers cannot say alone: parameters whose gradient is
only rounding noise (Note [rounding-noise gradients]), ranks' batches that do
not split the global batch, and the first module whose output differs (the
likely cause, Note [first divergence] in compare.py).

# Note [rounding-noise gradients]
Some parameters have no gradient in exact arithmetic, only rounding noise: a
bias right before a normalisation layer (the normalisation subtracts the mean
it adds). SGD moves such a parameter by ``lr * noise``, far inside any
tolerance; Adam-type optimizers divide by the gradient's own running scale and
move it by about ``lr`` in the direction of the noise, which differs between one
process and N ranks. With an optimizer other than SGD, a parameter whose
one-process gradient stays at or below ``rtol`` x the step's largest gradient in
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch

from tandem.tools.check.compare import Tolerance, difference
from tandem.tools.check.records import RankRecord, ReferenceRun

__all__ = ["first_module", "noise_gradients", "sharding_problems"]


def noise_gradients(reference: ReferenceRun, tol: Tolerance) -> list[str]:
    """Note [rounding-noise gradients]."""
    if not reference.grad_max:
        return []
    names = list(reference.grad_max[0])
    for grads in reference.grad_max:
        scale = max(grads.values(), default=0.0)
        names = [n for n in names if grads.get(n, 0.0) <= tol.rtol * scale]
    return names if len(names) < len(reference.grad_max[0]) else []


def sharding_problems(global_keys: Sequence[Sequence[bytes]],
                       rank_keys: Sequence[Sequence[Sequence[bytes]]]) -> list[str]:
    for step, expected in enumerate(global_keys):
        shards = [keys[step] for keys in rank_keys]
        sizes = [len(s) for s in shards]
        want = collections.Counter(expected)
        got = collections.Counter(k for s in shards for k in s)
        if want != got:
            missing, extra = sum((want - got).values()), sum((got - want).values())
            return [f"step {step + 1}: the ranks' batches are not a split of the global batch data({step}): "
                    f"{missing} of its {len(expected)} samples are on no rank and {extra} samples on the ranks "
                    "are not in it or repeated; data(step, rank=r, world_size=n) must return disjoint shards "
                    "that together are data(step)"]
        if len(set(sizes)) > 1:
            return [f"step {step + 1}: the ranks hold {', '.join(map(str, sizes))} samples: DDP averages the "
                    "ranks' mean losses, which weighs the samples of a smaller shard more; give every rank "
                    "the same number of samples"]
    return []


def first_module(reference: ReferenceRun, ranks: Sequence[RankRecord], tol: Tolerance) -> str | None:
    """The first module whose output in step 1's forward differs, the ranks' outputs
    put back into the global batch's sample order."""
    order = _global_positions(reference.sample_keys[0], [r.sample_keys[0] for r in ranks])
    if order is None:
        return None
    per_rank = [dict(r.outputs) for r in ranks]
    for name, ref in reference.outputs:
        parts = [outs.get(name) for outs in per_rank]
        if any(p is None for p in parts):
            continue
        got = torch.cat([p for p in parts if p is not None])
        if tuple(got.shape) != tuple(ref.shape):
            continue
        placed = torch.empty_like(got)
        placed[order] = got
        if difference(ref, placed, tol)[1] > 1:
            kind = reference.module_types.get(name, "")
            label = f"'{name}'" if name else "the model"
            hint = ""
            if "BatchNorm" in kind and "Sync" not in kind:
                hint = (": it normalises with each rank's batch statistics, not the global batch's; convert "
                        "the model with tandem.SyncBatchNorm.convert_sync_batchnorm(model) before wrapping it")
            return f"the first module whose output differs in step 1's forward is {label} ({kind}){hint}"
    return None


def _global_positions(expected: Sequence[bytes], shards: Sequence[Sequence[bytes]]) -> torch.Tensor | None:
    where: dict[bytes, list[int]] = collections.defaultdict(list)
    for i, key in enumerate(expected):
        where[key].append(i)
    positions = []
    for shard in shards:
        for key in shard:
            if not where.get(key):
                return None
            positions.append(where[key].pop(0))
    return torch.tensor(positions, dtype=torch.long)
