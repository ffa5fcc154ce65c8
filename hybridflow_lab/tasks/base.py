"""What a task is: examples with a ground truth, and the rule that scores a response."""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Example:
    """One prompt, its ground-truth answer and the name of the task or dataset it came from."""

    prompt: str
    answer: str
    data_source: str


class Task(Protocol):
    """A verifiable task: draws examples and scores responses by rule (no learned reward model).

    A task may also name each problem's computation (``computation(example) -> str``); its held-out problems
    are then computations training never sees (``tasks.source.evaluation_side``).
    """

    name: str

    def sample(self, rng: random.Random) -> Example:
        """Draw one example using only ``rng`` (so equal rng states give equal examples)."""
        ...

    def reward(self, prompt: str, response: str, ground_truth: str) -> float:
        """Score ``response`` to ``prompt`` against ``ground_truth``."""
        ...

    def demonstration(self, example: Example) -> str:
        """The text an SFT model should produce after the prompt (without the EOS token)."""
        ...


@dataclass(frozen=True)
class WrappedTask:
    """A task that draws, scores and demonstrates as ``task`` does; a subclass adds what else it does (a warm
    start's worked exchanges, ``episode``)."""

    task: Task

    @property
    def name(self) -> str:
        return self.task.name

    def sample(self, rng: random.Random) -> Example:
        return self.task.sample(rng)

    def reward(self, prompt: str, response: str, ground_truth: str) -> float:
        return self.task.reward(prompt, response, ground_truth)

    def demonstration(self, example: Example) -> str:
        return self.task.demonstration(example)


def in_share(example: Example, share: float) -> bool:
    """Whether ``example`` falls in a ``share`` of all examples, picked by a stable hash of its prompt (the worked
    exchanges of a warm start that vary by example: which call a tool, which retry)."""
    return zlib.crc32(example.prompt.encode()) % 1000 < share * 1000
