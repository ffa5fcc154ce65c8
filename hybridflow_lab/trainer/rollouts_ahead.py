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
from typing import TYPE_CHECKING, Any

from hybridflow_lab.dataflows import StepContext
from hybridflow_lab.dataflows.pending import Batch

if TYPE_CHECKING:
    from hybridflow_lab.trainer.lab import Lab


class RolloutsAhead:
    """The queue of responses generated ahead (``depth`` = ``rollout.max_staleness``) and, for each step they are
    meant for, its ``StepContext`` (their generation's seconds and seeds) and where the prompt stream stood."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.queue: deque[tuple[int, Batch]] = deque()
        self.next_step: int | None = None
        self.contexts: dict[int, StepContext] = {}
        self.positions: dict[int, tuple[dict[str, Any], int]] = {}  # step -> (prompt source state, next uid)

    def reset(self) -> None:
        """Forget the queue (the Lab restarted, or loaded a checkpoint): the next ``take`` generates afresh."""
        self.queue.clear()
        self.next_step = None
        self.contexts.clear()
        self.positions.clear()

    def rewind(self, lab: Lab) -> None:
        """``reset``, with the prompts of the dropped responses put back: ``lab``'s prompt stream returns to before
        the first step not trained on (the Lab restarts its groups, e.g. to change ``max_staleness``)."""
        position = self.positions.get(lab.step_index)
        if position is not None:
            lab.task.source.load_state_dict(position[0])
            lab._next_uid = position[1]
        self.reset()

    def take(self, lab: Lab) -> Batch:
        """The responses for ``lab``'s step, after starting generation for the steps up to ``depth`` ahead."""
        if self.next_step is None:
            self.next_step = lab.step_index
        while len(self.queue) <= self.depth:
            step = self.next_step
            self.positions[step] = (lab.task.source.state_dict(), lab._next_uid)
            context = lab.current_step if step == lab.step_index else \
                self.contexts.setdefault(step, StepContext(step, lab.config.seed))
            self.queue.append((step, lab._generate(lab.next_prompts(), context, ahead=step > lab.step_index)))
            self.next_step = step + 1
        for old in [s for s in self.positions if s < lab.step_index]:
            del self.positions[old]
        return self.queue.popleft()[1]

    def context(self, step: int) -> StepContext | None:
        """The context made ahead for ``step`` (holding its generation's seconds), if one was."""
        return self.contexts.pop(step, None)

    def position(self, step: int) -> tuple[dict[str, Any], int] | None:
        """Where the prompt stream stood before ``step``'s prompts were drawn ahead (None when they were not)."""
        return self.positions.get(step)
