"""What each algorithm does from one start: the demo's warm start, every run for the same steps on its task.

``hybridflow-lab bench algorithms`` prints the start and, per run, its overrides, held-out accuracy every 50
steps, the gain over the start and the wall seconds (``benchmarks/results/algorithms.json``, docs/rl-on-cpu.md,
tutorial 5). The runs differ only in the overrides listed in ``RUNS``; the prompts are the same (same seed).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from hybridflow_lab.demos.demo_tasks import DEMO_TASKS
from hybridflow_lab.demos.rl_demo import eval_curve, quiet_ray, rl_lab
from hybridflow_lab.demos.warm_cache import cached_warm_start

RUNS: dict[str, tuple[str, ...]] = {
    "grpo": (),
    "ppo": ("algorithm.name=ppo", "critic.optim.lr=1e-4"),
    "remax": ("algorithm.name=remax",),
    "rloo": ("algorithm.name=rloo",),
    "dr_grpo": ("algorithm.name=dr_grpo",),
    "gspo": ("algorithm.policy_loss=gspo",),
    "cispo": ("algorithm.policy_loss=cispo",),
}


def run(steps: int = 300, runs: tuple[str, ...] = tuple(RUNS), task: str = "sorting", seed: int = 0) -> dict[str, Any]:
    """Each of ``runs`` for ``steps`` RL steps from the same warm start of the demo's ``task``."""
    demo = DEMO_TASKS[task]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, warm = cached_warm_start(task, seed)
        quiet_ray()
        report: dict[str, Any] = {"task": demo.description, "seed": seed, "steps": steps,
                                  "sft_steps": warm["sft/steps"], "sft_final_loss": round(warm["sft/final_loss"], 4),
                                  "runs": {}}
        for name in runs:
            lab = rl_lab(root, demo, seed, steps, name, "trainer.progress=false", *RUNS[name], model_dir=model_dir)
            before = lab.evaluate()["eval/accuracy"]
            start = time.perf_counter()
            history = lab.run()
            seconds = time.perf_counter() - start
            after = lab.evaluate()["eval/accuracy"]
            lab.shutdown()
            report["accuracy_before_rl"] = before
            report["runs"][name] = {"overrides": list(RUNS[name]), "accuracy_every_50_steps": eval_curve(history),
                                    "accuracy_after_rl": after, "gain_points": round(100 * (after - before), 1),
                                    "rl_s": round(seconds, 1),
                                    "score_per_step": [round(m["critic/score/mean"], 4) for m in history]}
    return report
