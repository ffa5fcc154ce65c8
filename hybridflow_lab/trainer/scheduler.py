"""Running a step's stages at once where they can: one lane (thread) per resource pool and one for the controller.

A lane runs its stages in the order the dataflow called them, so models that share devices (colocated on
one pool) still take turns, while stages on different pools, and the controller's own computations, run
side by side. A stage waits for its inputs inside its lane; since it can only read stages called before
it, no lane ever waits for one queued behind it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from hybridflow_lab.dataflows.pending import StageFuture, StageNotRun

T = TypeVar("T")
CONTROLLER_LANE = "controller"


@dataclass(frozen=True)
class StageRun:
    """When one stage ran, on which lane (seconds on the controller's clock, ``time.time``)."""

    stage: str
    step: int
    lane: str
    t_start: float
    t_end: float

    def overlaps(self, other: StageRun) -> bool:
        return self.t_start < other.t_end and other.t_start < self.t_end


class StageScheduler:
    """Submits stages to lanes and waits for them (``drain``); ``runs`` says when each ran."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lanes: dict[str, ThreadPoolExecutor] = {}
        self._pending: list[StageFuture[Any]] = []  # what drain waits for
        self._running: list[StageFuture[Any]] = []  # every stage submitted and not done, detached ones too
        self.runs: list[StageRun] = []

    def submit(self, lane: str, future: StageFuture[T], job: Callable[[], T], detached: bool = False) -> None:
        """Run ``job`` as ``future``'s stage on ``lane``, after the stages submitted to it before; ``detached``:
        ``drain`` does not wait for it (generation running ahead of training: a later step reads it)."""
        if lane not in self._lanes:
            self._lanes[lane] = ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}:{lane}")
        self._lanes[lane].submit(future.run, job)
        self._running = [f for f in self._running if not f.done()] + [future]
        if not detached:
            self._pending.append(future)

    def record(self, run: StageRun) -> None:
        self.runs.append(run)

    def drain(self) -> None:
        """Wait for every submitted stage; raise the first failure in the order the stages were called (a stage
        that did not run because an earlier one failed gives way to that one)."""
        pending, self._pending = self._pending, []
        failures = [future.exception() for future in pending]
        errors = [error for error in failures if error is not None]
        if errors:
            raise next((e for e in errors if not isinstance(e, StageNotRun)), errors[0])

    def close(self) -> None:
        """Drop the stages still queued, wait for the running ones (each within its timeout) and stop the lanes'
        threads."""
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)
        for future in self._running:
            future.cancel()
        for future in self._running:
            future.exception()
        self._lanes = {}
        self._pending, self._running = [], []


def concurrent_stages(runs: list[StageRun]) -> dict[str, list[str]]:
    """For each stage of ``runs``, the other stages whose run overlapped its own (in time order)."""
    alongside: dict[str, list[str]] = {}
    for run in runs:
        others = [other.stage for other in runs if other is not run and other.stage != run.stage
                  and run.overlaps(other)]
        alongside.setdefault(run.stage, [])
        alongside[run.stage] += [s for s in others if s not in alongside[run.stage]]
    return alongside
