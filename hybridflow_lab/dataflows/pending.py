"""A stage's output while the stage may still be running: the one kind of future the dataflows pass around.

Called one at a time (a notebook cell per stage), a stage runs at once; inside ``lab.overlapped()`` (what
``lab.step()`` uses) it returns at once and runs on its lane when its inputs exist. Either way it is a
``StageFuture``: a batch stage's result reads as a batch (``PendingBatch``: ``batch["col"]`` waits for the
stage that writes ``col`` only), an update's as its metrics (``PendingMetrics``). Every stage declares the
columns it writes, so asking whether a batch has a column never waits. Every wait ends: a stage that runs
longer than its timeout raises ``StageTimeout`` naming it; one that cannot run because a stage it reads
failed raises ``StageNotRun``. Futures only point at stages called earlier, so they cannot form a cycle.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from typing import Any, Generic, TypeVar

from hybridflow_lab.protocol import DataBatch

T = TypeVar("T")
POLL_S = 0.5  # how often a wait looks at the clock of the stage it waits for


class StageNotRun(RuntimeError):
    """A stage that did not run because a stage it reads failed (or never ran)."""


class StageTimeout(TimeoutError):
    """A stage that ran longer than its timeout (``trainer.stage_timeout_s``)."""


class StageFuture(Generic[T]):
    """Stage ``stage`` of step ``step`` running on ``where`` (a lane, a group): ``result()`` waits for it, and raises
    ``StageTimeout`` once it has run ``timeout_s`` seconds without finishing (time queued behind other stages does
    not count: they have timeouts of their own)."""

    def __init__(self, stage: str, step: int, where: str, timeout_s: float) -> None:
        self.stage, self.step, self.where, self.timeout_s = stage, step, where, timeout_s
        self.future: Future[T] = Future()
        self.started: float | None = None

    @classmethod
    def finished(cls, stage: str, step: int, value: T) -> StageFuture[T]:
        """A stage that already ran (called outside ``overlapped()``)."""
        done: StageFuture[T] = cls(stage, step, "", 0.0)
        done.future.set_result(value)
        return done

    def run(self, job: Callable[[], T]) -> None:
        """Run ``job`` as the stage (on its lane's thread): its result or error is the future's. A stage cancelled
        while queued (``cancel``) does not run."""
        if not self.future.set_running_or_notify_cancel():
            return
        self.started = time.monotonic()
        try:
            self.future.set_result(job())
        except BaseException as error:
            self.future.set_exception(error)

    def done(self) -> bool:
        return self.future.done()

    def cancel(self) -> bool:
        """Drop the stage if it has not started (True); a running stage goes on."""
        return self.future.cancel()

    def result(self) -> T:
        while not wait_for([self.future], timeout=POLL_S).done:
            if self.started is not None and time.monotonic() - self.started > self.timeout_s:
                raise StageTimeout(f"the {self.stage!r} stage of step {self.step} ({self.where}) did not finish "
                                   f"within trainer.stage_timeout_s={self.timeout_s:g} s; its worker calls name the "
                                   "ranks that did not answer")
        return self.future.result()

    def exception(self) -> BaseException | None:
        """The stage's error once it ended (waiting as ``result`` does), None when it succeeded."""
        try:
            self.result()
        except BaseException as error:
            return error
        return None

    def output(self) -> T:
        """``result()``, with a failure re-raised as ``StageNotRun`` for the stages that read this one (a timeout
        stays a ``StageTimeout``)."""
        try:
            return self.result()
        except (StageNotRun, StageTimeout):
            raise
        except BaseException as error:
            raise StageNotRun(f"the {self.stage!r} stage of step {self.step} failed ({type(error).__name__}: "
                              f"{error}), so its output cannot be read") from error


class PendingMetrics(Mapping[str, float]):
    """An update stage's metrics: ``metrics["actor/pg_loss"]`` waits for the update, and so does ``dict(metrics)``;
    displayed (and ``summary``) as the stage's summary with its metrics once it finished."""

    def __init__(self, future: StageFuture[dict[str, float]]) -> None:
        self.future = future

    def __getitem__(self, key: str) -> float:
        return self.future.output()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.future.output())

    def __len__(self) -> int:
        return len(self.future.output())

    def done(self) -> bool:
        """Whether the update has finished (never blocks)."""
        return self.future.done()

    @property
    def summary(self) -> Any:
        """The stage's ``StageSummary`` (waiting for the update)."""
        return getattr(self.future.output(), "summary", None)

    def _repr_html_(self) -> str:
        metrics = self.future.output()
        return metrics._repr_html_() if hasattr(metrics, "_repr_html_") else repr(metrics)

    def __repr__(self) -> str:
        if not self.future.done():
            return f"PendingMetrics({self.future.stage!r} of step {self.future.step}, pending)"
        return repr(self.future.output())


