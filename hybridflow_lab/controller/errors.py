"""Errors that cross the controller/worker boundary."""

from __future__ import annotations

from collections.abc import Sequence


class WorkerCallError(RuntimeError):
    """A worker rank failed while running a registered method (or its constructor).

    Carries the group, role, rank and method, the remote error and its traceback; ``others``
    lists further ranks that failed in the same call and ``still_running`` the ranks that had
    not finished when the failure was reported (peers blocked in a collective, typically).
    """

    def __init__(
        self,
        group: str,
        role: str,
        rank: int,
        method: str,
        error: str,
        remote_traceback: str = "",
        others: Sequence[int] = (),
        still_running: Sequence[int] = (),
    ) -> None:
        super().__init__(group, role, rank, method, error, remote_traceback, tuple(others), tuple(still_running))
        self.group, self.role, self.rank, self.method = group, role, rank, method
        self.error, self.remote_traceback = error, remote_traceback
        self.others, self.still_running = tuple(others), tuple(still_running)

    def with_others(self, others: Sequence[int], still_running: Sequence[int] = ()) -> WorkerCallError:
        return WorkerCallError(self.group, self.role, self.rank, self.method, self.error, self.remote_traceback,
                               others, still_running)

    def __str__(self) -> str:
        also = f" (ranks {', '.join(map(str, self.others))} failed too)" if self.others else ""
        text = (
            f"worker group {self.group!r}, role {self.role!r}, rank {self.rank} failed in "
            f"{self.method!r}{also}: {self.error}"
        )
        if self.still_running:
            text += (f"\nranks {', '.join(map(str, self.still_running))} were still running (waiting in a "
                     "collective?); shut the group down or rebuild it")
        if self.remote_traceback:
            text += f"\n--- traceback from rank {self.rank} ---\n{self.remote_traceback.rstrip()}"
        return text


class WorkerCallTimeout(WorkerCallError):
    """Ranks that did not answer a call within the group's ``call_timeout_s``: hung, or blocked in a collective."""

    def __init__(self, group: str, role: str, method: str, timeout_s: float, silent: Sequence[int]) -> None:
        error = f"no answer within {timeout_s:g} s"
        WorkerCallError.__init__(self, group, role, silent[0], method, error, still_running=silent)
        self.args = (group, role, method, timeout_s, tuple(silent))
        self.timeout_s = timeout_s

    def __str__(self) -> str:
        several = len(self.still_running) > 1
        return (f"worker group {self.group!r}, role {self.role!r}: rank{'s' if several else ''} "
                f"{', '.join(map(str, self.still_running))} did not answer {self.method!r} within {self.timeout_s:g} s "
                f"(the group's call timeout, trainer.stage_timeout_s in a Lab); {'they are' if several else 'it is'} "
                "still running (hung, or waiting in a collective for a peer): shut the group down or rebuild it")


class WorkerGroupClosed(RuntimeError):
    """A call on a worker group that was shut down or replaced."""
