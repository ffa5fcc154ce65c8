"""The span: one timed piece of work, recorded by the controller or by a worker rank."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

CONTROLLER_RANK = -1


class Phase(StrEnum):
    """What a span measures."""

    CALL = "call"  # a whole registered call, seen from the controller
    DISPATCH = "dispatch"  # splitting arguments and submitting them to the ranks
    EXECUTE = "execute"  # one rank running the method (worker clock, aligned to the controller)
    COLLECT = "collect"  # waiting for and merging the ranks' results
    STAGE = "stage"  # an algorithm stage (generate, reward, update_actor, ...)
    TRANSFER = "transfer"  # data moving between groups or layouts (fetching another group's rows, resharding)
    WORKER = "worker"  # a span a worker method records itself (forward, decode, ...)


@dataclass(frozen=True, slots=True)
class Span:
    """``name`` ran from ``t_start`` to ``t_end`` (unix seconds, controller clock) and moved ``bytes_moved``."""

    name: str
    phase: Phase
    t_start: float
    t_end: float
    group: str = ""
    role: str = ""
    rank: int = CONTROLLER_RANK
    step: int | None = None
    bytes_moved: int = 0
    call_id: int = 0
    attrs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.t_end - self.t_start

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["phase"] = self.phase.value
        record["attrs"] = dict(self.attrs)
        return record

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> Span:
        return cls(**{**record, "phase": Phase(record["phase"]), "attrs": dict(record.get("attrs") or {})})


class SpanRecorder:
    """Collects spans inside one process (a worker rank) until the host ships them to the controller."""

    def __init__(self) -> None:
        self._spans: list[Span] = []

    @contextmanager
    def span(self, name: str, bytes_moved: int = 0, phase: Phase = Phase.WORKER,
             **attrs: Any) -> Iterator[dict[str, Any]]:
        """Time the body; the yielded dict may be filled with attrs (``bytes_moved`` included)."""
        extra: dict[str, Any] = dict(attrs)
        start = time.time()
        try:
            yield extra
        finally:
            moved = int(extra.pop("bytes_moved", bytes_moved))
            self._spans.append(Span(name, phase, start, time.time(), bytes_moved=moved, attrs=extra))

    def record(self, span: Span) -> None:
        self._spans.append(span)

    def drain(self) -> list[Span]:
        spans, self._spans = self._spans, []
        return spans
