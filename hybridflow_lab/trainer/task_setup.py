"""From the ``task`` config section to prompts, rewards, costs and the held-out set of a run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow_lab.algorithms.dapo import overlong_penalty
from hybridflow_lab.config import ConfigError, LabConfig
from hybridflow_lab.config.schema import TaskConfig
from hybridflow_lab.tasks import (
    Example,
    PromptSource,
    Task,
    digit_cost,
    gsm8k_reward,
    held_out,
    load_gsm8k,
    make_task,
    split_examples,
)

RuleFn = Callable[[str, str, str], float]
COSTS: dict[str, RuleFn] = {"digit_cost": digit_cost}


@dataclass
class TaskSetup:
    """What the Lab needs from a task: a prompt stream, a reward rule, a held-out set, optional cost."""

    source: PromptSource
    reward: RuleFn
    eval_examples: list[Example]
    task: Task | None = None  # a bundled task (for demonstrations); None for a dataset
    cost: RuleFn | None = None
    shaping: Callable[[torch.Tensor], torch.Tensor] = field(default=lambda lengths: torch.zeros(len(lengths)))


# the task config keys each bundled task takes
TASK_SETTINGS: dict[str, Callable[[TaskConfig], dict[str, Any]]] = {
    "arithmetic": lambda c: {"digits": c.digits, "operators": c.operators, "partial_credit": c.partial_credit},
    "sorting": lambda c: {"length": c.length},
}


def build_task(config: LabConfig) -> TaskSetup:
    """The run's task; a bad name, file or row is a ``ConfigError`` raised before workers start."""
    task_config, seed = config.task, config.seed
    if task_config.cost and task_config.cost not in COSTS:
        raise ConfigError("task.cost", f"{task_config.cost!r} is not one of {sorted(COSTS)}")
    cost = COSTS.get(task_config.cost)
    if task_config.name == "gsm8k":
        if not task_config.dataset_path:
            raise ConfigError("task.dataset_path", "the gsm8k task needs a .jsonl or .parquet file")
        try:
            examples = load_gsm8k(task_config.dataset_path)
        except (FileNotFoundError, ValueError) as exc:
            raise ConfigError("task.dataset_path", str(exc)) from None
        train, evaluation = split_examples(examples, 0.1, seed)
        setup = TaskSetup(PromptSource(train, seed), gsm8k_reward, evaluation[: task_config.eval_size], cost=cost)
    else:
        try:
            task = make_task(task_config.name, **TASK_SETTINGS.get(task_config.name, lambda _: {})(task_config))
        except (TypeError, ValueError) as exc:
            setting = str(exc).split()[0]  # the tasks' messages start with the bad setting's name
            raise ConfigError(f"task.{setting}" if hasattr(task_config, setting) else "task.name", str(exc)) from None
        setup = TaskSetup(PromptSource(task, seed), task.reward, held_out(task, task_config.eval_size, seed), task,
                          cost)
    algorithm = config.algorithm
    if algorithm.overlong_buffer:
        max_length, buffer, factor = config.rollout.max_new_tokens, algorithm.overlong_buffer, algorithm.overlong_factor
        setup.shaping = lambda lengths: overlong_penalty(lengths, max_length, buffer, factor)
    return setup
