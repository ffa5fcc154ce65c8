"""Tables of spans and byte counts for notebooks and terminals."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hybridflow_lab.telemetry.spans import Span


def span_table(spans: Iterable[Span]) -> Any:
    """One row per span with start and duration in milliseconds, relative to the first span."""
    import pandas as pd

    spans = sorted(spans, key=lambda s: s.t_start)
    origin = spans[0].t_start if spans else 0.0
    return pd.DataFrame(
        [
            {"step": s.step, "group": s.group, "role": s.role, "name": s.name, "phase": s.phase.value,
             "rank": s.rank, "start_ms": round((s.t_start - origin) * 1e3, 2),
             "duration_ms": round(s.duration * 1e3, 2), "bytes": s.bytes_moved}
            for s in spans
        ],
        columns=["step", "group", "role", "name", "phase", "rank", "start_ms", "duration_ms", "bytes"],
    )


def format_bytes(count: float) -> str:
    """``512 B``, ``1.5 KB``, ``12.0 MB``: binary units, one decimal above bytes."""
    for unit in ("B", "KB", "MB"):
        if abs(count) < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GB"
