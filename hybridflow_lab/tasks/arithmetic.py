"""Integer arithmetic on short operands: ``"12+34="`` -> ``"46"``."""

from __future__ import annotations

import operator
import random
from dataclasses import dataclass

from hybridflow_lab.tasks.base import Example
from hybridflow_lab.tasks.rewards import digit_score, integer_format_score

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclass(frozen=True)
class ArithmeticTask:
    """Two operands drawn uniformly from ``[0, 10**digits)`` and an operator drawn from ``operators``.

    Subtraction may go negative (answer ``"-5"``). The reward is exact match, with a small credit
    for a wrong answer that is at least a well-formed integer.
    """

    digits: int = 2
    operators: str = "+"
    name: str = "arithmetic"
    partial_credit: str = "format"  # "format": 0.1 for any integer; "digits": also credit for matching digits

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ValueError(f"digits must be at least 1, got {self.digits}")
        if self.partial_credit not in ("format", "digits"):
            raise ValueError(f"partial_credit must be 'format' or 'digits', got {self.partial_credit!r}")
        if not self.operators or set(self.operators) - set(OPERATIONS):
            raise ValueError(f"operators must be a non-empty string of {''.join(OPERATIONS)!r}, "
                             f"got {self.operators!r}")

    def sample(self, rng: random.Random) -> Example:
        """Draw the left operand, the right operand, then the operator."""
        left, right = rng.randrange(10**self.digits), rng.randrange(10**self.digits)
        op = rng.choice(self.operators)
        return Example(f"{left}{op}{right}=", str(OPERATIONS[op](left, right)), self.name)

    def reward(self, prompt: str, response: str, ground_truth: str) -> float:
        """1.0 exact; partial credit for a wrong integer (``integer_format_score`` or ``digit_score``)."""
        if self.partial_credit == "digits":
            return digit_score(response, ground_truth)
        return integer_format_score(response, ground_truth)

    def demonstration(self, example: Example) -> str:
        """Just the answer."""
        return example.answer
