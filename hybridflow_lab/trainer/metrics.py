"""verl-compatible metrics computed from a step's batch (``response_length/mean``, ``critic/score/mean``, ...)."""

from __future__ import annotations

import torch

from hybridflow_lab.protocol import DataBatch


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()),
            f"{prefix}/min": float(values.min())}


def _masked_values(batch: DataBatch, key: str) -> torch.Tensor:
    return batch[key][batch["response_mask"].bool()]


def data_metrics(batch: DataBatch, max_new_tokens: int) -> dict[str, float]:
    """Lengths, scores, rewards, advantages, returns, values and entropy of one step's sequences."""
    response_mask = batch["response_mask"]
    lengths = response_mask.sum(-1)
    prompt_lengths = batch["attention_mask"].sum(-1) - lengths
    metrics = {**_stats("response_length", lengths), **_stats("prompt_length", prompt_lengths),
               "response_length/clip_ratio": float((lengths >= max_new_tokens).float().mean())}
    if "scores" in batch:
        metrics.update(_stats("critic/score", batch["scores"]))
    if "token_rewards" in batch:
        metrics.update(_stats("critic/rewards", (batch["token_rewards"] * response_mask).sum(-1)))
    for key, name in (("advantages", "critic/advantages"), ("returns", "critic/returns"),
                      ("values", "critic/values")):
        if key in batch:
            metrics.update(_stats(name, _masked_values(batch, key)))
    if "entropy" in batch:
        metrics["actor/entropy"] = float(_masked_values(batch, "entropy").mean())
    if "costs" in batch:
        metrics.update(_stats("critic/cost", batch["costs"]))
    return metrics


def accuracy(scores: torch.Tensor) -> float:
    """Share of sequences with a full score (exact match under the bundled rules)."""
    return float((scores >= 1.0).float().mean())


def throughput(batch: DataBatch, seconds: float) -> dict[str, float]:
    """``perf/throughput``: (prompt + response) tokens of the step per second of the step."""
    tokens = float(batch["attention_mask"].sum())
    return {"perf/total_num_tokens": tokens, "perf/throughput": tokens / seconds if seconds > 0 else 0.0}
