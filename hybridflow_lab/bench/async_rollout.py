"""``hybridflow-lab bench async``: generation running ahead of training (``rollout.max_staleness``) against the
synchronous loop, on the same placement, in one run.

Throughput: the standard model generating up to ``new_tokens`` (256) per response, stopping at its end-of-sequence token
(the random policy stops at ~1% a token, so lengths vary from a few tokens to the cap), GRPO; the actor
trains on one Ray rank and a rollout group of its own generates on another. ``sync_tok_s`` is the on-policy
loop (staleness 0: generation waits for each update, training waits for generation), ``async_tok_s`` staleness
1 (step n + 1's responses generated while step n trains). Tokens are real response tokens (the attention mask's
count, verl's convention) over the measured steps' seconds; rounds alternate the order. For reference,
``colocated_sync_tok_s`` is the synchronous loop with the actor on both ranks generating itself (the hybrid
engine), this machine's best on-policy use of its two cores.

Learning: the demo's warm start (a tiny model fine-tuned on sorting 8 digits), GRPO with staleness 0, 1 and 2
on that placement, held-out accuracy every ``eval_every`` steps: what staleness costs per step.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from hybridflow_lab.bench.e2e import standard_lab
from hybridflow_lab.demos.demo_tasks import DEMO_TASKS
from hybridflow_lab.demos.rl_demo import eval_curve, quiet_ray, rl_lab
from hybridflow_lab.demos.warm_cache import cached_warm_start

SPLIT = ("actor.ranks=1", "rollout.pool=rollout", "rollout.ranks=1")  # training on one rank, generation on another
THROUGHPUT = ("rollout.ignore_eos=false", "batch.micro_batch_sequences_per_rank=16", "algorithm.kl_loss_coef=0.0")
GOAL = 1.3  # async tokens/s over the synchronous loop's


def run(steps: int = 6, warmup: int = 2, rounds: int = 2, curve_steps: int = 200, eval_every: int = 25,
        staleness: tuple[int, ...] = (0, 1, 2), seed: int = 0, new_tokens: int = 256) -> dict[str, Any]:
    quiet_ray()
    settings = {"sync": (*SPLIT, "rollout.max_staleness=0"), "async": (*SPLIT, "rollout.max_staleness=1"),
                "colocated_sync": ("actor.ranks=2",)}
    measured: dict[str, list[tuple[float, float, list[float]]]] = {name: [] for name in settings}
    for round_index in range(rounds):
        for name in settings if round_index % 2 == 0 else list(settings)[::-1]:
            measured[name].append(tokens_per_second((*settings[name], f"rollout.max_new_tokens={new_tokens}"), steps,
                                                    warmup))
    rates = {name: sum(t for t, _, _ in runs) / sum(s for _, s, _ in runs) for name, runs in measured.items()}
    report: dict[str, Any] = {
        "bench": "async", "workload": f"standard model, up to {new_tokens} response tokens (EOS stops), 16 prompts x 4",
        "steps": steps, "rounds": rounds,
        "sync_tok_s": round(rates["sync"], 1), "async_tok_s": round(rates["async"], 1),
        "ratio": round(rates["async"] / rates["sync"], 3), "goal": GOAL,
        "goal_met": rates["async"] / rates["sync"] >= GOAL,
        "colocated_sync_tok_s": round(rates["colocated_sync"], 1),
        "ratio_vs_colocated": round(rates["async"] / rates["colocated_sync"], 3),
        "staleness": {name: measured[name][-1][2] for name in ("sync", "async")},
        "rounds_tok_s": {name: [round(t / s, 1) for t, s, _ in runs] for name, runs in measured.items()},
    }
    if curve_steps:
        report["curves"] = curves(curve_steps, eval_every, staleness, seed)
    return report


def tokens_per_second(overrides: tuple[str, ...], steps: int, warmup: int) -> tuple[float, float, list[float]]:
    """Response tokens and seconds of ``steps`` steps after ``warmup``, and each step's mean staleness."""
    with tempfile.TemporaryDirectory() as tmp:
        lab = standard_lab(tmp, 1, "torch", extra=(*THROUGHPUT, *overrides))
        try:
            for _ in range(warmup):
                lab.step()
            start = time.perf_counter()
            history = [lab.step() for _ in range(steps)]
            seconds = time.perf_counter() - start
        finally:
            lab.shutdown()
    rows = 16 * 4
    tokens = sum(m["response_length/mean"] * rows for m in history)
    return tokens, seconds, [m.get("rollout/staleness_mean", 0.0) for m in history]


def curves(steps: int, eval_every: int, staleness: tuple[int, ...], seed: int) -> dict[str, Any]:
    """Held-out accuracy every ``eval_every`` steps for each staleness, from the demo's warm start."""
    demo = DEMO_TASKS["sorting"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, warm = cached_warm_start("sorting", seed)
        out: dict[str, Any] = {"task": demo.description, "seed": seed, "sft_steps": warm["sft/steps"], "runs": {}}
        for k in staleness:
            lab = rl_lab(root, demo, seed, steps, f"staleness{k}", "trainer.progress=false",
                         f"trainer.eval_every={eval_every}", *SPLIT, f"rollout.max_staleness={k}", model_dir=model_dir)
            try:
                before = lab.evaluate()["eval/accuracy"]
                start = time.perf_counter()
                history = lab.run()
                seconds = time.perf_counter() - start
            finally:
                lab.shutdown()
            out["runs"][str(k)] = {"accuracy": {0: before, **eval_curve(history)}, "rl_s": round(seconds, 1),
                                   "staleness_mean": round(sum(m.get("rollout/staleness_mean", 0.0)
                                                               for m in history) / len(history), 3)}
    return out
