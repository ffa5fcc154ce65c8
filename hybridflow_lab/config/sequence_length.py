"""The longest sequence a run's rollouts make: what the model's positions, vLLM's context and the token budget of
a micro-batch must hold."""

from __future__ import annotations

from hybridflow_lab.config.schema import LabConfig

MULTI_TURN_TASKS = ("calculator",)  # bundled tasks with tools of their own (tests/test_agents.py checks the list)


def multi_turn(config: LabConfig) -> bool:
    """Whether rollouts are multi-turn: the task has tools, ``agent.tools`` adds some, or ``agent.feedback`` gives
    wrong answers another try."""
    return bool(config.agent.tools) or config.agent.feedback or config.task.name in MULTI_TURN_TASKS


def longest_sequence(config: LabConfig) -> tuple[int, str]:
    """The longest sequence, and the settings whose sum it is: the prompt and the response, or for multi-turn
    rollouts the prompt and the whole trajectory after it (the policy's turns and the observations)."""
    rollout = config.rollout
    if multi_turn(config):
        return rollout.max_prompt_tokens + config.agent.max_tokens, \
            f"rollout.max_prompt_tokens + agent.max_tokens ({rollout.max_prompt_tokens} + {config.agent.max_tokens})"
    return rollout.max_prompt_tokens + rollout.max_new_tokens, \
        f"rollout.max_prompt_tokens + rollout.max_new_tokens ({rollout.max_prompt_tokens} + {rollout.max_new_tokens})"
