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
The store answers that wait when the key is written, and until then a
collective's slice reads nothing but, once every half window, the verdict, to
know that the judges are alive. Once the news came, or while the verdict is
not fresh, the watch reads as before. The wait has no timeout to speak of (a
day): c10d logs two warnings for every wait that times out. The thread ends
with its generation: what ends it (the news, a member leaving, the member
stopping, at the latest at exit) writes the key, so it is never left waiting.
Over a file store (the test harness's) there is no connection to give it: the
watch reads.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref

import torch.distributed as dist

from tandem.comm.thread_exit import join_before_exit
from tandem.control.roll_call import waited

__all__ = ["News"]

logger = logging.getLogger(__name__)

_STOP_JOIN_S = 1.0
_FOREVER_S = 86400.0  # a wait that does not time out (Note [news of a generation])


class News:
    """A thread that waits for news of one generation (Note [news of a generation]).

    Args:
        store: a connection of its own to the job's store (its wait holds it).
        key: the generation's news key.
        wake: another client of the store, which writes the key when the
            thread is stopped (at the latest at exit).
    """

    def __init__(self, store: dist.Store, key: str, wake: dist.Store) -> None:
        self._store, self.key, self._wake = store, key, wake
        self._stop = threading.Event()
        _LIVE.add(self)
        self.heard = False  # the key was written, or the wait failed: the watch reads
        self._thread = threading.Thread(target=self._run, name=f"tandem-news-{key}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and not waited(self._store, [self.key], _FOREVER_S):
                pass
        except Exception as e:  # noqa: BLE001 - the store is gone: the watch reads (and says so)
            logger.debug("elastic: the news of %s stops: %s", self.key, e)
        self.heard = True

    def stop(self, why: str) -> None:
        """End the thread, writing the news (``why``) to wake its wait."""
        self._stop.set()
        self.heard = True
        _LIVE.discard(self)
        if self._thread.is_alive():
            try:
                self._wake.set(self.key, why)
            except Exception as e:  # noqa: BLE001 - the store is gone: the wait fails at once
                logger.debug("elastic: could not post %s: %s", self.key, e)
        join_before_exit(self._thread, _STOP_JOIN_S)  # Note [a store call in flight at exit]


_LIVE: weakref.WeakSet[News] = weakref.WeakSet()  # the threads not stopped yet


@atexit.register
def _stop_at_exit() -> None:
    """Wake every news thread still waiting before the interpreter finalizes: a
    member not stopped (a script that raised before its atexit) leaves none in
    a wait (Note [a store call in flight at exit] in tandem/comm/thread_exit.py)."""
    for news in list(_LIVE):
        news.stop("stopped")
