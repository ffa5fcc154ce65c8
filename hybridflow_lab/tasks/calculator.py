"""Multi-digit multiplication with a calculator tool: ``"123*456="`` -> ``[calc 123*456]``, the tool answers
``56088``, then the answer ``56088``.

A task where the tool is needed: the bundled tiny models cannot multiply 3-digit numbers in their heads, but can
learn to copy the operands into a call and the tool's result into the answer. The reward is the final answer's
(exact match; partial credit for a wrong integer).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from hybridflow_lab.tasks.base import Example, in_share
from hybridflow_lab.tasks.countdown import parse_expression
from hybridflow_lab.tasks.rewards import digit_score, integer_format_score


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: integers, + - * / and parentheses.

    Args:
        expression: the expression, for example 123*456
    """
    value, _ = parse_expression(expression)
    return str(value.numerator) if value.denominator == 1 else str(value)


@dataclass(frozen=True)
class CalculatorTask:
    """Two ``digits``-digit operands, multiplied; ``tools``: the calculator."""

    digits: int = 3
    name: str = "calculator"
    partial_credit: str = "format"  # "format": 0.1 for any integer; "digits": also credit for matching digits
    tool_share: float = 1.0  # of the worked exchanges (``episode``), those that call the tool; the rest answer at once
    tools: tuple[Any, ...] = (calc,)

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ValueError(f"digits must be at least 1, got {self.digits}")
        if not 0 <= self.tool_share <= 1:
            raise ValueError(f"tool_share must be in [0, 1], got {self.tool_share}")
        if self.partial_credit not in ("format", "digits"):
            raise ValueError(f"partial_credit must be 'format' or 'digits', got {self.partial_credit!r}")

    def sample(self, rng: random.Random) -> Example:
        low, high = 10 ** (self.digits - 1), 10**self.digits
        left, right = rng.randrange(low, high), rng.randrange(low, high)
        return Example(f"{left}*{right}=", str(left * right), self.name)

    def reward(self, prompt: str, response: str, ground_truth: str) -> float:
        """1.0 for the right final answer; partial credit for a wrong integer (``integer_format_score`` or
        ``digit_score``)."""
        if self.partial_credit == "digits":
            return digit_score(response, ground_truth)
        return integer_format_score(response, ground_truth)

    def demonstration(self, example: Example) -> str:
        """The final answer (``episode`` has the whole exchange)."""
        return example.answer

    def episode(self, example: Example) -> list[tuple[str, str | None]]:
        """A worked exchange: each policy turn's text and the tool's answer to it (None after the last). A
        ``tool_share`` of the examples (picked by a hash of the prompt) call the tool; the others answer at once,
        as a model that has not learned when to call it does."""
        expression = example.prompt.removesuffix("=")
        if not in_share(example, self.tool_share):
            return [(example.answer, None)]
        return [(f"[calc {expression}]", calc(expression)), (example.answer, None)]
