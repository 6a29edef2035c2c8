"""Whether anything happened to a generation, known without a read a slice: :class:`News`.

# Note [news of a generation]
A rank that waits in a collective longer than a slice looks, each slice,
whether a peer is gone (Note [a watch reads the verdict] in
tandem/comm/peers.py): the generation's verdict and whether anyone left to
regroup, three store operations a slice, twelve a second a rank, about
100,000 a second for 8,192 ranks waiting together (a straggler, a save on one
rank), more than one store's server answers. So each member that waits so
over a TCP store keeps, for its generation, a thread with a connection of its
own that waits on one key, ``gen/<g>/news``: the judge writes it when it names
a death (Note [judge once] in judge.py), and a member writes it as it leaves
for the next generation (Note [a peer gone to regroup] in peers.py) or stops.
The store answers that wait when the key is written; until then the thread
reads only the verdict, once a wait (``stale_after_s / 2``), to know that the
judges are alive (judges gone silent are then known within half a window of
their verdict going stale), and a collective's slice reads nothing. Once the news came,
or while the verdict is not fresh, the watch reads as before. The thread ends
with its generation: what ends it (the news, a member leaving, the member
stopping) writes the key, so it is never left waiting at exit. Over a file
store (the test harness's) there is no connection to give it: the watch reads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch.distributed as dist

from tandem.comm.thread_exit import join_before_exit
from tandem.control.roll_call import waited

__all__ = ["News"]

logger = logging.getLogger(__name__)

_STOP_JOIN_S = 1.0


class News:
    """A thread that waits for news of one generation (Note [news of a generation]).

    Args:
        store: a connection of its own to the job's store (its waits hold it).
        key: the generation's news key.
        fresh: reads the generation's verdict: whether its judges are alive.
        slice_s: the longest wait before the verdict is read again.
    """

    def __init__(self, store: dist.Store, key: str, fresh: Callable[[], bool], slice_s: float) -> None:
        self._store, self.key, self._fresh, self._slice_s = store, key, fresh, slice_s
        self._stop = threading.Event()
        # Nothing happened and the judges are alive, as of the thread's last look.
        self.quiet = False
        self._thread = threading.Thread(target=self._run, name=f"tandem-news-{key}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.quiet = self._fresh()
                if waited(self._store, [self.key], self._slice_s):
                    break
        except Exception as e:  # noqa: BLE001 - the store is gone: the watch reads (and says so)
            logger.debug("elastic: the news of %s stops: %s", self.key, e)
        self.quiet = False

    def stop(self, store: dist.Store, why: str) -> None:
        """End the thread, writing the news (``why``) in ``store`` to wake its wait."""
        self._stop.set()
        self.quiet = False
        if self._thread.is_alive():
            try:
                store.set(self.key, why)
            except Exception as e:  # noqa: BLE001 - the store is gone: the wait fails at once
                logger.debug("elastic: could not post %s: %s", self.key, e)
        join_before_exit(self._thread, _STOP_JOIN_S)  # Note [a store call in flight at exit]
