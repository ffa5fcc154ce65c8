"""Calling a reward function written by a user: errors, non-finite scores and hangs under a policy.

``task.reward_on_error`` says what a bad row does: ``fail`` raises ``RewardFunctionError`` showing the
row, ``zero`` scores it 0 and counts it (``reward/errors``, ``reward/nonfinite``, ``reward/timeouts``).
With ``task.reward_timeout_s`` > 0 the function runs in a forked child process that is killed when one
row takes longer than that (a thread cannot be stopped); the remaining rows go to a fresh child.
"""

from __future__ import annotations

import math
import multiprocessing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from hybridflow_lab.config.schema import TaskConfig

RewardFn = Callable[[str, str, Any], float]
Row = tuple[str, str, Any]  # prompt, response, ground truth
Outcome = tuple[str, Any]  # ("ok", score) | ("error", what happened) | ("timeout", None)
FAILURE_KINDS = ("errors", "nonfinite", "timeouts")


class RewardFunctionError(RuntimeError):
    """A reward function raised, returned a non-finite score or hung on a row (the message shows the row)."""


@dataclass(frozen=True)
class RewardGuard:
    """How rows a reward function cannot score are handled (see the module docstring)."""

    on_error: str = "fail"
    timeout_s: float = 0.0

    @classmethod
    def from_config(cls, task: TaskConfig) -> RewardGuard:
        """The guard ``task.reward_on_error`` and ``task.reward_timeout_s`` describe (checked by ``validate``)."""
        return cls(task.reward_on_error, task.reward_timeout_s)

    def scores(self, fn: RewardFn, rows: Sequence[Row]) -> tuple[list[float], dict[str, int]]:
        """Each row's score (0 for a bad row under ``zero``) and the count of bad rows of each kind."""
        outcomes = _in_child(fn, rows, self.timeout_s) if self.timeout_s > 0 else [_call(fn, row) for row in rows]
        scores, counts = [], dict.fromkeys(FAILURE_KINDS, 0)
        for index, (row, (kind, value)) in enumerate(zip(rows, outcomes, strict=True)):
            if kind == "ok" and math.isfinite(value):
                scores.append(value)
                continue
            kind, problem = self._problem(kind, value)
            if self.on_error == "fail":
                raise RewardFunctionError(
                    f"the reward function {getattr(fn, '__name__', fn)!r} {problem} on row {index}: "
                    f"{_show(row)}; fix the function, or set task.reward_on_error=zero to score such rows 0 "
                    f"and count them (reward/{kind})")
            counts[kind] += 1
            scores.append(0.0)
        return scores, counts

    def _problem(self, kind: str, value: Any) -> tuple[str, str]:
        """The failure counter and what went wrong, for an outcome that is not a finite score."""
        if kind == "ok":
            return "nonfinite", f"returned {value}"
        if kind == "timeout":
            return "timeouts", f"did not return within task.reward_timeout_s={self.timeout_s} s"
        return "errors", value


FAIL_ON_ERROR = RewardGuard()


def _call(fn: RewardFn, row: Row) -> Outcome:
    try:
        return "ok", float(fn(*row))
    except Exception as exc:  # the user's function may raise anything; the policy decides
        return "error", f"raised {type(exc).__name__}: {exc}"


def _show(row: Row, limit: int = 200) -> str:
    prompt, response, truth = (repr(str(part)[:limit]) for part in row)
    return f"prompt {prompt}, response {response}, ground truth {truth}"


def _score_rows(fn: RewardFn, rows: Sequence[Row], send: Connection) -> None:
    for row in rows:
        send.send(_call(fn, row))
    send.close()


def _in_child(fn: RewardFn, rows: Sequence[Row], timeout_s: float) -> list[Outcome]:
    """Score ``rows`` in forked children, one row at most ``timeout_s`` seconds; a hung child is killed."""
    context = multiprocessing.get_context("fork")  # the function may be defined in a notebook: no pickling
    outcomes: list[Outcome] = []
    while len(outcomes) < len(rows):
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_score_rows, args=(fn, rows[len(outcomes):], send), daemon=True)
        child.start()
        send.close()
        try:
            while len(outcomes) < len(rows):
                if not receive.poll(timeout_s):
                    outcomes.append(("timeout", None))
                    break
                outcomes.append(receive.recv())
        except EOFError:
            child.join()
            outcomes.append(("error", f"ended its process (exit code {child.exitcode})"))
        finally:
            child.kill()
            child.join()
            receive.close()
    return outcomes
