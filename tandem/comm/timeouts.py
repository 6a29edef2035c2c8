"""How long tandem waits for the other ranks by default.

Its own module, below both :mod:`tandem.control.bootstrap` (which starts a group
with it) and :mod:`tandem.comm.monitor` (which watches waits against it when
it is started without :func:`tandem.init`).
"""

from __future__ import annotations

import datetime

__all__ = ["DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
"""How long the rendezvous and each collective may wait for the other ranks.

Ten minutes, like torch's NCCL default and a third of its gloo default: long enough
for a slow rank to load data or a checkpoint, short enough that a hung job fails
while someone is still watching."""
