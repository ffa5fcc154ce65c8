"""From the ``task`` config section to prompts, rewards, costs and the held-out set of a run."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from hybridflow_lab.agents import CALL_FORMATS, AgentLimits, ToolEnvironment, ToolPolicy
from hybridflow_lab.agents.feedback import FeedbackEnvironment
from hybridflow_lab.agents.toolbox import bundled_tools
from hybridflow_lab.agents.tools import tool_table
from hybridflow_lab.algorithms.dapo import overlong_penalty
from hybridflow_lab.config import ConfigError, LabConfig
from hybridflow_lab.config.schema import TaskConfig
from hybridflow_lab.models.tokenizers import load_tokenizer
from hybridflow_lab.tasks import (
    TASKS,
    Example,
    PromptSource,
    Task,
    digit_cost,
    gsm8k_reward,
    held_out,
    load_gsm8k_rows,
    make_task,
    split_examples,
    worked_examples,
)
from hybridflow_lab.tasks.prompts import PromptFormat, has_chat_template, token_counts
from hybridflow_lab.trainer.agent_rollout import AgentSetup

RuleFn = Callable[[str, str, str], float]
COSTS: dict[str, RuleFn] = {"digit_cost": digit_cost}
DATASET_TASK = "gsm8k"  # the task that reads task.dataset_path
EVAL_FRACTION = 0.1  # of a dataset's rows, held out for evaluation
MIN_DATASET_ROWS = math.floor(0.5 / EVAL_FRACTION) + 1  # below it round(rows * EVAL_FRACTION) holds out none


@dataclass
class TaskSetup:
    """What the Lab needs from a task: a prompt stream, a reward rule, a held-out set, optional cost."""

    source: PromptSource
    reward: RuleFn
    eval_examples: list[Example]
    prompt_format: PromptFormat = field(default_factory=PromptFormat)
    task: Task | None = None  # a bundled task (for demonstrations); None for a dataset
    cost: RuleFn | None = None
    shaping: Callable[[torch.Tensor], torch.Tensor] = field(default=lambda lengths: torch.zeros(len(lengths)))
    agent: AgentSetup | None = None  # multi-turn rollouts: a task with tools


# the task config keys each bundled task takes, and the one that sets its prompts' length
TASK_SETTINGS: dict[str, Callable[[TaskConfig], dict[str, Any]]] = {
    "arithmetic": lambda c: {"digits": c.digits, "operators": c.operators, "partial_credit": c.partial_credit},
    "countdown": lambda c: {"numbers": c.length, "digits": c.digits, "operators": c.operators},
    "sorting": lambda c: {"length": c.length, "partial_credit": c.partial_credit},
    "calculator": lambda c: {"digits": c.digits, "partial_credit": c.partial_credit},
    "word_problems": lambda c: {"operations": c.operations, "max_value": c.max_value,
                                "unformatted_credit": c.unformatted_credit, "format_credit": c.format_credit},
    "reasoning_gym": lambda c: {"dataset": c.dataset, "options": c.dataset_options},
}
PROMPT_LENGTH_SETTING = {"arithmetic": "task.digits", "calculator": "task.digits", "countdown": "task.length",
                         "sorting": "task.length", "word_problems": "task.operations",
                         "reasoning_gym": "task.dataset_options"}


def build_task(config: LabConfig) -> TaskSetup:
    """The run's task; a bad name, file, row or too long a prompt is a ``ConfigError`` raised before workers start."""
    task_config = config.task
    if task_config.cost and task_config.cost not in COSTS:
        raise ConfigError("task.cost", f"{task_config.cost!r} is not one of {sorted(COSTS)}")
    cost = COSTS.get(task_config.cost)
    tokenizer = load_tokenizer(config.actor.model_path)
    setup = _dataset_setup(config, tokenizer, cost) if task_config.name == DATASET_TASK \
        else _bundled_setup(config, tokenizer, cost)
    algorithm = config.algorithm
    if algorithm.overlong_buffer:
        max_length, buffer, factor = config.rollout.max_new_tokens, algorithm.overlong_buffer, algorithm.overlong_factor
        setup.shaping = lambda lengths: overlong_penalty(lengths, max_length, buffer, factor)
    return setup


