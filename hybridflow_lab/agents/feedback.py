"""A task's checker as a multi-turn environment: each answer is scored, and a wrong one gets the checker's feedback
(what was wrong) and another try, until it is right or the tries run out.

The reward of a solved episode is the task's score discounted by ``retry_discount`` per extra try, so a policy
that gets it right sooner scores more; one never solved scores its last answer (the task's partial credit).
The number of turns to success falls as training makes first answers right (``agent/turns_to_solve``);
``RetryDemonstrations`` is a warm start that retries, so that there is something to fall from.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow_lab.agents.environment import Role, StepResult
from hybridflow_lab.tasks.base import Example, Task, WrappedTask, in_share

TRY_AGAIN = "wrong, try again"  # the feedback of a task that has no ``feedback`` method


def feedback_text(task: Task, prompt: str, answer: str, truth: str) -> str:
    """What ``task``'s checker says of a wrong ``answer``: its ``feedback``, or ``TRY_AGAIN``."""
    feedback = getattr(task, "feedback", None)
    return feedback(prompt, answer, truth) if feedback else TRY_AGAIN


class FeedbackEnvironment:
    """``task``'s answers checked by its ``reward``; a score of ``solved_at`` or more solves the episode. A wrong
    answer gets ``task.feedback(prompt, answer, truth)`` (or ``TRY_AGAIN``) as a user message, for up to
    ``max_tries`` answers."""

    def __init__(self, task: Task, max_tries: int, retry_discount: float = 1.0, solved_at: float = 1.0) -> None:
        self.task, self.max_tries, self.retry_discount, self.solved_at = task, max_tries, retry_discount, solved_at
        self.example: Example | None = None
        self.tries = 0

    def reset(self, example: Example) -> str:
        self.example, self.tries = example, 0
        return example.prompt

    def step(self, action: str) -> StepResult:
        assert self.example is not None, "reset(example) starts a trajectory"
        self.tries += 1
        prompt, truth = self.example.prompt, self.example.answer
        answer = action.strip()
        score = self.task.reward(prompt, answer, truth)
        solved = score >= self.solved_at
        if solved or self.tries >= self.max_tries:
            reward = score * self.retry_discount ** (self.tries - 1) if solved else score
            return StepResult(reward=reward, done=True, counts={"solved": float(solved)})
        return StepResult(feedback_text(self.task, prompt, answer, truth), role="user", counts={"retries": 1.0})


@dataclass(frozen=True)
class RetryDemonstrations(WrappedTask):
    """``task`` for a feedback run's warm start: in a ``share`` of the worked exchanges (picked by a hash of the
    prompt) a wrong first answer (the right one rotated by a character), the checker's feedback, then the right
    answer; the others answer right at once. A policy that starts there solves in about ``1 + share`` turns, and RL
    (with a retry discount) teaches it to solve at the first try: its turns to a solution fall."""

    share: float
    episode_role: Role = "user"

    def episode(self, example: Example) -> list[tuple[str, str | None]]:
        """The worked exchange: each answer and the feedback to it (None after the right one)."""
        right = self.task.demonstration(example)
        wrong = right[1:] + right[:1]
        if wrong == right or not in_share(example, self.share):
            return [(right, None)]
        return [(wrong, feedback_text(self.task, example.prompt, wrong, example.answer)), (right, None)]
