"""The environments of a batch of trajectories, stepped together each turn: in this process one after another
(``LocalEnvironments``), or spread over a pool of Ray actors (``trainer.environment_pool``) so that slow tools of
different trajectories run at once."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from hybridflow_lab.agents.environment import Environment, StepResult
from hybridflow_lab.tasks.base import Example


@dataclass(frozen=True)
class EnvStep:
    """An environment's answer to one turn, how long it took, and whether the environment raised (its trajectory
    then ends, scored 0)."""

    result: StepResult
    seconds: float
    failed: bool = False


class Environments(Protocol):
    def reset(self, examples: Sequence[Example]) -> list[str]:
        """One fresh trajectory per example (environment ``i`` takes example ``i``); the prompts they return."""
        ...

    def step(self, actions: Mapping[int, str]) -> dict[int, EnvStep]:
        """Environment ``i``'s answer to the turn ``actions[i]``, for each ``i`` given."""
        ...


def step_one(env: Environment, action: str) -> EnvStep:
    """``env.step(action)``, timed; an exception it raises becomes an error result that ends the trajectory."""
    start = time.perf_counter()
    try:
        return EnvStep(env.step(action), time.perf_counter() - start)
    except Exception as exc:  # the environment's own failure: reported, and its trajectory ends
        result = StepResult(f"{type(exc).__name__}: {exc}", done=True, counts={"env_errors": 1.0})
        return EnvStep(result, time.perf_counter() - start, failed=True)


class LocalEnvironments:
    """``envs`` in this process, stepped one after another."""

    def __init__(self, envs: Sequence[Environment]) -> None:
        self.envs = list(envs)

    def reset(self, examples: Sequence[Example]) -> list[str]:
        return [env.reset(example) for env, example in zip(self.envs, examples, strict=True)]

    def step(self, actions: Mapping[int, str]) -> dict[int, EnvStep]:
        return {index: step_one(self.envs[index], action) for index, action in actions.items()}