def _prompt_format(config: LabConfig, tokenizer: PreTrainedTokenizerBase, task: Task | None) -> PromptFormat:
    """The chat template when ``task.chat_template`` asks for it (by default: when the tokenizer has one), and
    ``task.few_shot`` of ``task``'s worked examples (None: a dataset, whose rows carry no demonstrations)."""
    task_config, path = config.task, config.actor.model_path
    if task_config.few_shot < 0 or (task_config.few_shot and task is None):
        raise ConfigError("task.few_shot", f"is {task_config.few_shot}; worked examples come from a bundled task's "
                          "demonstrations, so use 0 here (or a bundled task, e.g. task.name=word_problems)")
    available = has_chat_template(tokenizer)
    if task_config.chat_template and not available:
        raise ConfigError("task.chat_template", f"is true, but the tokenizer of {path} has no chat template "
                          "(tokenizer_config.json's chat_template); set task.chat_template=false for raw prompts, "
                          "or save a template with the tokenizer (tokenizer.chat_template = ...; save_pretrained)")
    chat = available if task_config.chat_template is None else task_config.chat_template
    shots = worked_examples(task, task_config.few_shot, config.seed) if task is not None else []
    return PromptFormat(chat, task_config.system_prompt, tuple(shots))


def _dataset_setup(config: LabConfig, tokenizer: PreTrainedTokenizerBase, cost: RuleFn | None) -> TaskSetup:
    path, seed = config.task.dataset_path, config.seed
    prompt_format = _prompt_format(config, tokenizer, None)
    if not path:
        raise ConfigError("task.dataset_path", f"the {DATASET_TASK} task needs a .jsonl or .parquet file")
    try:
        rows = load_gsm8k_rows(path)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError("task.dataset_path", str(exc)) from None
    if len(rows) < MIN_DATASET_ROWS:
        raise ConfigError("task.dataset_path", f"{path} has {len(rows)} rows, too few to hold out "
                          f"{EVAL_FRACTION:.0%} of them for evaluation; give a file with at least {MIN_DATASET_ROWS}")
    _check_prompt_lengths(config, tokenizer, prompt_format, [(f"{path}, row {number}, the prompt", example.prompt)
                                                             for number, example in rows],
                          f"or shorten or drop those rows of {path}")
    train, evaluation = split_examples([example for _, example in rows], EVAL_FRACTION, seed)
    return TaskSetup(PromptSource(train, seed), gsm8k_reward, evaluation[: config.task.eval_size], prompt_format,
                     cost=cost)


def _bundled_setup(config: LabConfig, tokenizer: PreTrainedTokenizerBase, cost: RuleFn | None) -> TaskSetup:
    task_config, seed = config.task, config.seed
    if task_config.name not in TASKS:
        raise ConfigError("task.name", f"unknown task {task_config.name!r}; known tasks: "
                          f"{', '.join(sorted([*TASKS, DATASET_TASK]))}")
    if task_config.dataset_path:
        raise ConfigError("task.dataset_path", f"is {task_config.dataset_path!r}, but the bundled "
                          f"{task_config.name} task reads no file; set task.name={DATASET_TASK} to train on it, or "
                          "task.dataset_path=''")
    if (task_config.dataset or task_config.dataset_options) and task_config.name != "reasoning_gym":
        raise ConfigError("task.dataset", f"names a reasoning-gym generator, which the {task_config.name} task does "
                          "not read; set task.name=reasoning_gym to train on it, or drop task.dataset and "
                          "task.dataset_options")
    try:
        task = make_task(task_config.name, **TASK_SETTINGS.get(task_config.name, lambda _: {})(task_config))
    except (TypeError, ValueError) as exc:
        setting = str(exc).split()[0]  # the tasks' messages start with the bad setting's name
        raise ConfigError(f"task.{setting}" if hasattr(task_config, setting) else "task.name", str(exc)) from None
    tools = getattr(task, "tools", ())
    if config.agent.feedback and (tools or config.agent.tools):
        raise ConfigError("agent.feedback", f"the {task_config.name} task has tools; feedback retries are for a "
                          "task answered at once: set agent.feedback=false, or drop agent.tools")
    agent = feedback_agent(config, task) if config.agent.feedback \
        else tool_agent(config, tools, task.reward) if tools or config.agent.tools else None
    prompt_format = _prompt_format(config, tokenizer, task)
    if agent is not None and agent.schemas and config.agent.describe_tools:
        prompt_format = replace(prompt_format, tools=agent.schemas,
                                tools_text=agent.call_format.describe(agent.schemas))
    evaluation = held_out(task, task_config.eval_size, seed)
    length_setting = PROMPT_LENGTH_SETTING.get(task_config.name, "the task's settings")
    described = ", or agent.describe_tools=false" if prompt_format.tools else ""
    _check_prompt_lengths(config, tokenizer, prompt_format,
                          [(f"the {task_config.name} task's held-out prompt {e.prompt!r}", e.prompt)
                           for e in evaluation], f"or lower {length_setting}{described}")
    return TaskSetup(PromptSource(task, seed), task.reward, evaluation, prompt_format, task, cost, agent=agent)


