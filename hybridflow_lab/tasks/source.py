"""Training prompts drawn reproducibly from a task or a dataset, with state to resume from."""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence

from hybridflow_lab.tasks.base import Example, Task

EVAL_BUCKETS = 8  # a task that names its problems' computations keeps one in this many for evaluation only


def evaluation_side(task: Task, example: Example) -> bool | None:
    """Whether ``example`` is on the evaluation side of ``task``'s split by computation, or None when the task
    has no such split (no ``computation`` method).

    A task whose problems are few computations told in many ways (word problems) names each problem's
    computation; a stable hash of it assigns every way of telling one computation to the same side, so no
    held-out answer is ever trained on, whatever the story around it.
    """
    computation = getattr(task, "computation", None)
    if computation is None:
        return None
    return zlib.crc32(computation(example).encode()) % EVAL_BUCKETS == 0


def draw(task: Task, rng: random.Random, evaluation: bool = False) -> Example:
    """The next example from ``rng`` on the training side of ``task`` (or the evaluation side)."""
    while True:
        example = task.sample(rng)
        if evaluation_side(task, example) in (None, evaluation):
            return example


class PromptSource:
    """Batches of examples from a ``Task`` (an endless stream) or a list of examples (shuffled epochs).

    From a task, example ``i`` is drawn (``draw``, the training side) from ``random.Random(f"{seed}:{i}")``:
    it depends only on the seed and the index. From a dataset, each epoch visits every example once in an order
    shuffled by the seed and the epoch number; batches run on across epoch boundaries.
    """

    def __init__(self, task_or_examples: Task | Sequence[Example], seed: int) -> None:
        if isinstance(task_or_examples, Sequence):
            if not task_or_examples:
                raise ValueError("PromptSource needs at least one example")
            self.task, self.examples = None, list(task_or_examples)
        else:
            self.task, self.examples = task_or_examples, []
        self.seed = seed
        self.index = 0  # examples drawn so far, over all epochs
        self._epoch_order: tuple[int, list[int]] = (-1, [])  # the last epoch's order, kept

    @property
    def kind(self) -> str:
        return "task" if self.task is not None else "dataset"

    def next_batch(self, n: int) -> list[Example]:
        """The next ``n`` examples."""
        if n < 0:
            raise ValueError(f"batch size must be non-negative, got {n}")
        batch = [self._example(i) for i in range(self.index, self.index + n)]
        self.index += n
        return batch

    def _example(self, i: int) -> Example:
        if self.task is not None:
            return draw(self.task, random.Random(f"{self.seed}:{i}"))
        epoch, position = divmod(i, len(self.examples))
        return self.examples[self._order(epoch)[position]]

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_order[0] != epoch:
            order = list(range(len(self.examples)))
            random.Random(f"{self.seed}:epoch:{epoch}").shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def state_dict(self) -> dict[str, int | str]:
        """Where the source is, as plain ints and strings."""
        return {"kind": self.kind, "seed": self.seed, "index": self.index, "size": len(self.examples)}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        """Continue exactly where the source that saved ``state`` was (its seed included)."""
        expected = {"kind": self.kind, "size": len(self.examples)}
        found = {key: state.get(key) for key in expected}
        if found != expected:
            raise ValueError(f"state was saved by a different source: {found}, this one has {expected}")
        self.seed, self.index = int(state["seed"]), int(state["index"])
        self._epoch_order = (-1, [])


def held_out(task: Task, n: int, seed: int) -> list[Example]:
    """``n`` evaluation examples drawn from the ``eval`` seed namespace, apart from every training stream.

    The random streams never coincide with a ``PromptSource``'s. A task split by computation
    (``evaluation_side``) draws them from its evaluation side, which training never sees; another task with
    few distinct problems can still repeat a training problem by chance.
    """
    return [draw(task, random.Random(f"eval:{seed}:{i}"), evaluation=True) for i in range(n)]


def worked_examples(task: Task, n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` (prompt, demonstration) pairs for a few-shot prompt, from their own seed namespace on the training side
    (apart from the held-out set, though a task with few distinct problems and no split can repeat one)."""
    examples = [draw(task, random.Random(f"shots:{seed}:{i}")) for i in range(n)]
    return [(example.prompt, task.demonstration(example)) for example in examples]


def split_examples(examples: Sequence[Example], eval_fraction: float, seed: int) -> tuple[list[Example],
                                                                                         list[Example]]:
    """A seeded (train, eval) split of a dataset; both parts keep the original order."""
    n_eval = round(len(examples) * eval_fraction)
    if not 0 < n_eval < len(examples):
        raise ValueError(f"eval_fraction={eval_fraction} of {len(examples)} examples leaves an empty split")
    chosen = set(random.Random(f"split:{seed}").sample(range(len(examples)), n_eval))
    train = [example for i, example in enumerate(examples) if i not in chosen]
    return train, [example for i, example in enumerate(examples) if i in chosen]
