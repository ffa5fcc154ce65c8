"""Follow a run directory's JSONL files (spans, metrics, samples) while a run may still write them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hybridflow_lab.telemetry import Span


class JsonlTail:
    """Reads the complete lines appended to a file since the last ``read``; starts over when the file was
    replaced or shrank (a resumed or restarted run rewrites its metrics)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.inode: int | None = None

    def read(self) -> tuple[list[dict[str, Any]], bool]:
        """``(new records, restarted)``: restarted means earlier records are void and these are all of them."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return [], False
        size = stat.st_size
        restarted = self.offset > 0 and (size < self.offset or stat.st_ino != self.inode)
        self.inode = stat.st_ino
        if restarted:
            self.offset = 0
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            chunk = handle.read(size - self.offset)
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a torn last line waits for the writer
        self.offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()], restarted


class RunFiles:
    """The spans, metrics and sample rows of a run directory, kept up to date by ``poll``."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self.spans: list[Span] = []
        self.metrics: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self._tails = {name: JsonlTail(self.run_dir / f"{name}.jsonl") for name in ("spans", "metrics", "samples")}

    def poll(self) -> bool:
        """Read what was appended since the last poll; True when anything changed."""
        changed = False
        for name, tail in self._tails.items():
            records, restarted = tail.read()
            if restarted:
                getattr(self, name).clear()
                changed = True
            if records:
                parse = Span.from_dict if name == "spans" else dict
                getattr(self, name).extend(parse(r) for r in records)
                changed = True
        return changed
