"""How many bytes a piece of code holds at most, on CPU: :class:`PeakMemory`.

torch keeps allocator statistics for CUDA (``torch.cuda.max_memory_allocated``)
but not for CPU. The profiler does report every allocation and free of the CPU
allocator when ``profile_memory=True``, ``storage.resize_`` included (which a
dispatch mode would miss). :class:`PeakMemory` sums the blocks allocated inside
it that are not yet freed, and keeps the maximum: the most bytes the code held
at once beyond what existed before. Frees of blocks that existed before are
left out (garbage collected inside, or freed by the code), so the peak is
never an underestimate of what the code itself allocated; ``gc.collect()`` runs
first, so that earlier garbage does not die inside. Allocations of other
threads (a communication backend's own buffers) are not counted; the tensors
tandem allocates for collectives are allocated by the calling thread and are.
"""

from __future__ import annotations

import gc
import warnings
from types import TracebackType

from torch.profiler import ProfilerActivity, profile

from tandem._compat import allocation_events

__all__ = ["PeakMemory"]


class PeakMemory:
    """``with PeakMemory() as mem: ...``, then ``mem.peak`` (the most bytes
    held at once beyond those held before, 0 if never more) and ``mem.end``
    (the bytes still held at the end)."""

    def __init__(self) -> None:
        self.peak = 0
        self.end = 0
        self._prof: profile | None = None

    def __enter__(self) -> PeakMemory:
        gc.collect()
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        assert self._prof is not None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._prof.__exit__(exc_type, exc, tb)
        live = 0
        blocks: dict[int, int] = {}   # address -> bytes, of the blocks allocated inside
        for _, address, nbytes in allocation_events(self._prof):
            if nbytes > 0:
                blocks[address] = nbytes
                live += nbytes
                self.peak = max(self.peak, live)
            elif address in blocks:
                live -= blocks.pop(address)
        self.end = live
        self._prof = None
