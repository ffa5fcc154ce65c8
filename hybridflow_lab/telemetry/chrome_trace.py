"""Spans as a Chrome trace (the JSON that Perfetto and chrome://tracing open): one process per worker group and
one for the controller, one thread per rank (the controller's per lane), one complete event per span."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hybridflow_lab.telemetry.spans import Phase, Span

CONTROLLER = "controller"


def chrome_trace(spans: Iterable[Span]) -> dict[str, Any]:
    """The trace: ``traceEvents`` (``ph: X`` events in microseconds from the first span, with the span's step,
    phase, bytes and attributes as ``args``) and the names of its processes and threads (``ph: M``)."""
    spans = sorted(spans, key=lambda s: s.t_start)
    origin = spans[0].t_start if spans else 0.0
    processes: dict[str, int] = {}
    threads: dict[tuple[int, str], int] = {}
    events: list[dict[str, Any]] = []
    for span in spans:
        process, thread = _where(span)
        pid = processes.setdefault(process, len(processes) + 1)
        tid = threads.setdefault((pid, thread), len(threads) + 1)
        events.append({"name": span.name, "cat": span.phase.value, "ph": "X", "pid": pid, "tid": tid,
                       "ts": round((span.t_start - origin) * 1e6, 1), "dur": round(span.duration * 1e6, 1),
                       "args": {"step": span.step, "bytes": span.bytes_moved, **span.attrs}})
    names = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}} for name, pid in processes.items()]
    names += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
              for (pid, name), tid in threads.items()]
    return {"traceEvents": names + events, "displayTimeUnit": "ms"}


def _where(span: Span) -> tuple[str, str]:
    """(process, thread): the controller with its stages (a thread per lane when they overlapped) and its calls
    to the worker groups, else the worker group and the rank."""
    if span.phase is Phase.STAGE:
        return CONTROLLER, f"stages ({span.attrs['lane']})" if span.attrs.get("lane") else "stages"
    if span.rank < 0:
        return CONTROLLER, "calls"
    return span.group.rsplit(".", 1)[-1] or span.role or "group", f"rank {span.rank}"
