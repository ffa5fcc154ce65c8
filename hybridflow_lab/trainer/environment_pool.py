"""``agent.tool_workers=N``: a batch's environments spread over N Ray actors, each stepping its share of the
trajectories, so that the slow tools of different trajectories run at once.

Trajectory ``i`` lives on worker ``i % N`` for the whole episode (an environment keeps its trajectory's state).
A worker that gives no answer in time is an error naming it and its trajectories, never a silent hang.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from hybridflow_lab.agents.environment import Environment
from hybridflow_lab.agents.environments import EnvStep, step_one
from hybridflow_lab.tasks.base import Example

WORKER_MARGIN_S = 30.0  # a worker's own overhead per turn, beyond its environments' tool timeouts
WORKER_START_S = 120.0  # a worker's process may take this long to start (its first answer, the reset)


class EnvironmentHost:
    """A Ray actor holding the environments of its trajectories (by batch index)."""

    def __init__(self, make_env: Callable[[], Environment]) -> None:
        self.make_env = make_env
        self.envs: dict[int, Environment] = {}

    def reset(self, items: list[tuple[int, Example]]) -> list[str]:
        self.envs = {index: self.make_env() for index, _ in items}
        return [self.envs[index].reset(example) for index, example in items]

    def step(self, items: list[tuple[int, str]]) -> list[EnvStep]:
        return [step_one(self.envs[index], action) for index, action in items]


class EnvironmentPoolError(RuntimeError):
    """An environment worker that failed or gave no answer in time."""


class RayEnvironments:
    """Environments made by ``make_env`` on ``workers`` Ray actors (no CPU reserved: they wait on tools). A worker
    steps its trajectories one after another, each within its tools' ``tool_timeout_s``: its answer to a turn may
    take that long per trajectory, plus ``margin_s``."""

    def __init__(self, make_env: Callable[[], Environment], workers: int, tool_timeout_s: float,
                 margin_s: float = WORKER_MARGIN_S) -> None:
        host = ray.remote(num_cpus=0)(EnvironmentHost)
        self.hosts = [host.remote(make_env) for _ in range(workers)]
        self.tool_timeout_s, self.margin_s = tool_timeout_s, margin_s

    def reset(self, examples: Sequence[Example]) -> list[str]:
        prompts = self._call("reset", dict(enumerate(examples)), WORKER_START_S)
        return [prompts[index] for index in range(len(examples))]

    def step(self, actions: Mapping[int, str]) -> dict[int, EnvStep]:
        return self._call("step", actions)

    def close(self) -> None:
        for host in self.hosts:
            ray.kill(host)

    def _call(self, method: str, by_index: Mapping[int, Any], start_s: float = 0.0) -> dict[int, Any]:
        """Each worker's ``method`` on its share of ``by_index`` (trajectory ``i`` on worker ``i % N``), at once;
        the answers by trajectory index. A worker may take its trajectories' tool timeouts plus the margin (plus
        ``start_s``)."""
        shares: dict[int, list[tuple[int, Any]]] = {}
        for index, item in by_index.items():
            shares.setdefault(index % len(self.hosts), []).append((index, item))
        futures = {worker: getattr(self.hosts[worker], method).remote(items) for worker, items in shares.items()}
        timeout_s = self.tool_timeout_s * max(map(len, shares.values())) + self.margin_s + start_s
        _, waiting = ray.wait(list(futures.values()), num_returns=len(futures), timeout=timeout_s)
        late = [worker for worker, future in futures.items() if future in waiting]
        if late:
            trajectories = sorted(index for worker in late for index, _ in shares[worker])
            raise EnvironmentPoolError(f"environment workers {late} gave no {method} answer within {timeout_s:g} s "
                                       f"(trajectories {trajectories}); an environment step hangs: give its tools a "
                                       "timeout (agent.tool_timeout_s) or fix the environment")
        answers: dict[int, Any] = {}
        try:
            for worker, future in futures.items():
                answers.update(zip([index for index, _ in shares[worker]], ray.get(future), strict=True))
        except ray.exceptions.RayError as exc:
            raise EnvironmentPoolError(f"an environment worker failed during {method}: {exc}") from None
        return answers
