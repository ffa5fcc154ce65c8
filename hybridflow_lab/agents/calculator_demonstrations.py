"""A warm start that shows a model how to call the calculator on a task no one here wrote.

A pretrained model given a tool's description rarely calls it (SmolLM2-135M-Instruct never did in a zero-shot
probe), so RL has no call to reinforce. ``CalculatorDemonstrations`` turns a task whose examples state an
arithmetic expression (``task.expression(example)``, as reasoning-gym's arithmetic generators do) into worked
exchanges: in a ``share`` of them (picked by a hash of the prompt) the policy calls ``calc`` on the expression in the
run's call format, the tool answers, and the policy gives the task's demonstration; in the rest it answers at once,
as a model that has not learned when to call does. RL then has both behaviours to choose between.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from hybridflow_lab.agents.call_formats import CallFormat
from hybridflow_lab.tasks.base import Example, Task, WrappedTask, in_share
from hybridflow_lab.tasks.calculator import calc


class ExpressionTask(Task, Protocol):
    def expression(self, example: Example) -> str | None:
        """The arithmetic expression ``example`` asks for, or None."""
        ...


@dataclass(frozen=True)
class CalculatorDemonstrations(WrappedTask):
    """``task``'s worked exchanges for a warm start, calling ``calc`` in ``call_format`` in a ``share`` of them."""

    task: ExpressionTask
    call_format: CallFormat
    share: float

    def episode(self, example: Example) -> list[tuple[str, str | None]]:
        """Each policy turn's text and the tool's answer to it (None after the last). An expression the calculator
        cannot read (reasoning-gym's negated brackets, ``-( 2 * 3 )``) is answered at once: no failing call is
        shown."""
        answer = self.task.demonstration(example)
        expression = self.task.expression(example)
        if expression is None or not in_share(example, self.share):
            return [(answer, None)]
        try:
            result = calc(expression)
        except ValueError:
            return [(answer, None)]
        return [(self.call_format.call_text("calc", {"expression": expression}), result), (answer, None)]
