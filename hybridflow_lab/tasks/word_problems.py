"""Arithmetic word problems in GSM8K's format, written from a seed, so the GSM8K path runs without a download.

A problem is a short story: someone starts with some objects, 1-3 steps change how many they have (a gain,
a loss, packs bought, an equal share among friends), then a question asks for the count. Its worked solution
has one equation per step and ends in ``#### <answer>``. ``demonstration`` receives only the Example, so it
reads the story back from the prompt; the prompt says everything the solution needs.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from string import Formatter

from hybridflow_lab.tasks.answers import answer_score
from hybridflow_lab.tasks.base import Example

NAMES = ("Mia", "Noah", "Ava", "Liam", "Zoe", "Omar", "Lena", "Ravi", "Sara", "Theo", "Ines", "Kofi")
OBJECTS = ("apples", "marbles", "stickers", "pencils", "cookies", "shells", "stamps", "crayons", "beads", "cards",
           "plums", "balloons")
EDIBLE = frozenset({"apples", "cookies", "plums"})
MAX_GROUPS = 5  # the most packs bought, or friends shared among, in one step


@dataclass(frozen=True)
class Phrasing:
    """One way to tell a step: its sentence in the question and its words in the worked solution.

    Both are format strings over ``name``, ``objects``, ``amount`` and (packs only) ``size``.
    """

    kind: str  # "gain", "loss", "packs" (amount packs of size objects) or "share" (among amount friends)
    question: str
    solution: str
    edible_only: bool = False


PHRASINGS = (
    Phrasing("gain", "{name} gets {amount} more.", "gets {amount} more"),
    Phrasing("gain", "{name} finds {amount} more on the way home.", "finds {amount} more"),
    Phrasing("gain", "A friend gives {name} {amount} more.", "gets {amount} from a friend"),
    Phrasing("loss", "{name} gives {amount} away.", "gives {amount} away"),
    Phrasing("loss", "{name} loses {amount} of them.", "loses {amount}"),
    Phrasing("loss", "{name} eats {amount} of them.", "eats {amount}", edible_only=True),
    Phrasing("packs", "{name} buys {amount} packs of {size} {objects}.", "buys {amount} packs of {size}"),
    Phrasing("packs", "Then {name} buys {amount} boxes with {size} {objects} in each.",
             "buys {amount} boxes of {size}"),
    Phrasing("share", "{name} shares them equally among {amount} friends.",
             "shares them equally among {amount} friends"),
)


@dataclass(frozen=True)
class Step:
    """One change to the count: how it is told and its numbers."""

    phrasing: Phrasing
    amount: int
    size: int = 0  # objects per pack

    def equation(self, count: int) -> tuple[str, int]:
        """The left side of this step's equation on ``count`` (``"17 + 3 * 4"``) and its value.

        ValueError if the count would not stay a whole, non-negative number.
        """
        kind, amount = self.phrasing.kind, self.amount
        if kind == "gain":
            left, after = f"{count} + {amount}", count + amount
        elif kind == "loss":
            left, after = f"{count} - {amount}", count - amount
        elif kind == "packs":
            left, after = f"{count} + {amount} * {self.size}", count + amount * self.size
        elif amount < 2 or count % amount:
            raise ValueError(f"{count} does not share equally among {amount} friends")
        else:
            left, after = f"{count} / {amount}", count // amount
        if after < 0:
            raise ValueError(f"{left} is negative")
        return left, after

    def told(self, name: str, objects: str) -> str:
        """This step's sentence in the question."""
        return self.phrasing.question.format(name=name, objects=objects, amount=self.amount, size=self.size)


@dataclass(frozen=True)
class WordProblem:
    """``name`` starts with ``start`` ``objects``; ``steps`` (at least one) change the count."""

    name: str
    objects: str
    start: int
    steps: tuple[Step, ...]

    def question(self) -> str:
        """The story and its question, one sentence each."""
        whose = "each friend get" if self.steps[-1].phrasing.kind == "share" else f"{self.name} have now"
        return " ".join([f"{self.name} has {self.start} {self.objects}.",
                         *(step.told(self.name, self.objects) for step in self.steps),
                         f"How many {self.objects} does {whose}?"])

    def solution(self) -> str:
        """The worked solution: one line with its equation per step, then ``#### <answer>``."""
        lines, count = [], self.start
        for position, step in enumerate(self.steps):
            left, after = step.equation(count)
            # only the start (2 or more) names the objects: a later count may be 1
            had = f"Then {self.name} has {count}" if position else f"{self.name} starts with {count} {self.objects}"
            did = step.phrasing.solution.format(amount=step.amount, size=step.size)
            lines.append(f"{had} and {did}: {left} = {after}.")
            count = after
        return "\n".join([*lines, f"#### {count}"])


_FIELDS = {"name": r"[A-Z][a-z]+", "objects": r"[a-z]+", "amount": r"(?P<amount>\d+)", "size": r"(?P<size>\d+)"}


def _sentence_pattern(template: str) -> re.Pattern[str]:
    """A regex for the sentences ``template`` formats to, capturing ``amount`` and ``size``."""
    return re.compile("".join(re.escape(text) + (_FIELDS[field] if field else "")
                              for text, field, _, _ in Formatter().parse(template)))


