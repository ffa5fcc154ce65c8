"""The bundled tasks by name."""

from __future__ import annotations

from collections.abc import Callable

from hybridflow_lab.tasks.arithmetic import ArithmeticTask
from hybridflow_lab.tasks.base import Task
from hybridflow_lab.tasks.calculator import CalculatorTask
from hybridflow_lab.tasks.countdown import CountdownTask
from hybridflow_lab.tasks.reasoning_gym_task import ReasoningGymTask
from hybridflow_lab.tasks.sorting import SortingTask
from hybridflow_lab.tasks.word_problems import WordProblemTask

TASKS: dict[str, Callable[..., Task]] = {"arithmetic": ArithmeticTask, "calculator": CalculatorTask,
                                         "countdown": CountdownTask, "reasoning_gym": ReasoningGymTask,
                                         "sorting": SortingTask,
                                         "word_problems": WordProblemTask}


def make_task(name: str, **kwargs: object) -> Task:
    """The bundled task ``name`` built with ``kwargs`` (e.g. ``make_task("arithmetic", operators="+-")``)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](**kwargs)
