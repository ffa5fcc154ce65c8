"""The controller's computations in an iteration, as pure functions of a batch's columns: shaped scores, the KL
penalty in the rewards, advantages and returns, and how stale a batch's responses are."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from hybridflow_lab.algorithms.kl import apply_kl_penalty
from hybridflow_lab.algorithms.masked import token_level
from hybridflow_lab.algorithms.registry import Estimator
from hybridflow_lab.config import AlgorithmConfig
from hybridflow_lab.dataflows.stages import Metrics
from hybridflow_lab.protocol import DataBatch


def shaped_scores(rows: DataBatch, shaping: Callable[[torch.Tensor], torch.Tensor]) -> tuple[DataBatch, float]:
    """``scores`` and ``token_level_scores`` plus ``shaping``'s penalty of each response's length; and its mean."""
    penalty = shaping(rows["response_mask"].sum(-1))
    scores = rows["scores"] + penalty
    return DataBatch({"scores": scores, "token_level_scores": token_level(scores, rows["response_mask"])}), \
        penalty.float().mean().item()


def kl_penalised_rewards(rows: DataBatch, beta: float, kind: str) -> tuple[DataBatch, float]:
    """``token_rewards``: ``token_level_scores`` minus ``beta`` times each token's KL of ``old_log_probs`` to
    ``ref_log_probs`` (``kind``); with ``costs``, ``token_costs``: the costs plus it (Safe-RLHF's mirror image).
    Returns them and the batch's mean KL."""
    mask, old, ref = rows["response_mask"], rows["old_log_probs"], rows["ref_log_probs"]
    rewards, kl = apply_kl_penalty(rows["token_level_scores"], old, ref, mask, beta, kind)
    columns = {"token_rewards": rewards}
    if "costs" in rows:
        columns["token_costs"], _ = apply_kl_penalty(token_level(rows["costs"], mask), old, ref, mask, -beta, kind)
    return DataBatch(columns), kl


def advantage_columns(rows: DataBatch, estimate: Estimator, algorithm: AlgorithmConfig, scores: str,
                      penalised: str) -> DataBatch:
    """``advantages`` and ``returns`` by ``estimate`` from the token rewards ``penalised`` (those the KL penalty
    made), else ``scores`` on each response's last token; with the token rewards it saw."""
    mask = rows["response_mask"]
    token_rewards = rows[penalised] if penalised in rows else token_level(rows[scores], mask)
    advantages, returns = estimate(
        token_rewards=token_rewards, scores=token_rewards.sum(-1), values=rows.get("values"),
        group_ids=torch.as_tensor(rows["uid"].astype(np.int64)), mask=mask,
        baseline_scores=rows.get("baseline_scores"), gamma=algorithm.gamma, lam=algorithm.lam,
    )
    return DataBatch({"advantages": advantages, "returns": returns, penalised: token_rewards})


def staleness(behind: np.ndarray) -> Metrics:
    """``rollout/staleness_{min,mean,max}``: how many policy versions each row's generator was behind."""
    return {"rollout/staleness_min": float(behind.min()), "rollout/staleness_mean": float(behind.mean()),
            "rollout/staleness_max": float(behind.max())}
