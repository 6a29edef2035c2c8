"""A test resource that a ``with`` block starts and always closes: nodes as
network namespaces, etcd members. If ``start`` fails part way, what it had
started is closed before the error goes on, so that nothing outlives the test."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["StartAndClose"]

_Resource = TypeVar("_Resource", bound="StartAndClose")


class StartAndClose:
    """``with resource:`` calls :meth:`start`, and :meth:`close` at the end or
    when ``start`` raised; a subclass defines both, ``close`` safe after a
    partial start."""

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Resource) -> _Resource:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
