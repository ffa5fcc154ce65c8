"""A stage's output while the stage may still be running: how an overlapped dataflow passes futures.

In an overlapped ``lab.step()`` every stage returns at once. Its result is a ``PendingBatch``: the batch the
stage was given plus the columns it adds (``writes``) once it finishes. A stage handed a ``PendingBatch``
waits only for the columns it reads, so stages that read the same columns run at the same time (the
critic's values beside the reference's log-probs) and a dataflow written top to bottom overlaps by itself.
Futures only ever point at stages called earlier, so they cannot form a cycle.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from hybridflow_lab.protocol import DataBatch


class StageNotRun(RuntimeError):
    """A stage that did not run because a stage it reads failed (or never ran)."""


class PendingBatch:
    """``base`` (what the stage was given; None for a stage that makes a new batch) and the columns the stage
    ``stage`` of step ``step`` adds when ``added`` resolves: ``writes`` (None: every column, a new batch).
    ``replaces``: the stage rewrites columns ``base`` has (``DataBatch.assign``), instead of adding new ones.

    It reads like a ``DataBatch``: ``batch["col"]`` waits for the stage that writes ``col`` only, ``"col" in
    batch``, ``len(batch)``, ``batch["col"] = value``; ``result()`` waits for everything."""

    def __init__(self, stage: str, step: int, base: DataBatch | PendingBatch | None, added: Future[DataBatch],
                 writes: Iterable[str] | None, replaces: bool = False) -> None:
        self.stage, self.step = stage, step
        self._base, self._added = base, added
        self.writes = None if writes is None else frozenset(writes)
        self._replaces = replaces
        self._assigned: dict[str, Any] = {}  # columns set on the controller (``batch["col"] = value``)
        self._result: DataBatch | None = None

    # ------------------------------------------------------------------ reading
    def _stage_output(self) -> DataBatch:
        try:
            return self._added.result()
        except StageNotRun:
            raise
        except BaseException as error:
            raise StageNotRun(f"the {self.stage!r} stage of step {self.step} failed ({type(error).__name__}: "
                              f"{error}), so its batch cannot be read") from error

    def _owner(self, key: str) -> PendingBatch | DataBatch | None:
        """The link of the chain that provides ``key`` (without waiting), or None when no stage wrote it."""
        link: DataBatch | PendingBatch | None = self
        while isinstance(link, PendingBatch):
            if key in link._assigned or link.writes is None or key in link.writes:
                return link
            link = link._base
        return link if link is not None and key in link else None

    def column(self, key: str) -> Any:
        """The column ``key``, waiting only for the stage that writes it."""
        owner = self._owner(key)
        if owner is None:
            raise KeyError(f"no stage before {self.stage!r} (step {self.step}) produced a column {key!r}")
        if isinstance(owner, DataBatch):
            return owner[key]
        if key in owner._assigned:
            return owner._assigned[key]
        return owner._stage_output()[key]

    def select(self, *keys: str) -> DataBatch:
        """The columns ``keys`` as a batch, waiting only for the stages that write them."""
        columns = {key: self.column(key) for key in keys}
        return DataBatch.from_dict(columns, self._root().meta)

    def __getitem__(self, key: Any) -> Any:
        return self.column(key) if isinstance(key, str) else self.result()[key]

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        owner = self._owner(key)
        if isinstance(owner, PendingBatch) and owner.writes is None and key not in owner._assigned:
            return key in owner._stage_output()  # a new batch: its columns are known once it exists
        return owner is not None

    def get(self, key: str, default: Any = None) -> Any:
        return self.column(key) if key in self else default

    def _root(self) -> DataBatch:
        """The batch the chain starts from (waiting for the stage that made it)."""
        root: DataBatch | PendingBatch | None = self
        while isinstance(root, PendingBatch) and root.writes is not None:
            root = root._base
        if isinstance(root, PendingBatch):
            return root._stage_output()
        return root if root is not None else DataBatch()

    def __len__(self) -> int:
        return len(self._root())

    def __setitem__(self, key: str, value: Any) -> None:
        self._assigned[key] = value
        self._result = None

    # ---------------------------------------------------------------- resolving
    def done(self) -> bool:
        """Whether this stage and every stage before it have finished (never blocks)."""
        base_done = not isinstance(self._base, PendingBatch) or self._base.done()
        return self._added.done() and base_done

    def result(self) -> DataBatch:
        """The whole batch, once every stage it comes from has finished."""
        if self._result is None:
            added = self._stage_output()
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
        return f"PendingBatch({self.stage!r} of step {self.step}, {state})"


Batch = DataBatch | PendingBatch  # what a stage takes


def resolve(batch: Batch) -> DataBatch:
    """``batch`` itself, or the finished batch a ``PendingBatch`` stands for (waiting for it)."""
    return batch.result() if isinstance(batch, PendingBatch) else batch
