"""The controller's telemetry store: every span of a session, with listeners and sinks."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from hybridflow_lab.telemetry.spans import Phase, Span

Listener = Callable[[list[Span]], None]

# about 80 steps of the standard workload (25 spans a step on 2 ranks), a few MB: every view of recent steps has
# its spans, and a long run's controller stays flat; a sink (the run directory's spans.jsonl) keeps them all
MAX_SPANS_IN_MEMORY = 2_000


class TelemetryStore:
    """Thread-safe span store. Keeps the newest ``max_spans`` in memory; sinks and listeners see every span."""

    def __init__(self, max_spans: int = MAX_SPANS_IN_MEMORY) -> None:
        self._spans: deque[Span] = deque(maxlen=max_spans)
        self.recorded = 0  # every span recorded, those no longer in memory included
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._pollers: list[Callable[[], None]] = []
        self._local = threading.local()
        self._running: dict[int, Span] = {}  # stages started and not yet ended, by a key of their own
        self._running_listeners: list[Callable[[], None]] = []

    @property
    def step(self) -> int | None:
        """The step that spans recorded from this thread without one get (each thread has its own: stages of
        different steps can run at once)."""
        return getattr(self._local, "step", None)

    @step.setter
    def step(self, value: int | None) -> None:
        self._local.step = value

    def record(self, spans: Iterable[Span]) -> None:
        """Add spans; a span without a step gets the store's current step."""
        batch = [s if s.step is not None or self.step is None else replace(s, step=self.step) for s in spans]
        if not batch:
            return
        with self._lock:
            self._spans.extend(batch)
            self.recorded += len(batch)
            listeners = list(self._listeners)
        for listener in listeners:
            listener(batch)

    def spans(self, **where: Any) -> list[Span]:
        """Spans whose fields equal ``where`` (e.g. ``phase=Phase.EXECUTE, group="actor"``)."""
        self.poll()
        with self._lock:
            snapshot = list(self._spans)
        return [s for s in snapshot if all(getattr(s, k) == v for k, v in where.items())]

    def poll(self) -> None:
        """Ask the pollers (worker groups with results in flight) to deliver what has arrived."""
        for poller in list(self._pollers):
            poller()

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with each newly recorded list of spans; returns an unsubscribe function."""
        with self._lock:
            self._listeners.append(listener)
        return lambda: self._remove(self._listeners, listener)

    def add_poller(self, poller: Callable[[], None]) -> Callable[[], None]:
        self._pollers.append(poller)
        return lambda: self._remove(self._pollers, poller)

    def _remove(self, items: list[Any], item: Any) -> None:
        with self._lock:
            if item in items:
                items.remove(item)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    @property
    def max_spans(self) -> int:
        """How many spans the store keeps in memory (the newest)."""
        return self._spans.maxlen or 0

    def __len__(self) -> int:
        """The spans held in memory (at most ``max_spans``)."""
        return len(self._spans)

    @contextmanager
    def stage(self, name: str, **attrs: Any) -> Iterator[dict[str, Any]]:
        """Record a controller-side STAGE span around the body; the yielded dict adds attrs. While the body runs
        the stage is in ``running()``."""
        extra: dict[str, Any] = dict(attrs)
        start = time.time()
        key = id(extra)
        self._set_running(key, Span(name, Phase.STAGE, start, start, step=self.step, attrs=dict(attrs)))
        try:
            yield extra
        finally:
            moved = int(extra.pop("bytes_moved", 0))
            self._set_running(key, None)
            self.record([Span(name, Phase.STAGE, start, time.time(), bytes_moved=moved, attrs=extra)])

    def running(self) -> list[Span]:
        """The stages running now, as spans that end where they started."""
        with self._lock:
            return sorted(self._running.values(), key=lambda s: s.t_start)

    def subscribe_running(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener()`` whenever a stage starts or ends; returns an unsubscribe function."""
        with self._lock:
            self._running_listeners.append(listener)
        return lambda: self._remove(self._running_listeners, listener)

    def _set_running(self, key: int, span: Span | None) -> None:
        with self._lock:
            if span is None:
                self._running.pop(key, None)
            else:
                self._running[key] = span
            listeners = list(self._running_listeners)
        for listener in listeners:
            listener()

    def to_pandas(self) -> Any:
        """All spans as a DataFrame (one row per span)."""
        import pandas as pd

        return pd.DataFrame([s.to_dict() for s in self.spans()])


_default_store = TelemetryStore()


def default_store() -> TelemetryStore:
    """The process-wide store that worker groups use unless given another."""
    return _default_store
