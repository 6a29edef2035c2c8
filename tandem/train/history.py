"""The records of a run: training loss every few steps, evaluation after each
epoch. Kept in memory (and in checkpoints, so a resumed run's plot is whole)
and mirrored line by line to ``metrics.jsonl`` on rank 0."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["History"]


class History:
    """A list of flat records, each with a ``kind`` ("train" or "eval")."""

    def __init__(self, path: Path | None, records: list[dict[str, Any]] | None = None,
                 sink: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.path = path
        self.sink = sink
        """Called with each record appended from now on (the TensorBoard log), where this rank writes."""
        self.records: list[dict[str, Any]] = list(records or [])
        if path is not None:
            # Rewritten whole: a resumed run drops what the interrupted one logged
            # after its last checkpoint, which the resumed run will log again.
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.records)

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if self.sink is not None:
                self.sink(record)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["kind"] == kind]

    def last(self, kind: str) -> dict[str, Any] | None:
        found = self.of_kind(kind)
        return found[-1] if found else None
