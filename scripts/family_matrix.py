"""Each model family on each training engine: two GRPO steps and two PPO steps on 2 Ray ranks, and the policy loss
on one fixed batch over three updates. Prints one JSON row per family and engine (the closing note of issue 48).

    python scripts/family_matrix.py [--families qwen3,gemma3_text,...] [--engines torch,zero1,...]

The suite runs each transformers-path family on one engine (tests/test_model_families.py); this runs them all.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch

from hybridflow_lab.models import create_model_dir
from hybridflow_lab.trainer.lab import Lab

ENGINES = {"torch": ("torch",), "zero1": ("deepspeed", "zero_stage=1"), "zero2": ("deepspeed", "zero_stage=2"),
           "zero3": ("deepspeed", "zero_stage=3"), "fsdp": ("fsdp",)}
FAMILIES = ("qwen3", "mistral", "gemma3_text", "phi3", "qwen3_moe")
SMALL = ("trainer.progress=false", "actor.ranks=2", "critic.ranks=2", "actor.optim.lr=1e-3", "critic.optim.lr=1e-3",
         "algorithm.entropy_coef=0.01", "batch.rollout_batch_prompts=4", "batch.samples_per_prompt=4",
         "batch.update_minibatch_sequences=16", "batch.micro_batch_sequences_per_rank=4", "task.eval_size=8",
         "rollout.max_new_tokens=5")


def engine_overrides(engine: str) -> tuple[str, ...]:
    backend, *options = ENGINES[engine]
    return tuple(f"{role}.engine.{key}" for role in ("actor", "critic")
                 for key in (f"backend={backend}", *options))


def row(model: Path, family: str, engine: str, run_dir: Path) -> dict[str, object]:
    """Two steps of each algorithm, then three updates on one fixed batch (advantages +1/-1 by row, the old
    log-probs of the policy before them)."""
    result: dict[str, object] = {"family": family, "engine": engine}
    for algorithm in ("grpo", "ppo"):
        lab = Lab("arithmetic_grpo", overrides=(f"actor.model_path={model}", f"algorithm.name={algorithm}",
                                                f"trainer.run_dir={run_dir / algorithm}", "algorithm.kl_loss_coef=0.05",
                                                *SMALL, *engine_overrides(engine)))
        try:
            first, second = lab.run(2)
            result[f"{algorithm}_kl_first"] = first["actor/kl"]
            result[f"{algorithm}_finite"] = all(math.isfinite(m[k]) for m in (first, second) for k in m
                                                if k.startswith(("actor/", "critic/")))
            result[f"{algorithm}_rollout_mismatch_max"] = max(m["actor/rollout_mismatch_max"] for m in (first, second))
            if "actor/routing_mismatch" in second:
                result[f"{algorithm}_routing_mismatch"] = second["actor/routing_mismatch"]
            if algorithm == "grpo":
                batch = lab.reward(lab.generate(lab.next_prompts()))
                signs = torch.tensor([1.0, -1.0]).repeat(len(batch) // 2)[:, None]
                batch["advantages"] = signs * batch["response_mask"]
                batch = lab.ref_log_prob(lab.old_log_prob(batch))  # the ratio moves off 1 as the policy updates
                losses = [lab.update_actor(batch)["actor/pg_loss"] for _ in range(3)]
                result["fixed_batch_pg_loss"] = [round(loss, 5) for loss in losses]
                result["loss_decreases"] = losses[0] > losses[1] > losses[2]
        finally:
            lab.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--engines", default=",".join(ENGINES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            model = create_model_dir(Path(tmp) / family, "tiny", family, seed=2)
            for engine in args.engines.split(","):
                print(json.dumps(row(model, family, engine, Path(tmp) / f"{family}-{engine}")), flush=True)


if __name__ == "__main__":
    main()
