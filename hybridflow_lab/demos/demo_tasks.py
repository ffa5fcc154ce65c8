"""The demo tasks: each demo's RL preset, its supervised warm start's settings, and the warm start itself."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow_lab.agents import CALL_FORMATS
from hybridflow_lab.agents.feedback import RetryDemonstrations
from hybridflow_lab.config.presets import resolve_config
from hybridflow_lab.models import create_model_dir
from hybridflow_lab.tasks import Task, make_task
from hybridflow_lab.trainer.sft import sft
from hybridflow_lab.trainer.task_setup import TASK_SETTINGS


@dataclass(frozen=True)
class DemoTask:
    """A demo: the RL run's preset (configs/, its task section is what SFT trains on), and how SFT stops."""

    description: str
    preset: str
    sft_steps: int  # at most
    sft_lr: float
    sft_target_loss: float = 0.0  # > 0: stop SFT once its recent mean loss is this low
    sft_settings: tuple[tuple[str, Any], ...] = ()  # the task's settings for the warm start only
    sft_retry_share: float = 0.0  # > 0: this share of the warm start's exchanges retry after feedback
    rl_steps: int = 300
    eval_every: int = 50  # RL steps between held-out evaluations

    @property
    def task(self) -> Task:
        """The bundled task the preset's ``task`` section describes."""
        settings = resolve_config(self.preset).task
        return make_task(settings.name, **TASK_SETTINGS[settings.name](settings))

    @property
    def sft_task(self) -> Task:
        """``task`` with ``sft_settings`` (and retries, with ``sft_retry_share``): what the warm start demonstrates."""
        settings = resolve_config(self.preset).task
        task = make_task(settings.name, **{**TASK_SETTINGS[settings.name](settings), **dict(self.sft_settings)})
        return RetryDemonstrations(task, self.sft_retry_share) if self.sft_retry_share else task


DEMO_TASKS = {
    "sorting": DemoTask("sorting 8 digits", "sorting_grpo", 300, 3e-3, 0.35),
    # RL answers again after the checker's feedback, up to 3 times; the warm start retries in half its exchanges,
    # and RL (a retry discount) teaches it to solve at once: the turns to a solution fall (docs/agents.md)
    "sorting_feedback": DemoTask("sorting 8 digits, retried after feedback", "sorting_feedback_grpo", 300, 3e-3, 0.35,
                                 sft_retry_share=0.5, rl_steps=150),
    "countdown": DemoTask("Countdown with 3 one-digit numbers", "countdown_grpo", 600, 3e-3, 0.45),
    "arithmetic": DemoTask("2-digit addition", "arithmetic_grpo", 700, 3e-3),
    # the warm start calls the tool in 30% of its worked exchanges and answers at once in the rest: RL learns when
    # to call it (docs/agents.md)
    "calculator": DemoTask("3-digit multiplication with a calculator tool", "calculator_grpo", 300, 3e-3,
                           sft_settings=(("tool_share", 0.3),), rl_steps=60, eval_every=20),
}


def warm_start(root: Path, demo: DemoTask, seed: int, max_steps: int | None = None) -> dict[str, float]:
    """A tiny model initialised with ``seed`` and fine-tuned on ``demo``'s demonstrations into ``root / "sft"``."""
    base = create_model_dir(root / "base", "tiny", "qwen2", seed=seed)
    call_format = CALL_FORMATS[resolve_config(demo.preset).agent.call_format]
    return sft(base, demo.sft_task, root / "sft", steps=demo.sft_steps if max_steps is None else max_steps,
               batch_size=64, lr=demo.sft_lr, seed=seed, target_loss=demo.sft_target_loss, call_format=call_format)
