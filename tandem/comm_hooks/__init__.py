"""Communication hooks for ``DistributedDataParallel.register_comm_hook``.

Each hook follows torch's contract, ``hook(state, bucket) -> Future[Tensor]``, so
it works with tandem's DDP and with torch's. On tandem's DDP their collectives go
through the DDP's ``comm`` (tags starting with "hook"), so ``ddp.comm_stats``
counts their bytes and ``ddp.comm.observers`` see them.

- ``allreduce_hook``: plain averaging, bit-identical to no hook.
- ``fp16_compress_hook``, ``bf16_compress_hook``: half the bytes.
- ``powersgd_hook`` with ``PowerSGDState(PowerSGDConfig(...))``: low-rank
  compression with error feedback, often 100x fewer bytes.
- ``quantized_hook`` with ``QuantizedState(bits=8)``: int8 (or int4) blocks with
  error feedback, 3.9x (7.5x) fewer bytes.
- ``noop_hook``, ``noop_when(hook, skip)``: no communication, always or on demand.
"""

from tandem.comm_hooks.allreduce import allreduce_hook
from tandem.comm_hooks.cast import bf16_compress_hook, fp16_compress_hook
from tandem.comm_hooks.noop import NoopWhen, noop_hook, noop_when
from tandem.comm_hooks.powersgd import PowerSGDConfig, PowerSGDState, powersgd_hook
from tandem.comm_hooks.quantized import QuantizedState, quantized_hook

__all__ = ["NoopWhen", "PowerSGDConfig", "PowerSGDState", "QuantizedState", "allreduce_hook",
           "bf16_compress_hook", "fp16_compress_hook", "noop_hook", "noop_when", "powersgd_hook", "quantized_hook"]
