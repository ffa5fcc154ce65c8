"""Environments: what answers the policy between its turns.

An environment keeps the state of one trajectory: ``reset(example)`` returns the prompt the policy reads first,
``step(action)`` takes the text of the policy's turn and returns a ``StepResult``: what the policy reads next (as a
tool's result or as a user's message), a reward for the turn, and whether the episode is over. Tools are the
special case ``ToolEnvironment``: a turn holding a call gets the tool's result, a turn without one is the answer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from hybridflow_lab.agents.call_formats import CallFormat, MalformedCall
from hybridflow_lab.agents.tools import Tool, tool_table
from hybridflow_lab.tasks.base import Example

Role = Literal["tool", "user"]
TEXT_RESULTS = (str, int, float, bool)  # what a tool may return; anything else is an error observation


@dataclass(frozen=True)
class StepResult:
    """One turn's outcome: ``observation`` for the policy (None when ``done``), in ``role``'s voice, the turn's
    ``reward``, and ``counts`` for the step's metrics: ``call_attempts`` (a call written, readable or not),
    ``call_ok`` (it returned text), ``tool_calls`` (it reached its tool), ``tool_errors``, ``tool_timeouts``,
    ``malformed_calls``, ``tool_s``."""

    observation: str | None = None
    reward: float = 0.0
    done: bool = False
    role: Role = "tool"
    counts: Mapping[str, float] = field(default_factory=dict)


class Environment(Protocol):
    def reset(self, example: Example) -> str:
        """Start a trajectory for ``example``; returns the prompt the policy reads first."""
        ...

    def step(self, action: str) -> StepResult:
        """The outcome of the policy's turn, whose text is ``action``."""
        ...


RuleFn = Callable[[str, str, str], float]


@dataclass(frozen=True)
class ToolPolicy:
    """How tool calls run: each within ``timeout_s`` seconds; a result longer than ``max_result_chars`` is cut
    (saying so); an error, a timeout, a malformed call or a non-text result becomes an error observation, or with
    ``end_on_error`` ends the trajectory with reward 0."""

    timeout_s: float = 10.0
    max_result_chars: int = 2000
    end_on_error: bool = False


class ToolEnvironment:
    """Tools called in the policy's ``call_format``; the final turn (no call) is scored by ``reward``
    (``reward(prompt, answer, ground_truth)``, the task's rule)."""

    def __init__(self, tools: Iterable[Callable[..., Any] | Tool], call_format: CallFormat, reward: RuleFn,
                 policy: ToolPolicy = ToolPolicy()) -> None:
        self.tools = tool_table(tools)
        self.call_format, self.reward, self.policy = call_format, reward, policy
        self.example: Example | None = None

    def reset(self, example: Example) -> str:
        self.example = example
        return example.prompt

    def step(self, action: str) -> StepResult:
        assert self.example is not None, "reset(example) starts a trajectory"
        try:
            calls = self.call_format.calls(action)
        except MalformedCall as exc:
            return self._error(f"malformed tool call: {exc}", "malformed_calls")
        if not calls:
            return StepResult(reward=self.reward(self.example.prompt, action, self.example.answer), done=True)
        call = calls[-1]
        tool = self.tools.get(call.name)
        if tool is None:
            return self._error(f"no tool named {call.name!r}; tools: {', '.join(self.tools)}", "tool_errors")
        start = time.perf_counter()
        outcome = run_with_timeout(lambda: tool(call.arguments), self.policy.timeout_s)
        counts = {"tool_calls": 1.0, "tool_s": time.perf_counter() - start}  # a call that reached its tool
        if isinstance(outcome, ToolTimeout):
            return self._error(f"{call.name} timed out after {self.policy.timeout_s:g} s", "tool_timeouts", counts)
        if isinstance(outcome, Exception):
            return self._error(f"{call.name} failed: {type(outcome).__name__}: {outcome}", "tool_errors", counts)
        if not isinstance(outcome, TEXT_RESULTS):
            return self._error(f"{call.name} returned a {type(outcome).__name__}, not text", "tool_errors", counts)
        return StepResult(cut(str(outcome), self.policy.max_result_chars),
                          counts={**counts, "call_attempts": 1.0, "call_ok": 1.0})

    def _error(self, message: str, kind: str, counts: Mapping[str, float] | None = None) -> StepResult:
        counts = {**(counts or {}), "call_attempts": 1.0, kind: 1.0}
        if self.policy.end_on_error:
            return StepResult(reward=0.0, done=True, counts=counts)
        return StepResult(f"error: {message}", counts=counts)


def cut(text: str, limit: int) -> str:
    """``text``, or its first ``limit`` characters and how many were left out."""
    return text if len(text) <= limit else f"{text[:limit]}... [{len(text) - limit} more characters cut]"


class ToolTimeout(Exception):
    """A tool call that gave no result in time."""


def run_with_timeout(call: Callable[[], Any], timeout_s: float) -> Any:
    """``call()``'s result, the exception it raised, or a ``ToolTimeout`` after ``timeout_s``. The call runs in a
    daemon thread, abandoned if it hangs: a thread cannot be stopped, but a daemon one does not keep the process
    alive (a tool that may hang belongs in a child process, like the Python tool's)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as exc:  # the tool's own failure, reported to the policy
            outcome.append(exc)

    worker = threading.Thread(target=run, name="hybridflow-tool", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return outcome[0] if outcome else ToolTimeout(f"no result within {timeout_s:g} s")
