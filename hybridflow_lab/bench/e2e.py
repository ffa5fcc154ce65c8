"""``hybridflow-lab bench e2e``: end-to-end RL throughput on the standard workload, the paper's metric.

Standard workload: Qwen2 architecture (hidden 256, 4 layers, 4 heads, 2 KV heads, intermediate
1024, float32, character tokenizer); ``a+b=`` prompts (a, b < 1000) left-padded to 16 tokens; GRPO
with 16 prompts x 4 samples; every response exactly 64 tokens; one optimizer step per batch (so the
update's own forward pass gives the old log-probs); KL 0.04 to the reference. Tokens per step =
64 x (16 + 64) = 5120. Also reported: the share of this machine's matmul roofline the step achieves
(FLOPs the stages must do over a matmul rate measured in the same run).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import torch

from hybridflow_lab.models import create_model_dir, describe, load_causal_lm
from hybridflow_lab.trainer.lab import Lab

STAGES = ("generate", "reward", "old_log_prob", "ref", "adv", "update_actor")


def matmul_gflops(size: int = 2048, repeats: int = 5) -> float:
    """float32 GEMM rate of this process's threads (the roofline)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def standard_lab(tmp: str, ranks: int = 2, engine: str = "deepspeed", backend: str = "ray",
                 extra: tuple[str, ...] = ()) -> Lab:
    """A Lab running the standard workload (plus ``extra`` overrides), its model and run directory under ``tmp``."""
    model = create_model_dir(f"{tmp}/model", "standard", "qwen2", seed=0)
    return Lab("arithmetic_grpo", overrides=(
        f"actor.model_path={model}", f"trainer.run_dir={tmp}/run", "trainer.progress=false",
        f"backend={backend}", f"actor.ranks={ranks}", f"actor.engine.backend={engine}", "task.digits=3",
        "task.eval_size=8",
        "rollout.max_prompt_tokens=16", "rollout.pad_prompts=true", "rollout.max_new_tokens=64",
        "rollout.ignore_eos=true", "batch.rollout_batch_prompts=16", "batch.samples_per_prompt=4",
        "batch.update_minibatch_sequences=64", f"batch.micro_batch_sequences_per_rank={64 // ranks}",
        "algorithm.kl_loss_coef=0.04", *extra,
    ))


def run(steps: int = 8, warmup: int = 2, ranks: int = 2, engine: str = "deepspeed",
        backend: str = "ray") -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        lab = standard_lab(tmp, ranks, engine, backend)
        parameters = describe(load_causal_lm(lab.config.actor.model_path))["non_embedding_parameters"]
        try:
            history = [lab.step() for _ in range(warmup + steps)][warmup:]
        finally:
            lab.shutdown()
    rate = matmul_gflops()
    tokens = 16 * 4 * (16 + 64)  # padded prompt + response positions, all computed
    step_s = statistics.median(m["timing_s/step"] for m in history)
    # forward = 2 N flops per token (generation, reference, old log-probs when that pass runs), backward twice that
    forwards = 2 + ("timing_s/old_log_prob" in history[-1])
    flops = 2 * parameters * tokens * forwards + 6 * parameters * tokens
    return {
        "bench": "e2e", "workload": "standard", "actor_ranks": ranks, "engine": engine, "steps": steps,
        "tokens_per_step": tokens, "step_s_median": round(step_s, 3),
        "tokens_per_s_median": round(statistics.median(tokens / m["timing_s/step"] for m in history), 1),
        "stage_s_median": {s: round(statistics.median(m.get(f"timing_s/{s}", 0.0) for m in history), 4)
                           for s in STAGES},
        "matmul_gflops": round(rate, 1), "step_gflop": round(flops / 1e9, 1),
        "roofline_fraction": round(flops / 1e9 / step_s / rate, 3),
        "roofline_tokens_per_s": round(tokens / (flops / 1e9 / rate), 1),
    }
