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
import shutil
import time
from pathlib import Path

from hybridflow_lab.controller import init_cluster
from hybridflow_lab.demos.demo_tasks import DEMO_TASKS, DemoTask
from hybridflow_lab.demos.warm_cache import cached_warm_start
from hybridflow_lab.trainer.lab import Lab


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
    cached, warm = cached_warm_start(task, seed, sft_steps)  # trained once per machine; later demos reuse it
    shutil.copytree(cached, root / "sft", dirs_exist_ok=True)  # where the docs' next steps start from
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
