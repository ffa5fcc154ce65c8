"""How the Lab runs a stage: timed into its step, its spans collected, blocking or overlapped.

Called one at a time (a notebook cell per stage), a stage runs at once and returns its batch. Inside
``overlapped()`` (what ``lab.step()`` uses) it returns at once instead (a ``PendingBatch``; see
``dataflows.pending``), while the stage runs on its lane (``scheduler``) as soon as the columns it reads
exist. Either way the same stages run on the same inputs with the same seeds, so a step's numbers do
not depend on whether its stages overlapped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

from hybridflow_lab.controller import WorkerCallError
from hybridflow_lab.dataflows import StepContext
from hybridflow_lab.dataflows.pending import Batch, PendingBatch, StageFuture, StageNotRun, resolve
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.telemetry import WHOLE_BATCH, StageSummary, TelemetryStore
from hybridflow_lab.trainer.scheduler import CONTROLLER_LANE, StageRun, StageScheduler, concurrent_stages
from hybridflow_lab.trainer.stages import Stage, model_of

T = TypeVar("T")


class StageRunner:
    """Runs the Lab's stages; ``summaries`` keeps the summary of each stage of the last overlapped scope, with
    the stages that ran alongside it (``StageSummary.concurrent``)."""

    def __init__(self, name: str, telemetry: TelemetryStore, on_worker_error: Callable[[WorkerCallError, str], None],
                 timeout_s: float) -> None:
        self.telemetry = telemetry
        self.timeout_s = timeout_s  # how long a stage may run (StageFuture)
        self._on_worker_error = on_worker_error
        self._scheduler = StageScheduler(name)
        self._local = threading.local()
        self.overlapping = False
        self.summaries: list[StageSummary] = []

    def current_step(self) -> StepContext | None:
        """The step of the stage running in this thread (None outside a stage)."""
        return getattr(self._local, "step", None)

    @contextmanager
    def timed(self, stage: Stage, step: StepContext, lane: str = "", pool: str = CONTROLLER_LANE,
              reads: Sequence[str] = ()) -> Iterator[StageSummary]:
        """Time a stage into ``step`` (``timing_s/<stage>``, a STAGE span on ``lane`` when overlapped) and collect the
        spans of its worker calls into a ``StageSummary``. The span says what the dataflow graph draws: the stage's
        ``pool`` (its lane), its ``model``, the columns it ``reads`` (``WHOLE_BATCH``: all of them) and those it wrote,
        with their sizes."""
        summary = StageSummary(stage.value, step.index)
        self.telemetry.step = step.index  # this thread's: stamps this stage's spans and its worker calls' spans
        thread, calls = threading.get_ident(), set()

        def collect(spans: list[Any]) -> None:  # this stage's calls only, while other stages run beside it
            mine = threading.get_ident() == thread
            calls.update(span.call_id for span in spans if mine and span.call_id)
            summary.spans.extend(span for span in spans if mine or span.call_id in calls)

        unsubscribe = self.telemetry.subscribe(collect)
        outer, self._local.step = self.current_step(), step
        start, started = time.perf_counter(), time.time()
        graph = {"pool": pool, "model": model_of(stage, pool), "reads": list(reads)}
        try:
            with self.telemetry.stage(stage.value, **graph, **({"lane": lane} if lane else {})) as attrs:
                yield summary
                attrs.update(writes=summary.columns, moved=summary.bytes_moved)
                environment = summary.environment
                if environment:
                    attrs["environment"] = environment
        except WorkerCallError as error:
            self._on_worker_error(error, stage.value)
            raise
        finally:
            unsubscribe()
            self._local.step = outer
            summary.seconds = time.perf_counter() - start
            self.summaries.append(summary)
            self._scheduler.record(StageRun(stage.value, step.index, lane, started, time.time()))
        step.count(f"timing_s/{stage.value}", summary.seconds)

    def batch_stage(self, stage: Stage, step: StepContext, lane: str, batch: Batch | None,
                    body: Callable[[DataBatch], DataBatch], reads: Sequence[str] | None = None,
                    writes: Iterable[str] = (), optional: Sequence[str] = (), replaces: bool = False,
                    detached: bool = False, after: StageFuture[Any] | None = None) -> Batch:
        """Run ``body`` on ``batch``'s columns ``reads`` (None: the whole batch), and those of ``optional`` it has,
        and add the columns ``writes`` it returns (``replaces``: it rewrites existing ones); ``batch`` None: ``body``
        makes a new batch. Inside ``overlapped()``, a ``PendingBatch`` at once; else the batch."""
        added = self.call_stage(stage, step, lane, batch, reads, lambda rows, summary: summary.attach(body(rows)),
                                optional, detached, after)
        if self.overlapping:
            return PendingBatch(batch, added, writes, replaces)
        output = added.result()
        if batch is None:
            return output
        merged = resolve(batch).assign(output) if replaces else resolve(batch).union(output)
        merged.summary = output.summary
        return merged

    def call_stage(self, stage: Stage, step: StepContext, lane: str, batch: Batch | None,
                   reads: Sequence[str] | None, job: Callable[[DataBatch, StageSummary], T],
                   optional: Sequence[str] = (), detached: bool = False,
                   after: StageFuture[Any] | None = None) -> StageFuture[T]:
        """``job(rows, summary)`` on ``batch``'s columns ``reads`` and those of ``optional`` it has, timed as
        ``stage``: now (a finished future), or inside ``overlapped()`` on ``lane`` once those columns exist and
        ``after`` has finished (``detached``: leaving ``overlapped()`` does not wait for it)."""
        span_lane = lane if self.overlapping else ""
        shown = [*reads, *optional] if reads is not None else [WHOLE_BATCH] if batch is not None else []

        def run() -> T:
            rows = _inputs(batch, reads, optional, stage)  # waiting for them is not the stage's time
            if after is not None:
                _wait(after, stage)
            with self.timed(stage, step, span_lane, lane, shown) as summary:
                return job(rows, summary)

        if not self.overlapping:
            return StageFuture.finished(stage.value, step.index, run())
        future: StageFuture[T] = StageFuture(stage.value, step.index, lane, self.timeout_s)
        self._scheduler.submit(lane, future, run, detached)
        return future

    @contextmanager
    def overlapped(self, enabled: bool = True) -> Iterator[None]:
        """Stages called inside return at once and run on their lanes; leaving waits for all of them and raises
        the first failure. ``enabled=False``: the same calls, each run as it is called (for comparison)."""
        if self.overlapping:
            raise RuntimeError("stages are already overlapping (lab.overlapped() inside another, or inside "
                               "lab.step()); leave the outer one first")
        self.overlapping, self.summaries = enabled, []
        self._scheduler.runs.clear()
        try:
            yield
        except StageNotRun:  # the dataflow read a stage that failed: raise that failure, the root cause
            self.overlapping = False
            self._scheduler.drain()
            raise
        except BaseException:
            self.overlapping = False
            with suppress(BaseException):  # the stages already running finish; the body's error is the one raised
                self._scheduler.drain()
            raise
        self.overlapping = False
        self._scheduler.drain()
        alongside = concurrent_stages(self._scheduler.runs)
        for summary in self.summaries:
            summary.concurrent = alongside.get(summary.stage, [])

    def close(self) -> None:
        self._scheduler.close()


def _wait(future: StageFuture[Any], stage: Stage) -> None:
    try:
        future.result()
    except BaseException as error:
        raise StageNotRun(f"the {stage.value!r} stage did not run: what it follows failed ({type(error).__name__}: "
                          f"{error})") from error


def _inputs(batch: Batch | None, reads: Sequence[str] | None, optional: Sequence[str], stage: Stage) -> DataBatch:
    if batch is None:
        return DataBatch()
    try:
        if reads is None:
            return resolve(batch)
        return batch.select(*reads, *(key for key in optional if key in batch))
    except StageNotRun as error:
        raise StageNotRun(f"the {stage.value!r} stage did not run: {error}") from error
    except KeyError as error:
        raise KeyError(f"the {stage.value!r} stage reads columns {list(reads)}: {error.args[0]}; call the "
                       "stage that computes it first") from None


def lane_of(pool: str | None) -> str:
    """The lane of a stage on the worker group of resource pool ``pool`` (None: a controller computation)."""
    return CONTROLLER_LANE if pool is None else f"pool {pool}"
