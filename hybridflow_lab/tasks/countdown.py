"""Countdown: reach a target with the given numbers, each used once, and + - * /: ``"cd:3,5,7>22="`` -> ``"3*5+7"``.

The classic small-model RL task (TinyZero, AReaL's examples). Puzzles are generated from a seed, so each has a
solution; answers are parsed by a small grammar and evaluated exactly with fractions, never with ``eval``.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass
from fractions import Fraction

from hybridflow_lab.tasks.base import Example

PREFIX = "cd:"
_PROMPT = re.compile(rf"{PREFIX}(\d+(?:,\d+)*)>(\d+)=")
OPERATORS = "+-*/"


class BadExpression(ValueError):
    """Text that is not an arithmetic expression over integers, or that divides by zero."""


def parse_expression(text: str) -> tuple[Fraction, list[int]]:
    """The exact value of ``text`` (integers, + - * /, parentheses; usual precedence, no unary minus) and the
    numbers it uses, in order; ``BadExpression`` for anything else."""
    tokens = re.findall(r"\d+|[-+*/()]|\S", text)
    position = 0
    numbers: list[int] = []

    def peek() -> str | None:
        return tokens[position] if position < len(tokens) else None

    def take() -> str:
        nonlocal position
        if position >= len(tokens):
            raise BadExpression(f"{text!r} ends too early")
        position += 1
        return tokens[position - 1]

    def factor() -> Fraction:
        token = take()
        if token == "(":
            value = expression()
            if peek() != ")":
                raise BadExpression(f"{text!r} has an unclosed parenthesis")
            take()
            return value
        if not token.isdigit():
            raise BadExpression(f"{text!r} has {token!r} where a number belongs")
        numbers.append(int(token))
        return Fraction(int(token))

    def term() -> Fraction:
        value = factor()
        while peek() in ("*", "/"):
            operator, right = take(), factor()
            if operator == "/" and right == 0:
                raise BadExpression(f"{text!r} divides by zero")
            value = value * right if operator == "*" else value / right
        return value

    def expression() -> Fraction:
        value = term()
        while peek() in ("+", "-"):
            operator, right = take(), term()
            value = value + right if operator == "+" else value - right
        return value

    value = expression()
    if position != len(tokens):
        raise BadExpression(f"{text!r} has {tokens[position]!r} after a complete expression")
    return value, numbers


def parse_prompt(prompt: str) -> tuple[list[int], int]:
    """The numbers and the target of a Countdown prompt."""
    match = _PROMPT.fullmatch(prompt.strip())
    if match is None:
        raise ValueError(f"{prompt!r} is not a Countdown prompt ({PREFIX}<numbers>><target>=)")
    return [int(n) for n in match.group(1).split(",")], int(match.group(2))


def solve(numbers: list[int], target: int, operators: str = OPERATORS) -> str | None:
    """The first expression (in a fixed search order) that uses every number once and equals ``target``: the
    numbers in every order, left to right or with the last two grouped; None if there is none."""
    for order in itertools.permutations(numbers):
        for ops in itertools.product(operators, repeat=len(order) - 1):
            for text in _arrangements(order, ops):
                try:
                    if parse_expression(text)[0] == target:
                        return text
                except BadExpression:
                    continue
    return None


def _arrangements(order: tuple[int, ...], ops: tuple[str, ...]) -> list[str]:
    """Ways to write the numbers ``order`` joined by ``ops``: as is (usual precedence), left to right
    (bracketing what came before when a * or / follows a + or -), and with the last two numbers grouped."""
    plain = _joined(order, ops)
    left_to_right = str(order[0])
    for op, number in zip(ops, order[1:], strict=True):
        low_before = "+" in left_to_right or "-" in left_to_right
        left_to_right = f"({left_to_right}){op}{number}" if op in "*/" and low_before else \
            f"{left_to_right}{op}{number}"
    grouped = f"{_joined(order[:-2], ops[:-2])}{ops[-2]}({order[-2]}{ops[-1]}{order[-1]})" if len(order) > 2 \
        else plain
    return list(dict.fromkeys([plain, left_to_right, grouped]))


def _joined(order: tuple[int, ...], ops: tuple[str, ...]) -> str:
    return str(order[0]) + "".join(f"{op}{number}" for op, number in zip(ops, order[1:], strict=True))


@dataclass(frozen=True)
class CountdownTask:
    """``numbers`` numbers drawn from 1 to ``10**digits - 1`` and a positive integer target made from all of them
    with ``operators`` (so every puzzle has a solution).

    The reward is 1.0 for an expression that uses each given number exactly once and equals the target,
    ``format_credit`` for one that uses them but misses, and 0.0 for anything else (text that is not an
    expression, other numbers, a division by zero).
    """

    numbers: int = 3
    digits: int = 1
    operators: str = "+-*"
    name: str = "countdown"
    format_credit: float = 0.1

    def __post_init__(self) -> None:
        if self.numbers < 2:
            raise ValueError(f"numbers must be at least 2, got {self.numbers}")
        if self.digits < 1:
            raise ValueError(f"digits must be at least 1, got {self.digits}")
        if not self.operators or set(self.operators) - set(OPERATORS):
            raise ValueError(f"operators must be a non-empty string of {OPERATORS!r}, got {self.operators!r}")

    def sample(self, rng: random.Random) -> Example:
        """Draw the numbers, then operators and an order of use until the value is a positive integer."""
        while True:
            numbers = [rng.randint(1, 10**self.digits - 1) for _ in range(self.numbers)]
            order = rng.sample(numbers, len(numbers))
            ops = [rng.choice(self.operators) for _ in range(self.numbers - 1)]
            try:
                value, _ = parse_expression(rng.choice(_arrangements(tuple(order), tuple(ops))))
            except BadExpression:
                continue
            if value.denominator == 1 and value > 0:
                return Example(f"{PREFIX}{','.join(map(str, numbers))}>{value.numerator}=", str(value.numerator),
                               self.name)

    def reward(self, prompt: str, response: str, ground_truth: str) -> float:
        """1.0 on target with every number used once, ``format_credit`` for those numbers off target, else 0.0."""
        numbers, _ = parse_prompt(prompt)
        try:
            value, used = parse_expression(response)
        except BadExpression:
            return 0.0
        if sorted(used) != sorted(numbers):
            return 0.0
        return 1.0 if value == int(ground_truth) else self.format_credit

    def demonstration(self, example: Example) -> str:
        """The solver's first solution: one canonical answer per puzzle."""
        numbers, target = parse_prompt(example.prompt)
        solution = solve(numbers, target, self.operators)
        if solution is None:  # every sampled puzzle has one; a dataset row might not
            raise ValueError(f"{example.prompt!r} has no solution with {self.operators!r}")
        return solution