class PendingBatch:
    """``base`` (what the stage was given; None for a stage that makes a new batch) and the columns ``writes``
    that the stage adds when ``added`` resolves. ``replaces``: the stage rewrites columns ``base`` has
    (``DataBatch.assign``), instead of adding new ones.

    It reads like a ``DataBatch``: ``batch["col"]`` waits for the stage that writes ``col`` only, ``"col" in
    batch`` never waits, ``len(batch)``, ``batch["col"] = value``; ``result()`` waits for everything."""

    def __init__(self, base: DataBatch | PendingBatch | None, added: StageFuture[DataBatch], writes: Iterable[str],
                 replaces: bool = False) -> None:
        self._base, self._added = base, added
        self.writes = frozenset(writes)
        self._replaces = replaces
        self._assigned: dict[str, Any] = {}  # columns set on the controller (``batch["col"] = value``)
        self._result: DataBatch | None = None

    @property
    def stage(self) -> str:
        return self._added.stage

    def _owner(self, key: str) -> PendingBatch | DataBatch | None:
        """The link of the chain that provides ``key`` (without waiting), or None when no stage wrote it."""
        link: DataBatch | PendingBatch | None = self
        while isinstance(link, PendingBatch):
            if key in link._assigned or key in link.writes:
                return link
            link = link._base
        return link if link is not None and key in link else None

    def column(self, key: str) -> Any:
        """The column ``key``, waiting only for the stage that writes it."""
        owner = self._owner(key)
        if owner is None:
            raise KeyError(f"no stage up to {self.stage!r} (step {self._added.step}) produced a column {key!r}")
        if isinstance(owner, DataBatch):
            return owner[key]
        if key in owner._assigned:
            return owner._assigned[key]
        return owner._added.output()[key]

    def select(self, *keys: str) -> DataBatch:
        """The columns ``keys`` as a batch, waiting only for the stages that write them."""
        return DataBatch.from_dict({key: self.column(key) for key in keys}, self._root().meta)

    def __getitem__(self, key: Any) -> Any:
        return self.column(key) if isinstance(key, str) else self.result()[key]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._owner(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        return self.column(key) if key in self else default

    def _root(self) -> DataBatch:
        """The batch the chain starts from (waiting for the stage that made it)."""
        root: DataBatch | PendingBatch | None = self
        while isinstance(root, PendingBatch) and root._base is not None:
            root = root._base
        if isinstance(root, PendingBatch):
            return root._added.output()
        return root if root is not None else DataBatch()

    def __len__(self) -> int:
        return len(self._root())

    def __setitem__(self, key: str, value: Any) -> None:
        self._assigned[key] = value
        self._result = None

    def done(self) -> bool:
        """Whether this stage and every stage before it have finished (never blocks)."""
        base_done = not isinstance(self._base, PendingBatch) or self._base.done()
        return self._added.done() and base_done

    def result(self) -> DataBatch:
        """The whole batch, once every stage it comes from has finished."""
        if self._result is None:
            added = self._added.output()
            if self._base is None:
                batch = added
            else:
                base = resolve(self._base)
                batch = base.assign(added) if self._replaces else base.union(added)
            for key, value in self._assigned.items():
                batch[key] = value
            batch.summary = added.summary
            self._result = batch
        return self._result

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"PendingBatch({self.stage!r} of step {self._added.step}, {state})"


Batch = DataBatch | PendingBatch  # what a stage takes


def resolve(batch: Batch) -> DataBatch:
    """``batch`` itself, or the finished batch a ``PendingBatch`` stands for (waiting for it)."""
    return batch.result() if isinstance(batch, PendingBatch) else batch
