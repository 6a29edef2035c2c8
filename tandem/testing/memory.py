"""How many bytes a piece of code holds at most, on CPU or on a CUDA device:
:class:`PeakMemory`, which ``tandem plan`` measures with too (tandem/tools/memory.py)."""

from tandem.tools.memory import PeakMemory

__all__ = ["PeakMemory"]
