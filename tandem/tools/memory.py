"""How many bytes a piece of code holds at most, on CPU or on a CUDA device:
:class:`PeakMemory`.

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
On a CUDA device the same is read from the caching allocator's statistics
(``torch.cuda.max_memory_allocated`` since entering, minus what was allocated
then), after synchronising the device on the way in and out.
"""

from __future__ import annotations

import gc
import warnings
from types import TracebackType

import torch
from torch.profiler import ProfilerActivity, profile

from tandem._compat import allocation_events

__all__ = ["PeakMemory"]


class PeakMemory:
    """``with PeakMemory() as mem: ...``, then ``mem.peak`` (the most bytes
    held at once beyond those held before, 0 if never more) and ``mem.end``
    (the bytes still held at the end); ``PeakMemory("cuda")`` counts the
    current CUDA device's memory instead of the CPU's."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"PeakMemory counts CPU or CUDA memory, got device {str(device)!r}")
        self.peak = 0
        self.end = 0
        self._prof: profile | None = None
        self._before = 0

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self._before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            return self
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = max(0, torch.cuda.max_memory_allocated() - self._before)
            self.end = torch.cuda.memory_allocated() - self._before
            return
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
