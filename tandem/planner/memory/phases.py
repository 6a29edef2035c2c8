"""fully_shard's peak per rank over the phases of one training step, from the
units' buffers (fully_shard.py) and what the step holds beside them, measured
on a sample batch (:class:`StepActivity`): :func:`stage3_peak`.

# Note [stage 3 peak]
Stage 3's ``total`` (Note [stage 3 memory] in fully_shard.py) adds every
transient to the steady state and the activations to that, as if all were
alive at once: 25-65% over what a step of a GPT measured at fake worlds of 8
and 64 (benchmarks/bench_fake_world.py). A step goes through phases that hold
different things, in the order the runtime allocates and frees them
(tandem/fsdp/schedule.py), so the peak is the largest of:

- the loss (its forward and backward): the state (shards and optimizer state,
  from the second step on), the root's unsharded parameters (the root keeps
  them from forward to backward), every activation kept from forward (with
  checkpointing, only each block's inputs), the outputs, and what the loss
  holds beyond what it saves (the gradients of the logits, in fp32 for a
  cross-entropy of fp32 logits); the largest phase of a language model;
- the head's backward (the root's own layers after the blocks): the same
  without the loss's transients, with the gradient of the outputs, the
  head's gradients and the last block's all-gather (prefetched);
- each block's backward, the last first: the activations of the blocks
  before it and its own (checkpointed: the blocks' inputs and its forward
  recomputed), its unsharded parameters and the next one's all-gather, its
  full gradients as they arrive, the reduce-scatter input of the block
  before it in flight (one: Note [reductions in flight] in
  tandem/fsdp/schedule.py), the sharded gradients of the blocks reduced so
  far and the head's gradients; and when it launches its reduction, its
  full gradients with its reduce-scatter input (or the previous one's with
  its copied-out gradients), its parameters resharded;
- the rest of the root's backward (the embeddings), then its reduction;
- the optimizer's step: parameters, gradients and (created at the first
  step) the optimizer state.

Under ``CPUOffloadPolicy`` the state and the sharded gradients are on the host
and left out. The gradients flowing through a block's backward are not
modelled (small beside its activations), nor is a step's forward, which
holds less than the loss's phase after it. Blocks are the units other than
the root; a block's unit that was merged into the one enclosing it (Note
[tiny units] in tandem/fsdp/api.py) counts what it keeps with the embeddings'
activations and is recomputed in the root's backward.
"""

from __future__ import annotations

from tandem.planner.memory.estimate import FullyShardSpec, MemoryEstimate, StepActivity
from tandem.planner.memory.fully_shard import UnitBytes, enclosing_units, unit_bytes

__all__ = ["stage3_peak"]


def stage3_peak(estimate: MemoryEstimate, spec: FullyShardSpec, step: StepActivity,
                optimizer_bytes_per_param: int) -> int:
    """The most one rank holds at once over a step of fully_shard (Note [stage 3 peak]).

    Args:
        estimate: stage 3's estimate (:func:`tandem.planner.estimate_memory`), with its units.
        spec: how fully_shard is applied (the estimate's).
        step: what the step holds beside the model's state, measured.
        optimizer_bytes_per_param: as given to :func:`tandem.planner.estimate_memory`.

    Returns:
        Bytes on the device (under ``spec.cpu_offload``, without what the host holds).
    """
    sizes = {u.name: unit_bytes(u, spec, optimizer_bytes_per_param) for u in estimate.units}
    root = sizes.get("", UnitBytes(0, 0, 0, 0, 0, 0))
    enclosing = enclosing_units(estimate.units)
    blocks = [u.name for u in estimate.units if u.name]            # forward order
    measured = {name: (saved, inputs) for name, saved, inputs in step.blocks}
    kept = {n: inputs if step.checkpointed else saved for n, (saved, inputs) in measured.items()}
    recomputed = {n: max(0, saved - kept[n]) for n, (saved, _) in measured.items()}
    merged = [n for n in measured if n not in sizes]   # their backward is the enclosing unit's: the root's
    before = step.before + sum(kept[n] for n in merged)
    kept.update({n: 0 for n in blocks if n not in measured})
    recomputed.update({n: 0 for n in blocks if n not in measured})
    offload = spec.cpu_offload
    state = (0 if offload else estimate.params + estimate.optimizer) + estimate.buddy
    grads = {n: 0 if offload else b.grads for n, b in sizes.items()}
    # Units gathered beside one: the root, the units enclosing it, and without resharding every
    # unit before it (they stay gathered from forward until their own backward).
    outer = {n: sum(sizes[e].full for e in enclosing[n] if e) for n in blocks}
    kept_full = {n: (0 if spec.reshard_after_forward else sum(sizes[m].full for m in blocks[:k]))
                 for k, n in enumerate(blocks)}
    reshard = spec.reshard_after_forward
    activations = before + step.after + sum(kept[n] for n in blocks)     # at the end of forward
    held = state + root.full + step.outputs                     # through the whole backward
    gathered = 0 if reshard else sum(sizes[n].full for n in blocks)
    last = sizes[blocks[-1]].full if blocks and reshard else 0  # prefetched by the head's backward
    phases = [held + gathered + activations + step.loss,
              held + gathered + activations + last + step.head_grads + step.outputs]
    reduced, in_flight, copied = 0, 0, 0   # sharded gradients so far; the previous input and its copy
    for k in reversed(range(len(blocks))):
        n, b = blocks[k], sizes[blocks[k]]
        alive = before + sum(kept[m] for m in blocks[:k])
        prefetch = sizes[blocks[k - 1]].full if k and reshard else 0
        common = held + step.head_grads + reduced + outer[n] + kept_full[n] + prefetch
        phases.append(common + alive + kept[n] + recomputed[n] + b.full + b.full_grads + in_flight)
        phases.append(common + alive + b.full_grads + max(in_flight + copied, b.reduce_input))
        reduced += copied
        in_flight, copied = b.reduce_input, grads[n]
    phases.append(held + before + max((recomputed[n] for n in merged), default=0) + reduced + root.full_grads
                  + max(in_flight + copied, root.reduce_input))
    if not offload:
        phases.append(estimate.params + estimate.grads + estimate.optimizer + estimate.buddy)
    return max(phases)
