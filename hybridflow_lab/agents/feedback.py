"""A task's checker as a multi-turn environment: each answer is scored, and a wrong one gets the checker's feedback
(what was wrong) and another try, until it is right or the tries run out.

The reward of a solved episode is the task's score discounted by ``retry_discount`` per extra try, so a policy
that gets it right sooner scores more; one never solved scores its last answer (the task's partial credit).
The number of turns to success falls as training makes first answers right (``agent/turns_to_solve``).
"""

from __future__ import annotations

from hybridflow_lab.agents.environment import StepResult
from hybridflow_lab.tasks.base import Example, Task

TRY_AGAIN = "wrong, try again"  # the feedback of a task that has no ``feedback`` method


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
        feedback = getattr(self.task, "feedback", None)
        return StepResult(feedback(prompt, answer, truth) if feedback else TRY_AGAIN, role="user",
                          counts={"retries": 1.0})
