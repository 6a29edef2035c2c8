"""Several spawned groups at once, for tests that mostly wait.

A scenario that kills a rank spends most of its time waiting: for a heartbeat
to go stale, for a replacement to start. Run one after another, a module of
such scenarios costs the sum of their waits; :func:`start_concurrently` starts
them a few at a time in threads (each one a :func:`~tandem.testing.run_distributed`
call of its own, with its own directory, store, timeout and orphan check) and
hands back a future per scenario, so that each test still reads, and fails on,
its own::

    @pytest.fixture(scope="module")
    def scenarios():
        with start_concurrently({"shrink": lambda: run_distributed(...), ...}) as runs:
            yield runs

    def test_shrink(scenarios):
        results = scenarios["shrink"].result()  # its values, or its failure raised

The groups share the machine's cores: keep ``at_once`` small where a test
depends on timing (a staleness window of a second is many heartbeats).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

__all__ = ["start_concurrently"]

T = TypeVar("T")


@contextlib.contextmanager
def start_concurrently(calls: Mapping[str, Callable[[], T]], at_once: int = 3) -> Iterator[dict[str, Future[T]]]:
    """Start every call of ``calls``, ``at_once`` at a time, in order; yield
    their futures by name; on exit, wait for all of them."""
    if at_once < 1:
        raise ValueError(f"at_once must be >= 1, got {at_once}")
    pool = ThreadPoolExecutor(max_workers=at_once, thread_name_prefix="tandem-scenario")
    try:
        yield {name: pool.submit(call) for name, call in calls.items()}
    finally:
        pool.shutdown(wait=True)