def tool_agent(config: LabConfig, tools: Sequence[Any], reward: RuleFn) -> AgentSetup:
    """Multi-turn rollouts calling ``tools`` and the bundled ``agent.tools`` in ``agent.call_format``, the final
    answer scored by ``reward``."""
    agent = config.agent
    call_format = CALL_FORMATS[agent.call_format]
    policy = ToolPolicy(agent.tool_timeout_s, agent.max_result_chars, agent.end_on_error)
    try:
        added = bundled_tools(agent.tools)
    except ValueError as exc:
        raise ConfigError("agent.tools", str(exc)) from None
    try:
        table = tool_table([*tools, *added])
    except ValueError as exc:
        raise ConfigError("agent.tools" if added else "task.name", str(exc)) from None
    return AgentSetup(lambda: ToolEnvironment(table.values(), call_format, reward, policy), call_format,
                      AgentLimits(agent.max_turns, agent.max_tokens, config.rollout.max_new_tokens),
                      tuple(tool.schema for tool in table.values()), agent.tool_workers, agent.tool_timeout_s)


def feedback_agent(config: LabConfig, task: Task) -> AgentSetup:
    """Multi-turn rollouts where a wrong answer gets ``task``'s feedback and another try (``agent.max_turns``
    answers in all)."""
    agent = config.agent
    return AgentSetup(lambda: FeedbackEnvironment(task, agent.max_turns, agent.retry_discount),
                      CALL_FORMATS[agent.call_format],
                      AgentLimits(agent.max_turns, agent.max_tokens, config.rollout.max_new_tokens),
                      tool_workers=agent.tool_workers, tool_timeout_s=agent.tool_timeout_s)


def _check_prompt_lengths(config: LabConfig, tokenizer: PreTrainedTokenizerBase, prompt_format: PromptFormat,
                          prompts: Sequence[tuple[str, str]], other_fix: str) -> None:
    """Every prompt (``(where it comes from, text)``), rendered by ``prompt_format``, fits
    ``rollout.max_prompt_tokens`` under the actor's tokenizer: a longer one would fail only once workers generate."""
    limit = config.rollout.max_prompt_tokens
    counts = token_counts(tokenizer, [text for _, text in prompts], prompt_format)
    too_long = [i for i, count in enumerate(counts) if count > limit]
    if too_long:
        first = too_long[0]
        rendered = " once rendered with the chat template" if prompt_format.chat else ""
        raise ConfigError("rollout.max_prompt_tokens", f"{prompts[first][0]}: {counts[first]} tokens{rendered}, "
                          f"more than rollout.max_prompt_tokens={limit} ({len(too_long)} of {len(prompts)} prompts "
                          f"are too long); raise rollout.max_prompt_tokens to {max(counts)}, {other_fix}"
                          f"{', or shorten task.system_prompt' if prompt_format.system_prompt else ''}"
                          f"{', or lower task.few_shot' if prompt_format.shots else ''}")
