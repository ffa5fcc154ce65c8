"""The main demo (``make demo``): SFT a tiny model on a bundled task, then GRPO on a local Ray cluster.

Prints one progress bar, held-out greedy accuracy before RL and every 50 RL steps, a JSON summary, and where to
look next (the run directory with metrics.jsonl, spans.jsonl and checkpoints; its live dashboard). The default
task is sorting 8 digits: a short supervised warm start, stopped at a target loss, teaches the format and
leaves a policy that samples the right answer far more often than it decodes it greedily, the latent skill
RL sharpens (docs/rl-on-cpu.md). ``arithmetic`` (2-digit addition) shows where RL gains little.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow_lab.agents import CALL_FORMATS
from hybridflow_lab.agents.feedback import RetryDemonstrations
from hybridflow_lab.config.presets import resolve_config
from hybridflow_lab.controller import init_cluster
from hybridflow_lab.models import create_model_dir
from hybridflow_lab.tasks import Task, make_task
from hybridflow_lab.trainer.lab import Lab
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


def quiet_ray() -> None:
    """Start the local Ray without its start-up notes (they are not the demo's)."""
    init_cluster(logging_level=logging.ERROR)


def rl_lab(root: Path, demo: DemoTask, seed: int, steps: int, run: str = "grpo", *extra: str,
           model_dir: Path | None = None) -> Lab:
    """The demo's RL run from the warm start in ``root`` (or ``model_dir``; ``extra`` overrides on top), in
    ``root / run``."""
    model_dir = root / "sft" if model_dir is None else model_dir
    return Lab(demo.preset, overrides=(f"actor.model_path={model_dir}", f"trainer.run_dir={root / run}",
                                       f"trainer.steps={steps}", f"trainer.eval_every={demo.eval_every}",
                                       f"seed={seed}", *extra))


def main(run_dir: str = "runs/demo", task: str = "sorting", sft_steps: int | None = None,
         rl_steps: int | None = None, seed: int = 0, rollout_engine: str = "torch") -> dict[str, object]:
    """Run the demo on ``DEMO_TASKS[task]`` with ``seed`` (the model's initialisation, SFT and RL); ``sft_steps``
    caps the task's own supervised budget, ``rl_steps`` replaces its RL steps; ``rollout_engine`` generates
    (``torch`` built-in, or ``vllm``). A task with tools also reports the share of held-out episodes that called
    the tool successfully (``tool_use``) and of calls that returned text (``calls_ok_share``)."""
    demo = DEMO_TASKS[task]
    rl_steps = rl_steps or demo.rl_steps
    start = time.perf_counter()
    root = Path(run_dir)
    print(f"[demo] supervised warm start on {demo.description} (seed {seed})", flush=True)
    warm = warm_start(root, demo, seed, sft_steps)
    quiet_ray()
    lab = rl_lab(root, demo, seed, rl_steps, "grpo", f"rollout.engine={rollout_engine}")
    evaluated = lab.evaluate()
    before = evaluated["eval/accuracy"]
    engines = f"{lab.config.actor.engine.backend} training, {'vLLM' if rollout_engine == 'vllm' else 'built-in'} " \
              "generation"
    print(f"[demo] after {warm['sft/steps']} SFT steps (loss {warm['sft/final_loss']:.3f}): held-out accuracy "
          f"{before:.3f}; GRPO for {rl_steps} steps on {lab.config.actor.ranks} Ray ranks ({engines})", flush=True)
    history = lab.run()
    lab.save()
    evaluated_after = lab.evaluate()
    after = evaluated_after["eval/accuracy"]
    curve = eval_curve(history)
    lab.shutdown()
    print(accuracy_curve({0: before, **curve}))
    summary = {"seed": seed, "sft_steps": warm["sft/steps"], "sft_final_loss": round(warm["sft/final_loss"], 4),
               "accuracy_before_rl": before, "accuracy_after_rl": after,
               "gain_points": round(100 * (after - before), 1), f"accuracy_every_{demo.eval_every}_steps": curve}
    for name, key in (("tool_use", "eval/agent/tool_use"), ("calls_ok_share", "eval/agent/calls/ok_share"),
                      ("solved", "eval/agent/solved"), ("turns_to_solve", "eval/agent/turns_to_solve")):
        if key in evaluated:
            summary.update({f"{name}_before_rl": evaluated[key], f"{name}_after_rl": evaluated_after[key]})
    summary.update({"wall_s": round(time.perf_counter() - start, 1), "run_dir": str(root / "grpo")})
    print(json.dumps(summary, indent=2))
    print(f"[demo] next: the run's metrics, spans and checkpoints are in {root / 'grpo'}; watch it with "
          f"`make dashboard RUN={root / 'grpo'}`, or open notebooks/grpo_experiment.ipynb")
    return summary


def eval_curve(history: list[dict[str, float]]) -> dict[int, float]:
    """Held-out accuracy by step, from the steps of ``history`` that evaluated."""
    return {step: metrics["eval/accuracy"] for step, metrics in enumerate(history, 1) if "eval/accuracy" in metrics}


def accuracy_curve(points: dict[int, float], width: int = 40) -> str:
    """Held-out accuracy by RL step as a text bar chart."""
    bars = [f"[demo] step {step:>4}  {accuracy:.3f} {'#' * round(accuracy * width)}"
            for step, accuracy in points.items()]
    return "\n".join(["[demo] held-out greedy accuracy by RL step:", *bars])


if __name__ == "__main__":
    main()
