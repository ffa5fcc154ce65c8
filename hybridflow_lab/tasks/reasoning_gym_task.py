"""Any of reasoning-gym's procedural generators as a task, scored by reasoning-gym's own ``score_answer``.

reasoning-gym (PyPI ``reasoning-gym``) builds entry ``i`` of a generator from ``random.Random(seed + i)``, so an
entry is named by its index: the ground truth carries the index and the oracle answer (for display), and the
reward builds the entry again to score the answer against it (some scorers read the entry's metadata, such as a
Countdown puzzle's numbers). Training draws indices from the run's prompt stream and evaluation from its own seed
namespace (``tasks.source.held_out``), and the questions are split by a hash of their text (``computation``), so a
held-out question is never trained on however small the generator's space is.
"""

from __future__ import annotations

import difflib
import functools
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridflow_lab.tasks.base import Example

INDICES = 1_000_000  # entries per generator to draw from (each one is built on demand)
ANSWER_FORMAT = "Give only the final answer, between <answer> and </answer>."


def generator_names() -> list[str]:
    """The names of reasoning-gym's registered generators."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


@functools.cache
def _dataset(name: str, options: str) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=0, size=INDICES, **json.loads(options))


@dataclass(frozen=True)
class ReasoningGymTask:
    """Generator ``dataset`` built with ``options`` (its config's fields, e.g. ``{"min_digits": 2}``); a run gives
    it tools with ``agent.tools``."""

    dataset: str
    options: Mapping[str, Any] = field(default_factory=dict)
    name: str = "reasoning_gym"

    def __post_init__(self) -> None:
        names = generator_names()
        if self.dataset not in names:
            close = difflib.get_close_matches(self.dataset, names, n=5, cutoff=0.5)
            hint = f"close names: {', '.join(close)}" if close \
                else f"{len(names)} generators, e.g. {', '.join(names[:8])}"
            raise ValueError(f"dataset {self.dataset!r} is not a reasoning-gym generator; {hint}")
        try:
            self._generator()
        except (TypeError, AssertionError, ValueError) as exc:
            raise ValueError(f"dataset_options {dict(self.options)!r} do not fit reasoning-gym's {self.dataset} "
                             f"generator: {exc}") from None

    def _generator(self) -> Any:
        return _dataset(self.dataset, json.dumps(dict(self.options), sort_keys=True))

    def entry(self, index: int) -> dict[str, Any]:
        """The generator's entry ``index`` (question, answer, metadata)."""
        return self._generator()[index]

    def sample(self, rng: random.Random) -> Example:
        index = rng.randrange(INDICES)
        entry = self.entry(index)
        truth = json.dumps({"index": index, "answer": str(entry["answer"])})
        return Example(f"{entry['question']}\n{ANSWER_FORMAT}", truth, f"reasoning_gym/{self.dataset}")

    def reward(self, prompt: str, response: str, ground_truth: str) -> float:
        """reasoning-gym's score of the answer between the last ``<answer>`` tags (its ``extract_answer``)."""
        from reasoning_gym.utils import extract_answer

        entry = self.entry(json.loads(ground_truth)["index"])
        return float(self._generator().score_answer(extract_answer(response), entry))

    def demonstration(self, example: Example) -> str:
        return f"<answer>{json.loads(example.answer)['answer']}</answer>"

    def expression(self, example: Example) -> str | None:
        """The arithmetic expression the entry states (reasoning-gym's arithmetic generators do), or None."""
        return self.entry(json.loads(example.answer)["index"])["metadata"].get("expression")

    def computation(self, example: Example) -> str:
        """The question: equal questions fall on one side of the train/evaluation split."""
        return example.prompt