_STEP_SENTENCES = [(phrasing, _sentence_pattern(phrasing.question)) for phrasing in PHRASINGS]
_START = re.compile(r"(?P<name>[A-Z][a-z]+) has (?P<start>\d+) (?P<objects>[a-z]+)\.")
_SENTENCE_BREAK = re.compile(r"(?<=[.?]) ")


def read_problem(prompt: str) -> WordProblem:
    """The problem whose question is ``prompt``; ValueError if it is not a question this task writes."""
    first, *told = _SENTENCE_BREAK.split(prompt)
    start = _START.fullmatch(first)
    steps = [_read_step(sentence) for sentence in told[:-1]]
    if start is None or not steps or None in steps:
        raise ValueError(f"not a word problem this task writes: {prompt[:60]!r}")
    problem = WordProblem(start["name"], start["objects"], int(start["start"]), tuple(steps))
    if problem.question() != prompt:  # e.g. another name in a step, or a number written "07"
        raise ValueError(f"not a word problem this task writes: {prompt[:60]!r}")
    return problem


def _read_step(sentence: str) -> Step | None:
    for phrasing, pattern in _STEP_SENTENCES:
        match = pattern.fullmatch(sentence)
        if match:
            return Step(phrasing, int(match["amount"]), int(match.groupdict().get("size") or 0))
    return None


@dataclass(frozen=True)
class WordProblemTask:
    """Word problems of 1 to ``operations`` steps; the answer is the count the question asks for.

    The starting count, gains, losses and pack sizes are drawn up to ``max_value``; the number of packs bought,
    or of friends sharing, from 2 to ``min(5, max_value)``. A share is only the last step and always exact. Every count
    stays a whole, non-negative number. The reward is ``answer_score``: 1.0 for the right ``#### n`` (or
    ``\\boxed{n}``), ``unformatted_credit`` for the right number without that format, ``format_credit`` for a
    wrong answer in it.
    """

    operations: int = 2
    max_value: int = 20
    name: str = "word_problems"
    unformatted_credit: float = 0.0
    format_credit: float = 0.0

    def __post_init__(self) -> None:
        if self.operations not in (1, 2, 3):
            raise ValueError(f"operations must be 1, 2 or 3, got {self.operations!r}")
        if self.max_value < 2:
            raise ValueError(f"max_value must be at least 2, got {self.max_value!r}")
        for setting in ("unformatted_credit", "format_credit"):
            if not 0.0 <= getattr(self, setting) <= 1.0:
                raise ValueError(f"{setting} must be between 0 and 1, got {getattr(self, setting)!r}")

    def sample(self, rng: random.Random) -> Example:
        """Draw a name, the objects, the starting count, the number of steps, then each step in turn."""
        name, objects, start = rng.choice(NAMES), rng.choice(OBJECTS), rng.randint(2, self.max_value)
        count, steps = start, []
        total = rng.randint(1, self.operations)
        for position in range(total):
            step = self._draw_step(rng, count, objects, last=position == total - 1)
            count = step.equation(count)[1]
            steps.append(step)
        return Example(WordProblem(name, objects, start, tuple(steps)).question(), str(count), self.name)

    def reward(self, prompt: str, response: str, ground_truth: str) -> float:
        """``answer_score`` with this task's credits."""
        return answer_score(response, ground_truth, unformatted_credit=self.unformatted_credit,
                            format_credit=self.format_credit)

    def demonstration(self, example: Example) -> str:
        """The GSM8K-style worked solution, ending in ``#### <answer>``."""
        return read_problem(example.prompt).solution()

    def computation(self, example: Example) -> str:
        """The numbers and operations ``example`` asks for, whoever and whatever the story is about (what splits
        held-out problems from training ones: ``tasks.source.evaluation_side``)."""
        problem = read_problem(example.prompt)
        return " ".join([str(problem.start), *(f"{s.phrasing.kind}:{s.amount}:{s.size}" for s in problem.steps)])

    def _draw_step(self, rng: random.Random, count: int, objects: str, last: bool) -> Step:
        """A step that keeps ``count`` a whole, non-negative number: a loss only of what there is, a share
        (the question then asks what each friend gets) only as the ``last`` step and among a divisor."""
        groups = min(MAX_GROUPS, self.max_value)
        shares = [friends for friends in range(2, groups + 1) if count % friends == 0] if last and count else []
        kinds = ["gain", "packs", *(["loss"] if count else []), *(["share"] if shares else [])]
        kind = rng.choice(kinds)
        phrasing = rng.choice([p for p in PHRASINGS if p.kind == kind and (objects in EDIBLE or not p.edible_only)])
        if kind == "gain":
            return Step(phrasing, rng.randint(1, self.max_value))
        if kind == "loss":
            return Step(phrasing, rng.randint(1, min(count, self.max_value)))
        if kind == "packs":
            return Step(phrasing, rng.randint(2, groups), rng.randint(2, self.max_value))
        return Step(phrasing, rng.choice(shares))
