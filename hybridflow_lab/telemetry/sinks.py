"""Span sinks: JSONL files that the dashboard, progress bars and benchmarks read back."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from hybridflow_lab.telemetry.spans import Span
from hybridflow_lab.telemetry.store import TelemetryStore


class JsonlSink:
    """Appends every span recorded in a store to ``path``, one JSON object per line."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self._unsubscribe = lambda: None

    def attach(self, store: TelemetryStore) -> JsonlSink:
        self._unsubscribe = store.subscribe(self.write)
        return self

    def write(self, spans: list[Span]) -> None:
        lines = "".join(json.dumps(s.to_dict(), default=str) + "\n" for s in spans)
        with self._lock:
            self._file.write(lines)
            self._file.flush()

    def close(self) -> None:
        self._unsubscribe()
        with self._lock:
            self._file.close()


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[Span]:
    """Spans from a JSONL file; a torn last line (a writer still running) is skipped."""
    with Path(path).open(encoding="utf-8") as handle:
        for line in handle:
            if line.endswith("\n"):
                yield Span.from_dict(json.loads(line))
