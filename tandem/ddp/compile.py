"""tandem's DDP under ``torch.compile``: where the compiled graph is split.

# Note [torch.compile]
``torch.compile(tandem.DistributedDataParallel(model))`` and
``tandem.DistributedDataParallel(torch.compile(model))`` both compile the model
and nothing else, as with torch's DDP:

* The wrapper's own work before and after the model (buffer broadcast, join,
  arming the reducer, hooks on the outputs) is Python bookkeeping with
  collectives, which dynamo must not trace: a collective traced into a graph
  would bypass tandem's comm layer (its ledger, its checks) at run time.
  ``DistributedDataParallel.forward`` is skipped by dynamo (``disable``,
  non-recursive), the two halves of its work are disabled for dynamo
  altogether, and the call of the inner module is where compilation starts:
  its frame is one graph, and dynamo counts no graph break (torch's compiled
  DDP counts three, in its wrapper). In eager mode the disabled calls cost a
  few microseconds per forward (5 to 10 on 2 CPU cores). The decorator is put
  on ``forward`` once dynamo is loaded (``_compat.not_traced_forward``: by the
  wrapper's constructor, by ``torch.compile(ddp)`` before it traces, by
  ``ddp.compile()``), so a process that never compiles never loads dynamo,
  1.5 s of CPU at every worker's start.
* Gradients are reduced by post-accumulate-grad hooks, which the autograd
  engine runs outside compiled code, so the reducer works unchanged. But one
  compiled graph has one backward node: every parameter's AccumulateGrad runs
  after the whole compiled backward, so no bucket could launch before backward
  is over. torch solves this for its own DDP in dynamo: while a DDP forward is
  active, dynamo's DDPOptimizer (torch/_dynamo/backends/distributed.py,
  ``torch._dynamo.config.optimize_ddp``, on by default) splits the graph it
  compiles into pieces of about one bucket each, counting parameter bytes in
  reverse graph order (the order gradients become ready) with a first piece
  of 1 MiB and ``bucket_bytes_cap`` after it. Each piece gets its own backward
  node, so the parameters of the last layers accumulate, and their buckets
  launch, while the earlier pieces' backward still runs. Around the inner
  module call tandem's forward marks a DDP forward as active where dynamo
  looks for one, as torch's DDP does (``tandem._compat.enter_ddp_forward``),
  with a :class:`SplitHint`: dynamo reads only the cap from it, which
  :func:`split_hint` derives from tandem's caps.

The pieces approximate tandem's buckets, they do not copy them: DDPOptimizer
has no per-bucket caps (``bucket_cap_mb_list``), gives no large parameter a
piece of its own (Note [solo buckets] in plan.py), counts parameters that
``_ddp_params_and_buffers_to_ignore`` names (it skips only those torch's DDP
marked), and refuses a cap below its 1 MiB first piece (an AssertionError from
torch's compiled DDP with ``bucket_cap_mb < 1``), so tandem asks for at least
1 MiB. A bucket whose parameters span two pieces launches after the second:
later, never wrong.
The split changes where the graphs end, not the arithmetic; results equal the
unsplit graph's and eager DDP's (tests/ddp/test_compile.py).

Where the split does not happen, reductions still run and results are the
same, but all of them after the compiled backward: with ``optimize_ddp`` set
off or to another mode, or on a future torch that drops
``_active_ddp_module``. Compiled autograd, which traces the backward with its
hooks (torch's DDP supports it only with its Python reducer), is refused with
a RuntimeError that says so (``tandem._compat.queue_backward_callback``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.ddp.plan import DEFAULT_FIRST_BUCKET_BYTES

__all__ = ["SplitHint", "split_hint"]


@dataclass(frozen=True)
class SplitHint:
    """What dynamo's DDPOptimizer reads from the active DDP module (Note [torch.compile])."""

    bucket_bytes_cap: int
    """Bytes of parameters per compiled piece after the first (1 MiB) one."""


def split_hint(caps: Sequence[int], overlap: bool, world_size: int) -> SplitHint | None:
    """The split tandem asks dynamo for, given its bucket caps; None where a split
    buys nothing: a world of one (nothing to reduce) or reductions that wait for
    the end of backward anyway (``overlap=False``)."""
    if world_size < 2 or not overlap:
        return None
    return SplitHint(max(caps[-1], DEFAULT_FIRST_BUCKET_BYTES))
