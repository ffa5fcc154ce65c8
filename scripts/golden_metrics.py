"""Record the learned metrics of fixed PPO and GRPO runs, or compare two recordings: a refactor's check that
behaviour did not change (the same numbers bit for bit, on the same machine).

    python scripts/golden_metrics.py record before.json     # on the old code
    python scripts/golden_metrics.py record after.json      # on the new
    python scripts/golden_metrics.py compare before.json after.json

The runs cover the controller's paths: PPO on Ray with a critic on a pool of its own and overlapped stages,
GRPO on the local backend stage by stage (and replays of its step 2 through GRPO, RLOO and GSPO), and GRPO
with a rollout group generating one step ahead.
Timings are left out (they differ from run to run); everything else a step reports is kept.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

COMMON = ("trainer.progress=false", "batch.rollout_batch_prompts=8", "batch.samples_per_prompt=4",
          "rollout.max_new_tokens=16", "task.eval_size=8", "trainer.eval_every=2", "seed=5", "actor.ranks=1",
          "actor.engine.backend=torch", "actor.optim.lr=1e-3", "batch.update_minibatch_sequences=16",
          "batch.micro_batch_sequences_per_rank=8")
RUNS = {
    "ppo_ray_overlapped": ("backend=ray", "algorithm.name=ppo", "critic.ranks=1", "critic.pool=critic",
                           "critic.engine.backend=torch", "critic.optim.lr=1e-3", "algorithm.kl_loss_coef=0.01",
                           "algorithm.kl_reward_coef=0.02", "trainer.overlap=true"),
    "grpo_local": ("backend=local", "algorithm.name=grpo", "algorithm.kl_loss_coef=0.01", "trainer.capture=reward"),
    "grpo_ray_one_step_ahead": ("backend=ray", "algorithm.name=grpo", "rollout.pool=rollout", "rollout.ranks=1",
                                "rollout.max_staleness=1", "trainer.overlap=true"),
}
STEPS = 3
REPLAYS = ((), ("algorithm.name=rloo",), ("algorithm.policy_loss=gspo",))  # of grpo_local's step 2, after reward


def learned(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith(("timing_s/", "perf/")) and not k.endswith("_s")}


def record(path: str) -> None:
    from hybridflow_lab.controller import shutdown_cluster
    from hybridflow_lab.models import create_model_dir
    from hybridflow_lab.trainer.lab import Lab

    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = create_model_dir(Path(scratch) / "m", "tiny", "qwen2", seed=11)
        for name, overrides in RUNS.items():
            lab = Lab("arithmetic_grpo", overrides=(*COMMON, *overrides, f"actor.model_path={model_dir}",
                                                     f"trainer.run_dir={scratch}/{name}"))
            try:
                history = [learned(m) for m in lab.run(STEPS)]
                # a rollout group's weight load is detached: whether it ended before this line is up to the machine
                stages = sorted({s.stage for s in lab.stage_summaries} - {"sync_weights"})
                if "trainer.capture=reward" in overrides:
                    history += [learned(lab.replay(2, "reward", *replay).metrics) for replay in REPLAYS]
            finally:
                lab.shutdown()
            out[name] = {"history": history, "last_step_stages": stages}
        shutdown_cluster()
    Path(path).write_text(json.dumps(out, indent=1, sort_keys=True))
    print(f"recorded {', '.join(RUNS)} ({STEPS} steps each) in {path}")


def compare(before: str, after: str) -> int:
    a, b = json.loads(Path(before).read_text()), json.loads(Path(after).read_text())
    differences = 0
    for run in sorted(set(a) | set(b)):
        if run not in a or run not in b:
            print(f"{run}: only in {before if run in a else after}")
            differences += 1
            continue
        for step, (x, y) in enumerate(zip(a[run]["history"], b[run]["history"], strict=True), 1):
            for key in sorted(set(x) | set(y)):
                if x.get(key) != y.get(key):
                    print(f"{run} step {step} {key}: {x.get(key)!r} -> {y.get(key)!r}")
                    differences += 1
        if a[run]["last_step_stages"] != b[run]["last_step_stages"]:
            print(f"{run} stages: {a[run]['last_step_stages']} -> {b[run]['last_step_stages']}")
            differences += 1
        keys = sum(len(m) for m in a[run]["history"])
        print(f"{run}: {keys} metric values over {len(a[run]['history'])} steps compared")
    print("equal" if not differences else f"{differences} differences")
    return 1 if differences else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "record":
        record(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
