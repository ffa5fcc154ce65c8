"""Rollouts generated ahead of training: up to ``rollout.max_staleness`` steps' responses in flight.

With a rollout group of its own (``rollout.pool``), generation need not wait for the actor. ``lab.rollout()``
hands the step the oldest responses in the queue and starts generating the next ones, with whatever weights
the rollout group holds by then. The actor's weights reach the rollout group after each update, queued
behind the generations already started, so a batch is at most k policy versions old (k = 1 is verl's
one-step off-policy: step n + 1's responses are generated while step n trains). The prompt stream's
position before each queued batch's prompts is kept, so a checkpoint resumes from the first prompts that
were not trained on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from hybridflow_lab.dataflows import StepContext
from hybridflow_lab.dataflows.pending import Batch
from hybridflow_lab.trainer.prompt_stream import Position, PromptStream

Draw = Callable[[StepContext, bool], Batch]  # (the step it is for, whether ahead) -> its responses


class RolloutsAhead:
    """The queue of responses generated ahead (``depth`` = ``rollout.max_staleness``) by ``draw`` (prompts from
    ``prompts``) and, for each step they are meant for, its ``StepContext`` (their generation's seconds and seeds)
    and where the prompt stream stood."""

    def __init__(self, depth: int, prompts: PromptStream, draw: Draw, run_seed: int) -> None:
        self.depth, self.prompts, self.draw, self.run_seed = depth, prompts, draw, run_seed
        self.queue: deque[tuple[int, Batch]] = deque()
        self.next_step: int | None = None
        self.contexts: dict[int, StepContext] = {}
        self.positions: dict[int, Position] = {}

    def reset(self) -> None:
        """Forget the queue (the Lab restarted, or loaded a checkpoint): the next ``take`` generates afresh."""
        self.queue.clear()
        self.next_step = None
        self.contexts.clear()
        self.positions.clear()

    def rewind(self, step: int) -> None:
        """``reset``, with the prompts of the dropped responses put back: the prompt stream returns to before
        ``step``, the first step not trained on (the Lab restarts its groups, e.g. to change ``max_staleness``)."""
        position = self.positions.get(step)
        if position is not None:
            self.prompts.restore(position)
        self.reset()

    def take(self, current: StepContext) -> Batch:
        """The responses for step ``current``, after starting generation for the steps up to ``depth`` ahead."""
        if self.next_step is None:
            self.next_step = current.index
        while len(self.queue) <= self.depth:
            step = self.next_step
            self.positions[step] = self.prompts.position()
            context = current if step == current.index else \
                self.contexts.setdefault(step, StepContext(step, self.run_seed))
            self.queue.append((step, self.draw(context, step > current.index)))
            self.next_step = step + 1
        for old in [s for s in self.positions if s < current.index]:
            del self.positions[old]
        return self.queue.popleft()[1]

    def context(self, step: int) -> StepContext | None:
        """The context made ahead for ``step`` (holding its generation's seconds), if one was."""
        return self.contexts.pop(step, None)

    def position(self, step: int) -> Position | None:
        """Where the prompt stream stood before ``step``'s prompts were drawn ahead (None when they were not)."""
        return self.positions.get(step)
