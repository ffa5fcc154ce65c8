"""Sorting a short string of characters: ``"sort:3142="`` -> ``"1234"``."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hybridflow_lab.tasks.base import Example
from hybridflow_lab.tasks.rewards import permutation_score, position_score

PREFIX = "sort:"


@dataclass(frozen=True)
class SortingTask:
    """``length`` characters drawn from ``alphabet`` (repeats allowed), to be put in ascending character order.

    The reward is 1.0 for the sorted string and half the fraction of correctly placed characters for another
    answer: with ``partial_credit="format"`` only for a rearrangement of the input's characters, with
    ``"digits"`` for any answer of the right length (a denser signal for RL); 0.0 otherwise.
    """

    length: int = 4
    alphabet: str = "0123456789"
    name: str = "sorting"
    partial_credit: str = "format"

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"length must be at least 1, got {self.length}")
        if not self.alphabet:
            raise ValueError("alphabet must not be empty")
        if self.partial_credit not in ("format", "digits"):
            raise ValueError(f"partial_credit must be 'format' or 'digits', got {self.partial_credit!r}")

    def sample(self, rng: random.Random) -> Example:
        """Draw the characters one by one from the alphabet."""
        text = "".join(rng.choice(self.alphabet) for _ in range(self.length))
        return Example(f"{PREFIX}{text}=", "".join(sorted(text)), self.name)

    def reward(self, prompt: str, response: str, ground_truth: str) -> float:
        """1.0 exact; partial credit by ``permutation_score`` ("format") or ``position_score`` ("digits")."""
        score = position_score if self.partial_credit == "digits" else permutation_score
        return score(response, ground_truth)

    def demonstration(self, example: Example) -> str:
        """Just the sorted string."""
        return example.answer

    def feedback(self, prompt: str, response: str, ground_truth: str) -> str:
        """What is wrong with a wrong answer (for a multi-turn retry): its length, or the positions (from 1) that
        hold the wrong character."""
        if len(response) != len(ground_truth):
            return f"wrong: {len(ground_truth)} characters, not {len(response)}"
        wrong = [str(i) for i, (got, want) in enumerate(zip(response, ground_truth, strict=True), 1) if got != want]
        return f"wrong at {','.join(wrong)}"
